"""The whole decoder against an independent float64 reference written here.

The reference reads only parameters (the state dict) and hash ids; it re-implements embedding
expansion, Engram lookup + gate, hc mixes / Sinkhorn split / collapse / expand, RMSNorm, GQA
attention with rotate-half RoPE, SwiGLU or MoE, and the final collapse + norm + head, without
calling any engramrt forward or engramrt.model.mhc function.
"""

from __future__ import annotations

import functools
import math

import torch

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.config import engram_config
from engramrt.engram.hashing import EngramHasher
from engramrt.engram.layout import EngramLayout
from engramrt.engram.token_map import build_token_map, load_tokenizer
from engramrt.runner.batch import StepBatch
from engramrt.runner.stage import StageRunner, new_kv_cache
from tests.support.model_factory import make_model

T = 7
TOKENS = [17, 402, 88, 17, 402, 951, 33]  # a repeated bigram, no image token (id 5)
F64 = torch.float64


@functools.cache
def token_map(compressed: int) -> torch.Tensor:
    return build_token_map(load_tokenizer(GQA_MODEL_DIR), compressed)


def new_hasher(raw: dict) -> EngramHasher:
    cfg = engram_config(raw)
    return EngramHasher(EngramLayout.from_config(cfg), token_map(cfg.compressed_vocab_size), 1)


def build(seed: int = 0, **overrides):
    """A float32 toy whose hc parameters give non-uniform pres and clearly asymmetric combs."""
    model, raw = make_model(seed=seed, dtype=torch.float32, fp8_tables=False, **overrides)
    state = model.state_dict()
    gen = torch.Generator().manual_seed(1000 + seed)
    for name, value in state.items():
        if ".hc_" not in name:
            continue
        if name.endswith("_base"):
            state[name] = torch.randn(value.shape, generator=gen)
        elif name.endswith("_fn"):
            state[name] = torch.randn(value.shape, generator=gen) * 0.1
        elif name.endswith("_scale"):
            state[name] = torch.rand(value.shape, generator=gen) + 0.5
    model.load_state_dict(state)
    return model, raw


def engramrt_logits(model, raw, tokens: list[int]) -> torch.Tensor:
    session = StageRunner(model, new_hasher(raw), new_kv_cache(model, 1))
    return session.compute(StepBatch(tokens, [0], [len(tokens)], [0]))


def reference_hash_ids(raw: dict, tokens: list[int]) -> torch.Tensor:
    """Hash ids of a single-request prefill (hashing itself is tested in test_hashing.py)."""
    one = torch.tensor
    return new_hasher(raw).extend(one(tokens), one([0]), one([len(tokens)]), one([0]))


# ---- the reference, float64, plain code ---------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def sigmoid(v: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + torch.exp(-v))


def silu(v: torch.Tensor) -> torch.Tensor:
    return v * sigmoid(v)


def swiglu(x: torch.Tensor, p: dict, prefix: str) -> torch.Tensor:
    w1, w2, w3 = (p[f"{prefix}.{n}.weight"] for n in ("w1", "w2", "w3"))
    return (silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def mixes(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """One rsqrt per token over all hc*D elements (copy-major flatten), times fn^T."""
    tokens, hc, dim = x.shape
    flat = torch.stack([torch.cat([x[t, j] for j in range(hc)]) for t in range(tokens)])
    r = 1.0 / torch.sqrt((flat * flat).mean(-1, keepdim=True) + eps)
    return (flat @ fn.T) * r


def split(m: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps):
    """The split: pre = sigmoid+eps, post = 2 sigmoid, comb = softmax+eps then Sinkhorn
    (one column pass, then iters-1 row/column pairs)."""
    tokens = m.shape[0]
    pre = torch.zeros(tokens, hc, dtype=F64)
    post = torch.zeros(tokens, hc, dtype=F64)
    comb = torch.zeros(tokens, hc, hc, dtype=F64)
    for t in range(tokens):
        for j in range(hc):
            pre[t, j] = sigmoid(m[t, j] * scale[0] + base[j]) + eps
            post[t, j] = 2 * sigmoid(m[t, hc + j] * scale[1] + base[hc + j])
        c = torch.zeros(hc, hc, dtype=F64)
        for j in range(hc):
            row = torch.stack(
                [
                    m[t, 2 * hc + hc * j + k] * scale[2] + base[2 * hc + hc * j + k]
                    for k in range(hc)
                ]
            )
            e = torch.exp(row - row.max())
            c[j] = e / e.sum() + eps
        c = c / (c.sum(0, keepdim=True) + eps)
        for _ in range(iters - 1):
            c = c / (c.sum(1, keepdim=True) + eps)
            c = c / (c.sum(0, keepdim=True) + eps)
        comb[t] = c
    return pre, post, comb


def collapse(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return sum(w[:, j, None] * x[:, j] for j in range(x.shape[1]))


def expand(y, x, post, comb, transposed: bool = False) -> torch.Tensor:
    """out_k = post_k y + Σ_j comb[j][k] x_j (comb[k][j] in the deliberately wrong variant)."""
    tokens, hc, _ = x.shape
    out = torch.zeros_like(x)
    for t in range(tokens):
        for k in range(hc):
            acc = post[t, k] * y[t]
            for j in range(hc):
                acc = acc + (comb[t, k, j] if transposed else comb[t, j, k]) * x[t, j]
            out[t, k] = acc
    return out


def engram(x: torch.Tensor, ids: torch.Tensor, p: dict, prefix: str, eps: float) -> torch.Tensor:
    """Rows by Python indexing, wkv, per-(token, copy) gate, value added to each copy."""
    tokens, hc, dim = x.shape
    table = p[f"{prefix}engram.embed.weight"]
    e = torch.stack([torch.cat([table[int(i)] for i in ids[t]]) for t in range(tokens)])
    kv = e @ p[f"{prefix}engram.wkv.weight"].T
    value = kv[:, hc * dim :]
    w = p[f"{prefix}engram.q_weight"] * p[f"{prefix}engram.k_weight"]
    out = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(hc):
            h, key = x[t, j], kv[t, j * dim : (j + 1) * dim]
            rstd = 1 / torch.sqrt((h * h).mean() + eps) / torch.sqrt((key * key).mean() + eps)
            dot = (h * w[j] * key).sum() * rstd * dim**-0.5
            g = sigmoid(torch.copysign(torch.sqrt(dot.abs().clamp(min=1e-6)), dot))
            out[t, j] = h + g * value[t]
    return out


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE on ``[T, heads, hd]`` at positions 0..T-1."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, half, dtype=F64) / half)
    angles = torch.arange(x.shape[0], dtype=F64)[:, None] * inv_freq
    cos, sin = angles.cos()[:, None, :], angles.sin()[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention(x: torch.Tensor, p: dict, prefix: str, cfg) -> torch.Tensor:
    """Causal GQA: query head h reads kv head h // (heads / kv_heads); softmax(QK^T/sqrt(hd))V."""
    tokens, hd = x.shape[0], cfg.body.head_dim
    q = rope(
        (x @ p[f"{prefix}attn.wq.weight"].T).view(tokens, cfg.body.num_heads, hd),
        cfg.body.rope_theta,
    )
    k = rope(
        (x @ p[f"{prefix}attn.wk.weight"].T).view(tokens, cfg.body.num_kv_heads, hd),
        cfg.body.rope_theta,
    )
    v = (x @ p[f"{prefix}attn.wv.weight"].T).view(tokens, cfg.body.num_kv_heads, hd)
    group = cfg.body.num_heads // cfg.body.num_kv_heads
    out = torch.zeros(tokens, cfg.body.num_heads, hd, dtype=F64)
    for h in range(cfg.body.num_heads):
        kvh = h // group
        for t in range(tokens):
            scores = torch.stack([q[t, h] @ k[s, kvh] for s in range(t + 1)]) / math.sqrt(hd)
            probs = torch.exp(scores - scores.max())
            probs = probs / probs.sum()
            out[t, h] = sum(probs[s] * v[s, kvh] for s in range(t + 1))
    return out.reshape(tokens, -1) @ p[f"{prefix}attn.wo.weight"].T


def moe(x: torch.Tensor, p: dict, prefix: str, cfg) -> torch.Tensor:
    """Softmax router, top-k, weights renormalised to 1, Σ w_e expert_e(x) + shared(x)."""
    scores = torch.softmax(x @ p[f"{prefix}ffn.gate.weight"].T, dim=-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        order = sorted(range(cfg.body.n_routed_experts), key=lambda e: -float(scores[t, e]))
        chosen = order[: cfg.body.num_experts_per_tok]
        total = sum(scores[t, e] for e in chosen)
        for e in chosen:
            out[t] += scores[t, e] / total * swiglu(x[t], p, f"{prefix}ffn.experts.{e}")
    if cfg.body.n_shared_experts:
        out = out + swiglu(x, p, f"{prefix}ffn.shared_experts")
    return out


def reference_logits(
    model, hash_ids: torch.Tensor, tokens: list[int], lagged: bool = True, transposed=False
) -> torch.Tensor:
    """Single-pass lagged mHC. ``lagged=False`` (each sublayer collapses with its own
    pre) and ``transposed=True`` (comb read as [dst][src]) are deliberately wrong variants."""
    cfg = model.cfg
    p = {k: v.to(F64) for k, v in model.state_dict().items()}
    hc, eps, hc_eps, iters = cfg.hc_mult, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters
    n = len(tokens)
    emb = torch.stack([p["embed.weight"][tok] for tok in tokens])
    x = torch.stack([emb] * hc, dim=1)
    pre_in = torch.zeros(n, hc, dtype=F64)
    pre_in[:, 0] = 1.0
    for layer in range(cfg.num_layers):
        pf = f"layers.{layer}."
        if layer in cfg.engram.layer_ids:
            x = engram(x, hash_ids[:, cfg.engram.layer_ids.index(layer)], p, pf, eps)
        hc_args = (hc, iters, hc_eps)
        m = mixes(x, p[pf + "hc_attn_fn"], eps)
        a_pre, a_post, a_comb = split(m, p[pf + "hc_attn_scale"], p[pf + "hc_attn_base"], *hc_args)
        y = rms_norm(collapse(x, pre_in if lagged else a_pre), p[pf + "attn_norm.weight"], eps)
        x = expand(attention(y, p, pf, cfg), x, a_post, a_comb, transposed)
        m = mixes(x, p[pf + "hc_ffn_fn"], eps)
        f_pre, f_post, f_comb = split(m, p[pf + "hc_ffn_scale"], p[pf + "hc_ffn_base"], *hc_args)
        y = rms_norm(collapse(x, a_pre if lagged else f_pre), p[pf + "ffn_norm.weight"], eps)
        f = moe(y, p, pf, cfg) if cfg.body.ffn_type == "moe" else swiglu(y, p, pf + "ffn")
        x = expand(f, x, f_post, f_comb, transposed)
        pre_in = f_pre
    y = rms_norm(collapse(x, pre_in), p["norm.weight"], eps)
    return y @ p["head.weight"].T


# ---- tests ---------------------------------------------------------------------------------


def max_rel_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    """Largest |difference| relative to the logit scale (the largest |logit|)."""
    return ((got.double() - want).abs().max() / want.abs().max()).item()


def assert_hc_params_are_discriminating(model) -> None:
    """Guard for the test itself: the first attention comb is asymmetric, its pre non-uniform."""
    p = {k: v.to(F64) for k, v in model.state_dict().items()}
    cfg = model.cfg
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, cfg.hc_mult, cfg.hidden_size, dtype=F64, generator=gen)
    m = mixes(x, p["layers.0.hc_attn_fn"], cfg.rms_norm_eps)
    pre, _, comb = split(
        m, p["layers.0.hc_attn_scale"], p["layers.0.hc_attn_base"], cfg.hc_mult, 20, cfg.hc_eps
    )
    assert (comb - comb.transpose(1, 2)).abs().max() > 0.1
    assert (pre.max(-1).values - pre.min(-1).values).min() > 0.05


def test_dense_decoder_matches_reference_both_layers_engram() -> None:
    """Lagged pre (copy 0 first, FFN uses the attention's pre, final uses the last FFN pre),
    comb orientation, Engram before the mixes, RoPE/GQA: fp32 engramrt == fp64 reference."""
    model, raw = build(num_hidden_layers=2, engram_layer_ids=[0, 1])
    assert_hc_params_are_discriminating(model)
    ids = reference_hash_ids(raw, TOKENS)
    want = reference_logits(model, ids, TOKENS)
    got = engramrt_logits(model, raw, TOKENS)
    assert got.dtype == torch.float32 and got.shape == (T, model.cfg.vocab_size)
    assert max_rel_diff(got, want) < 1e-4


def test_dense_decoder_matches_reference_engram_on_second_layer() -> None:
    """Same with the Engram only at layer 1 (seen by layer 1's attention mixes)."""
    model, raw = build(seed=1, num_hidden_layers=2, engram_layer_ids=[1])
    ids = reference_hash_ids(raw, TOKENS)
    want = reference_logits(model, ids, TOKENS)
    assert max_rel_diff(engramrt_logits(model, raw, TOKENS), want) < 1e-4


def test_wrong_variants_are_far_from_engramrt() -> None:
    """The comparison discriminates: a reference with each sublayer's own pre (V4 style), one
    with the transposed comb, and one without the Engram are all far from engramrt's logits."""
    model, raw = build(num_hidden_layers=2, engram_layer_ids=[0, 1])
    ids = reference_hash_ids(raw, TOKENS)
    got = engramrt_logits(model, raw, TOKENS)
    assert max_rel_diff(got, reference_logits(model, ids, TOKENS)) < 1e-4
    own_pre = reference_logits(model, ids, TOKENS, lagged=False)
    assert max_rel_diff(got, own_pre) > 1e-2
    transposed = reference_logits(model, ids, TOKENS, transposed=True)
    assert max_rel_diff(got, transposed) > 1e-2
    no_engram, _ = build(num_hidden_layers=2, engram_layer_ids=[0, 1])
    for i in (0, 1):  # zero value projection: the Engram adds nothing
        with torch.no_grad():
            no_engram.layers[str(i)].engram.wkv.weight.zero_()
    assert max_rel_diff(got, reference_logits(no_engram, ids, TOKENS)) > 1e-2


def test_engram_skipped_then_turned_back_on() -> None:
    """``disable_engram()`` gives the logits of a reference whose Engram adds nothing (its
    value projection zeroed); ``disable_engram(False)`` the reference with the Engram again."""
    model, raw = build(num_hidden_layers=2, engram_layer_ids=[0, 1])
    silent, _ = build(num_hidden_layers=2, engram_layer_ids=[0, 1])
    for i in (0, 1):
        with torch.no_grad():
            silent.layers[str(i)].engram.wkv.weight.zero_()
    ids = reference_hash_ids(raw, TOKENS)
    model.disable_engram()
    assert (
        max_rel_diff(engramrt_logits(model, raw, TOKENS), reference_logits(silent, ids, TOKENS))
        < 1e-4
    )
    model.disable_engram(False)
    assert (
        max_rel_diff(engramrt_logits(model, raw, TOKENS), reference_logits(model, ids, TOKENS))
        < 1e-4
    )


def test_moe_decoder_matches_reference() -> None:
    """MoE FFN: softmax router in fp32, top-k renormalised, routed + shared SwiGLUs."""
    model, raw = build(
        seed=2,
        ffn_type="moe",
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        engram_layer_ids=[1],
    )
    assert model.cfg.body.norm_topk_prob
    ids = reference_hash_ids(raw, TOKENS)
    want = reference_logits(model, ids, TOKENS)
    assert max_rel_diff(engramrt_logits(model, raw, TOKENS), want) < 1e-4


def test_reference_attention_groups_runs_like_one_per_request() -> None:
    """The torch reference attends runs of one length in one padded SDPA: against per-request
    SDPA (the kernels' oracle) on a batch of equal runs at different starts (keys padded to the
    longest), a run of 0, a run alone in its length, and a padded graph row (slot -1)."""
    from types import SimpleNamespace

    from engramrt.models.gqa.attention import _torch_attention
    from tests.kernels.test_paged_attention import _prefill_case, _prefill_reference

    runs, starts, bs = [5, 5, 0, 12, 5, 1, 1], [0, 37, 4, 3, 11, 60, 0], 4
    q, k_cache, v_cache, tables = _prefill_case(6, 2, 16, bs, runs, starts, torch.float32, 5)
    ctx = SimpleNamespace(  # the cache already holds every position: nothing to write
        slot_mapping=torch.full((sum(runs),), -1),
        run_lens=runs,
        start_pos=starts,
        block_table=tables,
        kv=SimpleNamespace(block_size=bs),
    )
    unused = torch.zeros(sum(runs), 2, 16)
    got = _torch_attention(q, unused, unused, k_cache, v_cache, ctx)
    want = _prefill_reference(q, k_cache, v_cache, tables, runs, starts, bs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
