"""DeepSeek-V4.1's DSpark draft (``Transformer.forward_spec``: ``DSparkBlock``,
``DSparkAttention``, ``DSparkMarkovHead``, ``DSparkConfidenceHead``) restated from its semantics
on top of the backbone restatement of ``test_v41_reference``, against engramrt's drafts on the
``v41-small`` preset. Imports nothing from ``engramrt.model`` or
``engramrt.models.deepseek_v41.config``.

The reference drafts only at decode steps, after writing the step's ``main_kv`` into the stage's
ring; engramrt also drafts right after the prefill (at the prompt's last position, the ring
seeded from the prompt). So: every target forward seeds the rings, then the draft runs at the
forward's last position. The window is read in position order, oldest first (the reference's
ring-slot order differs only in the fp32 order of the attention sums).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from engramrt.models.deepseek_v41 import dspark
from engramrt.runner.batch import StepBatch
from engramrt.runner.stage import StageRunner
from tests.model.test_v41_engine import ends_of
from tests.model.test_v41_reference import (  # noqa: F401 - the autouse fixture too
    BLOCK_TABLE,
    PROMPT,
    TOKENS,
    Reference,
    _engramrt_cpu_kernels,
    act_rt,
    dequant,
    hc_post,
    hc_pre,
    rms,
    rope,
    rope_table,
    sparse_attn,
)

BF16, STEPS = torch.bfloat16, 12
# each a semantic detail of the draft the comparison must see (``test_mutants_are_caught``)
MUTANTS = (
    "causal block",
    "window without p",
    "no window",
    "block rotated from p",
    "YaRN rotation",
    "model norm",
    "Markov bias of tok only",
    "confidence on normed y",
)


class DSparkReference(Reference):
    """The backbone restatement plus the DSpark stages ``mtp.0 ..``: each forward also records
    the target features and seeds every stage's window ring; ``draft`` drafts a block."""

    def __init__(self, model_dir: Path):
        super().__init__(model_dir)
        c, W = self.c, self.W
        self.L = c["num_hidden_layers"]
        self.stages = c["num_nextn_predict_layers"]
        self.bs, self.noise = c["dspark_block_size"], c["dspark_noise_token_id"]
        self.targets = c["dspark_target_layer_ids"]
        n = c["max_position_embeddings"]
        self.stage_cis = rope_table(self.rd, c["rope_theta"], None, n)  # ratio 0: no YaRN
        self.yarn_cis = self.cis[next(i for i, r in enumerate(self.ratios) if r)]  # a mutant's
        self.dring = [torch.zeros(self.win, self.hd, dtype=BF16) for _ in range(self.stages)]
        for s in range(self.stages):  # Reference.moe reads layers.{i}.ffn.*: the stage's there
            pf = f"mtp.{s}."
            W.update(
                {
                    f"layers.{self.L + s}.{k[len(pf) :]}": v
                    for k, v in list(W.items())
                    if k.startswith(pf)
                }
            )
        self.feats: list[torch.Tensor] = []

    def mixes(self, h, pf):
        """Called at each layer's input right after its Engram: the target layers' features."""
        if pf in [f"layers.{i}.hc_attn" for i in self.targets]:
            self.feats.append(h.mean(1))  # bf16, over the hc copies
        return super().mixes(h, pf)

    def moe(self, i, x, image=None):
        """A stage's MoE: the backbone's, with the stage's expert count and top-k (and, as the
        reference's drafts, no image routing)."""
        if i < self.L:
            return super().moe(i, x, image)
        c = self.c
        self.c = {
            **c,
            "n_routed_experts": c["dspark_n_routed_experts"],
            "num_experts_per_tok": c["dspark_n_activated_experts"],
        }
        try:
            return super().moe(i, x)
        finally:
            self.c = c

    def forward(self, tokens, p):
        """The target forward, then each stage's kv of main_x into its ring (the last window
        positions of the forward, at position % window)."""
        self.feats = []
        logits = super().forward(tokens, p)
        W, T, win = self.W, len(tokens), self.win
        hidden = torch.cat(self.feats, -1)  # [T, targets * D], in layer order
        main_x = rms(self.lin(hidden, "mtp.0.main_proj"), W["mtp.0.main_norm.weight"], self.eps)
        pos = torch.arange(p, p + T)[-win:]
        for s in range(self.stages):
            pf = f"mtp.{s}.attn."
            kv = rms(self.lin(main_x[-win:], pf + "wkv"), W[pf + "kv_norm.weight"], self.eps)
            self.dring[s][pos % win] = act_rt(rope(kv, self.stage_cis[pos]))
        return logits

    def draft_attention(self, s, x, p, mutant):
        """Block queries at p + 1 .. p + bs over the ring's positions p - W + 1 .. p, oldest
        first, then all bs block rows (non-causal); the block's rows stay out of the ring."""
        W, pf, bs, win, G = self.W, f"mtp.{s}.attn.", len(x), self.win, self.c["o_groups"]
        q0 = p if mutant == "block rotated from p" else p + 1
        cis = (self.yarn_cis if mutant == "YaRN rotation" else self.stage_cis)[q0 : q0 + bs]
        qr = rms(self.lin(x, pf + "wq_a"), W[pf + "q_norm.weight"], self.eps)
        q = rope(self.lin(qr, pf + "wq_b").unflatten(-1, (self.H, self.hd)), cis)
        kv = act_rt(rope(rms(self.lin(x, pf + "wkv"), W[pf + "kv_norm.weight"], self.eps), cis))
        seen = torch.arange(max(0, p - win + 1), p + 1)
        seen = {"window without p": seen[:-1], "no window": seen[:0]}.get(mutant, seen)
        rows, nr = torch.cat([self.dring[s][seen % win], kv]), len(seen)
        idx = torch.arange(nr + bs).repeat(bs, 1)
        if mutant == "causal block":
            idx = torch.where(idx > nr + torch.arange(bs)[:, None], -1, idx)
        o = sparse_attn(q, rows, W[pf + "attn_sink"].float(), idx, self.hd**-0.5)
        o = rope(o, cis, inverse=True).flatten(1).unflatten(-1, (G, -1))
        if pf + "wo_a" not in self.deq:
            self.deq[pf + "wo_a"] = dequant(W[pf + "wo_a.weight"], W[pf + "wo_a.scale"]).to(BF16)
        u = torch.einsum("sgd,grd->sgr", o, self.deq[pf + "wo_a"].unflatten(0, (G, -1)))
        return self.lin(u.flatten(1), pf + "wo_b")

    def draft(self, tok: int, p: int, mutant: str | None = None):
        """``forward_spec`` at target position p, after the target sampled ``tok`` for p + 1:
        (the drafted tokens, fp32 logits [bs, V] with the Markov bias, confidence [bs])."""
        W, hc, bs, eps = self.W, self.hc, self.bs, self.eps
        ids = [tok] + [self.noise] * (bs - 1)
        h, pre = W["embed.weight"][ids][:, None].repeat(1, hc, 1), torch.eye(hc)[[0] * bs]
        for s in range(self.stages):  # a Block with lagged mHC, no Engram
            pf = f"mtp.{s}."
            a_pre, a_post, a_comb = self.mixes(h, pf + "hc_attn")
            x = rms(hc_pre(h, pre), W[pf + "attn_norm.weight"], eps)
            h = hc_post(self.draft_attention(s, x, p, mutant), h, a_post, a_comb)
            f_pre, f_post, f_comb = self.mixes(h, pf + "hc_ffn")
            x = rms(hc_pre(h, a_pre), W[pf + "ffn_norm.weight"], eps)
            h, pre = hc_post(self.moe(self.L + s, x), h, f_post, f_comb), f_pre
        pf = f"mtp.{self.stages - 1}."
        y = hc_pre(h, pre)
        norm = W["norm.weight" if mutant == "model norm" else pf + "norm.weight"]
        logits = F.linear(rms(y, norm, eps).float(), W["head.weight"].float())
        table, markov = W[pf + "markov_head.embed.weight"], W[pf + "markov_head.head.weight"]
        out, embs, self.rec["unbiased"] = [tok], [], logits.clone()
        for i in range(bs):  # token by token: position i is biased by the token drafted before
            embs.append(table[tok if mutant == "Markov bias of tok only" else out[i]])
            logits[i] += F.linear(embs[i].float(), markov.float())
            out.append(int(logits[i].argmax()))  # greedy
        y = rms(y, norm, eps) if mutant == "confidence on normed y" else y
        hidden = torch.cat([y, torch.stack(embs)], -1).float()
        conf = F.linear(hidden, W[pf + "confidence_head.proj.weight"].float()).squeeze(-1)
        return torch.tensor(out[1:]), logits, conf


@pytest.fixture(scope="module")
def model_dir(v41_small, tmp_path_factory) -> Path:
    """The preset with the stage's RMSNorm weights drawn (1 + N(0, 1/4)) instead of ones, so
    that which norm a step applies (the stage's own ``norm`` or the model's, ``main_norm``,
    ``kv_norm`` ...) shows in the comparison. Both sides load this copy."""
    out = tmp_path_factory.mktemp("v41-small-dspark") / "model"
    shutil.copytree(v41_small, out)
    gen = torch.Generator().manual_seed(1)
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            meta, names = f.metadata(), list(f.keys())
        norms = [n for n in names if n.startswith("mtp.") and n.endswith("norm.weight")]
        if norms:
            state = load_file(path)
            for n in norms:
                state[n] = (1 + torch.randn(state[n].shape, generator=gen) / 4).to(BF16)
            save_file(state, path, metadata=meta)
    return out


@pytest.fixture(scope="module")
def drafts(model_dir):
    """The prompt, then 12 greedy steps (engramrt's token fed to both); after every target
    forward, prefill included, both sides draft at its last position with engramrt's token.
    Also each side's stage rings after the prefill's draft and after the last one."""
    eng = StageRunner.load(model_dir, num_slots=2, max_len=256, dtype="bfloat16", dspark=True)
    ref = DSparkReference(model_dir)
    toks, pos, steps = TOKENS, 0, []
    batch = StepBatch(toks, [0], [PROMPT], [0], new_blocks=[BLOCK_TABLE])
    for _ in range(STEPS + 1):
        got = eng.compute(batch, last_only=False)
        ref.forward(toks, pos)
        p, tok = pos + len(toks) - 1, int(got[-1].argmax())
        rings = [eng.kv.window[ref.L + s][0].clone() for s in range(ref.stages)]
        d = dspark.draft(
            eng.model, eng.kv, *ends_of(batch), torch.tensor([tok]), eng.sampler.token_limit
        )
        steps.append(
            {
                "p": p,
                "tok": tok,
                "eng": (d.tokens[0], d.logits[0], d.confidence[0]),
                "ref": ref.draft(tok, p),
                "unbiased": ref.rec["unbiased"],
                "rings_before_draft": rings,
                "rings": (
                    [eng.kv.window[ref.L + s][0].clone() for s in range(ref.stages)],
                    [r.clone() for r in ref.dring],
                ),
            }
        )
        pos, toks = pos + len(toks), [tok]
        batch = StepBatch(toks, [0], [1], [pos])
    return eng, ref, steps


def close(got, want) -> bool:
    """Draft logits within 1e-5 of the logit scale, tokens equal, confidence within rtol 1e-5."""
    (gt, gl, gc), (wt, wl, wc) = got, want
    ok = (gl - wl).abs().max() <= 1e-5 * wl.abs().max() and torch.equal(gt, wt)
    return bool(ok and torch.allclose(gc, wc, rtol=1e-5, atol=1e-5 * wc.abs().max().item()))


def test_drafts_match(drafts):
    """At the prefill and at each of 12 decode steps: the same drafted block, logits within
    1e-5 of the logit scale, confidence within rtol 1e-5. Measured: bitwise equal at every
    step. Why not a looser tolerance: ``test_whole_model_logits_and_greedy_tokens`` of the
    backbone explains it (the products are exact and both sides sum in the same fp32 order; one
    bf16 ulp upstream, amplified by the FP8 round trips and the routing, moves the logits by far
    more than any tolerance that still separates errors from noise). 1e-5 admits only a
    reordered fp32 head, Markov bias or confidence projection."""
    _, ref, steps = drafts
    vocab = len(ref.W["head.weight"])
    for n, s in enumerate(steps):
        (gt, gl, gc), (wt, wl, wc) = s["eng"], s["ref"]
        assert gt.shape == wt.shape == (ref.bs,) and gl.shape == wl.shape == (ref.bs, vocab)
        assert gc.shape == wc.shape == (ref.bs,) and gl.dtype == gc.dtype == torch.float32
        diff = (gl - wl).abs().max().item()
        assert diff <= 1e-5 * wl.abs().max().item(), f"step {n} (p {s['p']}): {diff}"
        assert torch.equal(gt, wt), (n, gt.tolist(), wt.tolist())
        torch.testing.assert_close(gc, wc, rtol=1e-5, atol=1e-5 * wc.abs().max().item())


@pytest.mark.parametrize("step", [0, STEPS])
def test_stage_rings_are_bitwise_equal(drafts, step):
    """The stage's window ring after the prefill (positions 24 .. 39, from the prompt's
    features) and after the last step: engramrt's row position % ring_len equals the
    restatement's, bitwise; the draft wrote nothing into it (the block's rows stay out)."""
    _, ref, steps = drafts
    s = steps[step]
    seen = torch.arange(s["p"] - ref.win + 1, s["p"] + 1)
    for k, (got, want) in enumerate(zip(*s["rings"], strict=True)):
        assert torch.equal(got, s["rings_before_draft"][k]), k
        assert (want.abs().amax(-1) > 0).all()  # every row written
        assert torch.equal(got[seen % len(got)], want[seen % ref.win]), k


@pytest.mark.parametrize("mutant", MUTANTS)
def test_mutants_are_caught(drafts, mutant):
    """The comparison cannot pass vacuously: at the last step each semantic detail, changed (a
    causal block; the window without p's own row; no window, so no features; the block
    rotated from p; YaRN on the stage; the model's norm for the stage's; the Markov bias of the
    sampled token at every position; confidence on the normed hidden), takes the draft out of
    ``test_drafts_match``'s tolerance while the unchanged restatement stays in it."""
    _, ref, steps = drafts
    last = steps[-1]
    assert close(last["eng"], last["ref"])
    assert not close(last["eng"], ref.draft(last["tok"], last["p"], mutant))


def test_drafts_are_not_trivial(drafts):
    """The drafted blocks vary from step to step, and the Markov bias moves the argmax of some
    position (without it the block would be drafted from the stage's logits alone)."""
    steps = [s["ref"] for s in drafts[2]]
    assert len({tuple(t.tolist()) for t, _, _ in steps}) > len(steps) // 2
    moved = [not torch.equal(s["unbiased"].argmax(-1), s["ref"][0]) for s in drafts[2]]
    assert any(moved)
