"""The fused mHC kernels (``engramrt.kernels.mhc_fused``) against the torch reference entry
points of ``engramrt.model.mhc``, and a decoder block run both ways. On a CPU the kernels run in
Triton's interpreter, whose fp32 -> bf16 cast truncates where a GPU rounds to nearest: bf16
outputs are compared in ulps (1 for a value rounded once, 2 for the norm of a rounded row)."""

from __future__ import annotations

import pytest
import torch

from engramrt.model import mhc
from tests.support.kernel_env import kernel_device, triton_runs

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not triton_runs(), reason="Triton cannot run here"),
]
DEV = kernel_device()
HC_EPS, NORM_EPS, ITERS = 1e-6, 1e-20, 20


def ulps_apart(got: torch.Tensor, want: torch.Tensor) -> int:
    """Largest distance in units in the last place between same-dtype tensors (bf16 or fp32);
    values of opposite sign count as far apart."""
    assert got.dtype == want.dtype and got.shape == want.shape
    bits = torch.int16 if got.dtype == torch.bfloat16 else torch.int32
    a, b = got.cpu().view(bits).long(), want.cpu().view(bits).long()
    same_sign = (a < 0) == (b < 0)
    return int(torch.where(same_sign, (a - b).abs(), 1 << 20).max()) if a.numel() else 0


def pre_inputs(seed: int, tokens: int, hc: int, dim: int, dtype: torch.dtype) -> tuple:
    """A stream with copies of different sizes, random mixing parameters (an asymmetric comb
    and non-uniform pre), a random lagged pre and norm weight."""
    g = torch.Generator().manual_seed(seed)
    sizes = torch.linspace(0.3, 3.0, hc)[:, None]
    x = (torch.randn(tokens, hc, dim, generator=g) * sizes).to(dtype)
    mix = (2 + hc) * hc
    fn = torch.randn(mix, hc * dim, generator=g) * 0.5
    scale = torch.rand(3, generator=g) + 0.5
    base = torch.randn(mix, generator=g)
    pre_prev = torch.rand(tokens, hc, generator=g) + 0.05
    weight = (torch.rand(dim, generator=g) + 0.5).to(dtype)
    return x, pre_prev, fn, scale, base, weight


def run_pre(inputs: tuple, hc: int, keep_collapsed: bool = True) -> tuple:
    from engramrt.kernels.mhc_fused import mhc_pre

    got = mhc_pre(*(t.to(DEV) for t in inputs), hc, ITERS, HC_EPS, NORM_EPS, keep_collapsed)
    return tuple(None if t is None else t.cpu() for t in got[:5])


def assert_pre_close(got: tuple, want: mhc.PreMix, dtype: torch.dtype) -> None:
    normed, pre, post, comb, collapsed = got
    for a, b in ((pre, want.pre), (post, want.post), (comb, want.comb)):
        assert a.dtype == torch.float32 and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert normed.dtype == collapsed.dtype == dtype
    if dtype == torch.bfloat16:
        assert ulps_apart(collapsed, want.collapsed) <= 1
        assert ulps_apart(normed, want.normed) <= 2
    else:
        torch.testing.assert_close(collapsed, want.collapsed, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(normed, want.normed, rtol=1e-5, atol=1e-5)


PRE_CASES = [
    (1, 32, torch.float32),
    (1, 128, torch.bfloat16),
    (3, 48, torch.bfloat16),
    (3, 128, torch.float32),
    (17, 48, torch.float32),
    (17, 32, torch.bfloat16),
    (64, 48, torch.float32),
]


@pytest.mark.parametrize(("tokens", "dim", "dtype"), PRE_CASES)
def test_mhc_pre_matches_reference(tokens: int, dim: int, dtype: torch.dtype) -> None:
    """Mixes + rsqrt + Sinkhorn split + lagged collapse + RMSNorm in two launches equal the
    reference composition: fp32 mixing weights to fp32 rounding, the rows to an ulp or two."""
    inputs = pre_inputs(tokens * dim, tokens, 4, dim, dtype)
    want = mhc.mhc_pre(*inputs, 4, ITERS, HC_EPS, NORM_EPS, keep_collapsed=True)
    got = run_pre(inputs, 4)
    assert_pre_close(got, want, dtype)
    # the collapse uses the lagged pre: the sublayer's own pre gives another row
    own = mhc.hc_pre(inputs[0], want.pre)
    assert (own.float() - got[4].float()).abs().max() > 0.05


@pytest.mark.parametrize(("target", "max_block_d"), [(1, 32), (3, 8192)])
def test_mhc_pre_splits_and_long_rows(monkeypatch, target: int, max_block_d: int) -> None:
    """Fewer, longer chunks per mixes program (several steps, a ragged last chunk: hc*D = 160
    is no multiple of 64), and rows longer than a block (collapsed, stored, read back
    in a ragged second pass) give the reference's answer too; hc 2 on the way."""
    from engramrt.kernels import mhc_fused

    monkeypatch.setattr(mhc_fused, "TARGET_PROGRAMS", target)
    monkeypatch.setattr(mhc_fused, "MAX_BLOCK_D", max_block_d)
    assert mhc_fused.mixes_plan(3, 2 * 80).splits == target
    inputs = pre_inputs(target, 3, 2, 80, torch.float32)
    want = mhc.mhc_pre(*inputs, 2, ITERS, HC_EPS, NORM_EPS, keep_collapsed=True)
    got = run_pre(inputs, 2)
    assert_pre_close(got, want, torch.float32)
    assert torch.equal(run_pre(inputs, 2, keep_collapsed=False)[0], got[0])


@pytest.mark.parametrize(("tokens", "dim", "quant"), [(1, 64, 1), (3, 96, 2), (5, 200, 2)])
def test_norm_inputs_are_act_quant_of_the_normed_rows(tokens: int, dim: int, quant: int) -> None:
    """What the linears after the norm read, made in the norm's launch: ``act_codes`` of the
    rounded normed row bit for bit (codes, scales; values with ``VALUES``) and the row in fp32;
    a width of partial scale blocks gets none (the linears quantise the row themselves)."""
    from engramrt.kernels.mhc_fused import mhc_pre
    from engramrt.kernels.quant_roundtrip import act_codes

    inputs = pre_inputs(dim, tokens, 4, dim, torch.bfloat16)
    got = mhc_pre(*(t.to(DEV) for t in inputs), 4, ITERS, HC_EPS, NORM_EPS, quant=quant)
    normed, made = got[0], got[5]
    plain = mhc_pre(*(t.to(DEV) for t in inputs), 4, ITERS, HC_EPS, NORM_EPS)
    for a, b in zip(got[:5], plain[:5], strict=True):  # the rest as without
        assert a is b is None or torch.equal(a, b)
    if dim % 32:
        assert made is None and plain[5] is None
        return
    codes, scale, values = act_codes(normed, values=True)
    assert made.codes.dtype == torch.float8_e4m3fn
    assert torch.equal(made.codes.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(made.scale, scale)
    if quant == 1:
        assert made.values is None and made.wide is None
        return
    assert torch.equal(made.values, values)
    assert torch.equal(made.wide, normed.float())


def test_mixes_plan_depends_on_token_count_alone() -> None:
    """Chunks are whole steps that cover the stream exactly once; many per token at decode
    sizes, few at prefill sizes."""
    from engramrt.kernels.mhc_fused import MAX_SPLITS, TARGET_PROGRAMS, mixes_plan

    k = 4 * 3072
    for tokens in (1, 2, 3, 16, 17, 64, 256, 4096):
        plan = mixes_plan(tokens, k)
        assert plan.chunk % plan.block_k == 0
        assert (plan.splits - 1) * plan.chunk < k <= plan.splits * plan.chunk
        blocks = -(-tokens // plan.block_t)
        assert plan.splits <= MAX_SPLITS and blocks * plan.splits <= max(TARGET_PROGRAMS, blocks)
    assert mixes_plan(1, k).splits == MAX_SPLITS
    assert mixes_plan(8192, k).splits == 1
    assert mixes_plan(1, 64).splits == 1


def test_a_tokens_mixes_ignore_its_step_under_the_flag(monkeypatch) -> None:
    """Under ``--batch-invariant`` one mixes plan serves every token count, so a token's
    outputs alone equal, bit for bit, its outputs among 99 others (without the flag the plans
    of 1 and 100 tokens differ: their partial sums run in other orders)."""
    from engramrt.kernels import mhc_fused

    k = 4 * 96
    assert mhc_fused.mixes_plan(1, k) != mhc_fused.mixes_plan(100, k)
    monkeypatch.setattr(mhc_fused, "batch_invariant", lambda device: True)
    inputs = pre_inputs(11, 100, 4, 96, torch.bfloat16)
    batch = run_pre(inputs, 4)
    for i in (0, 37, 99):
        alone = run_pre((inputs[0][i : i + 1], inputs[1][i : i + 1], *inputs[2:]), 4)
        for a, b in zip(alone, batch, strict=True):
            assert torch.equal(a, b[i : i + 1]), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_expand_ignores_its_step(dtype: torch.dtype) -> None:
    """The expand after a sublayer gives a token the same bits in a step of any size, though
    the step's size picks its column tiles (``post_block_d``: 64, 128 or 256). Left to the
    compiler, ``c0 r0 + c1 r1`` became an FMA of either product, element by element as the
    tile's registers fell (an H100: a bundled prompt alone parted from itself among others).
    Copy 1 nearly cancels copy 0 here, so the product left unfused shows in the result."""
    from engramrt.kernels.mhc_fused import mhc_post, post_block_d

    g = torch.Generator().manual_seed(3)
    t, d = 400, 256
    res = torch.randn(t, 4, d, generator=g)
    res[:, 1] = -res[:, 0]
    comb = torch.rand(t, 4, 4, generator=g) + 0.2
    comb[:, 1] = comb[:, 0] * (1 + torch.rand(t, 4, generator=g) * 2**-8)
    post = torch.rand(t, 4, generator=g)
    y = torch.randn(t, d, generator=g)
    args = [a.to(DEV) for a in (y.to(dtype), res.to(dtype), post, comb)]
    whole = mhc_post(*args)
    parts = ((0, 1), (5, 16), (40, 17), (60, 128), (200, 200))
    assert {post_block_d(n) for _, n in parts} == {64, 128, 256}
    for lo, n in parts:
        alone = mhc_post(*(a[lo : lo + n] for a in args))
        assert torch.equal(alone, whole[lo : lo + n]), n


def test_mhc_pre_is_deterministic_and_optional_collapse() -> None:
    """Two runs are bitwise equal (no atomics); asking for the collapsed row changes nothing."""
    inputs = pre_inputs(5, 9, 4, 48, torch.bfloat16)
    a, b = run_pre(inputs, 4), run_pre(inputs, 4, keep_collapsed=False)
    assert b[4] is None
    for x, y in zip(a[:4], b[:4], strict=True):
        assert torch.equal(x, y)


@pytest.mark.parametrize(
    ("tokens", "dim", "dtype"), [(1, 48, torch.bfloat16), (17, 128, torch.float32)]
)
def test_collapse_norm_matches_reference(tokens: int, dim: int, dtype: torch.dtype) -> None:
    from engramrt.kernels.mhc_fused import collapse_norm

    x, pre, _, _, _, weight = pre_inputs(tokens, tokens, 4, dim, dtype)
    want = mhc.collapse_norm(x, pre, weight, NORM_EPS)
    got = collapse_norm(x.to(DEV), pre.to(DEV), weight.to(DEV), NORM_EPS).cpu()
    if dtype == torch.bfloat16:
        assert ulps_apart(got, want) <= 2
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("tokens", "dim", "dtype"),
    [(1, 32, torch.bfloat16), (3, 48, torch.float32), (17, 600, torch.bfloat16)],
)
def test_mhc_post_matches_reference(tokens: int, dim: int, dtype: torch.dtype) -> None:
    """out_k = post_k y + sum_j comb[j][k] residual_j rounded once; D = 600 spans several
    column blocks with a ragged last one. comb is asymmetric, so a transposed read fails."""
    from engramrt.kernels.mhc_fused import mhc_post

    inputs = pre_inputs(tokens + dim, tokens, 4, dim, dtype)
    ref = mhc.mhc_pre(*inputs, 4, ITERS, HC_EPS, NORM_EPS)
    assert (ref.comb - ref.comb.transpose(1, 2)).abs().max() > 0.1
    g = torch.Generator().manual_seed(dim)
    y = torch.randn(tokens, dim, generator=g).to(dtype)
    res = inputs[0]
    want = mhc.hc_post(y, res, ref.post, ref.comb)
    got = mhc_post(*(t.to(DEV) for t in (y, res, ref.post, ref.comb))).cpu()
    assert got.dtype == dtype and got.shape == res.shape
    if dtype == torch.bfloat16:
        assert ulps_apart(got, want) <= 1
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_model_fused_equals_torch(monkeypatch) -> None:
    """A whole model (Engram layers, the lagged pre across blocks, the final collapse + norm)
    with the mHC entry points on the kernels equals the torch path to fp32 rounding, and the
    traced attention input is the collapsed row the kernel normalised."""
    from engramrt.config import engram_config
    from engramrt.engram.hashing import EngramHasher
    from engramrt.engram.layout import EngramLayout
    from engramrt.runner.batch import StepBatch
    from engramrt.runner.stage import StageRunner, new_kv_cache
    from tests.model.test_decoder_reference import TOKENS, build, token_map

    model, raw = build(num_hidden_layers=2, engram_layer_ids=[0, 1])
    model = model.to(DEV)
    cfg = engram_config(raw)
    tmap = token_map(cfg.compressed_vocab_size)

    def run(fused: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        monkeypatch.setattr(mhc, "use_triton", lambda device: fused)
        seen: list[torch.Tensor] = []
        hasher = EngramHasher(EngramLayout.from_config(cfg), tmap, 1, DEV)
        session = StageRunner(model, hasher, new_kv_cache(model, 1))
        session.tracer = lambda event, _, t: seen.append(t) if event == "attn_collapse_in" else 0
        logits = session.compute(StepBatch(TOKENS, [0], [len(TOKENS)], [0]))
        return logits, seen

    want, want_seen = run(fused=False)
    got, got_seen = run(fused=True)
    assert len(got_seen) == len(want_seen) == model.cfg.num_layers
    for a, b in zip(got_seen, want_seen, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got - want).abs().max() > 0  # the kernels did run (they round differently)
