"""V4.1's sparse attention kernel (``engramrt.kernels.sparse_attention``) against a float64
restatement written token by token: each query over the latents of positions ``p - W + 1 .. p``
(its own run's from the step, earlier ones from its slot's ring) and its picked compressed
rows, a per-head sink in the denominator. Runs of every kind in one launch: a prefill chunk
that starts mid-window, a decode row, a prompt from position 0 longer than the window, a token
with no picks. With rows enough for several splits: the same bits whether each split takes a
program or one program takes them all, and a token's bits alone as in its step."""

from __future__ import annotations

import pytest
import torch

from engramrt.kernels import sparse_attention as module
from engramrt.kernels.sparse_attention import sparse_attention

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
W, H, D, K = 8, 5, 32, 6
RUNS = [(7, 5, 2), (20, 1, 0), (0, 11, 3)]  # (first position, tokens, ring slot)


def restated(q, kv, ring, comp, picks, sink, scale, ring_len=W):
    out, t = torch.zeros(q.shape, dtype=torch.float64), 0
    for p0, n, slot in RUNS:
        for i in range(n):
            p = p0 + i
            rows = [
                kv[t - i + (u - p0)] if u >= p0 else ring[slot * ring_len + u % ring_len]
                for u in range(max(0, p - W + 1), p + 1)
            ]
            rows += [comp[r] for r in picks[t].tolist() if r >= 0]
            rows = torch.stack(rows).double()
            s = q[t].double() @ rows.T * scale  # [H, R]
            m = s.amax(-1, keepdim=True)
            e = torch.exp(s - m)
            out[t] = (e @ rows) / (e.sum(-1, keepdim=True) + torch.exp(sink.double()[:, None] - m))
            t += 1
    return out


def inputs(dtype: torch.dtype, ring_len: int = W, k: int = K, seed: int = 0) -> list:
    """(q, kv, ring, comp, picks, pos, p0, q0, slot, sink) for ``RUNS``, ``k`` picks a token."""
    g = torch.Generator().manual_seed(seed)
    t = sum(n for _, n, _ in RUNS)
    q = (torch.randn(t, H, D, generator=g) * 2).to(dtype)
    kv = torch.randn(t, D, generator=g).to(dtype)
    ring = torch.randn(4 * ring_len, D, generator=g).to(dtype)
    comp = torch.randn(5 * k, D, generator=g).to(dtype)
    picks = torch.randint(0, 5 * k, (t, k), generator=g)
    picks[picks % 3 == 0] = -1
    picks[4] = -1  # a token with no picks
    sink = torch.randn(H, generator=g)
    pos = torch.tensor([p0 + i for p0, n, _ in RUNS for i in range(n)])
    p0 = torch.tensor([p0 for p0, n, _ in RUNS for _ in range(n)])
    q0 = torch.tensor([q0 for (_, n, _), q0 in zip(RUNS, [0, 5, 6], strict=True) for _ in range(n)])
    slot = torch.tensor([s for _, n, s in RUNS for _ in range(n)])
    return [x.to(DEVICE) for x in (q, kv, ring, comp, picks, pos, p0, q0, slot, sink)]


def attend(on: list, ring_len: int = W) -> torch.Tensor:
    return sparse_attention(*on, D**-0.5, W, ring_len).cpu()


@pytest.mark.parametrize(
    "dtype,ring_len,k,spread",
    [
        (torch.float32, W, K, True),
        (torch.bfloat16, W, K, True),
        (torch.float32, W + 3, K, True),
        (torch.float32, W, 150, True),  # three splits, a program each
        (torch.bfloat16, W, 150, True),
        (torch.float32, W, 150, False),  # one program: one split, or three under the flag
    ],
)
def test_sparse_attention_is_the_restatement(
    dtype: torch.dtype, ring_len: int, k: int, spread: bool, monkeypatch
) -> None:
    """``ring_len`` > W: rings with room for a verify run's drafts (speculative decoding)."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the interpreter's dot on bf16 is not the GPU's")
    if not spread:
        monkeypatch.setattr(module, "SPREAD_BELOW", 0)
        on = inputs(dtype, ring_len, k)
        want = restated(*[x.cpu() for x in on[:5]], on[9].cpu(), D**-0.5, ring_len)
        monkeypatch.setattr(module, "batch_invariant", lambda device: True)
        torch.testing.assert_close(attend(on, ring_len).double(), want, rtol=1e-5, atol=1e-5)
        monkeypatch.setattr(module, "batch_invariant", lambda device: False)
    on = inputs(dtype, ring_len, k)
    got = attend(on, ring_len)
    want = restated(*[x.cpu() for x in on[:5]], on[9].cpu(), D**-0.5, ring_len)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 probabilities and output
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tokens_bits_ignore_its_step(dtype: torch.dtype, monkeypatch) -> None:
    """Under ``--batch-invariant``: each split a program (a small step) or every split in one
    program (a large one), a token alone or among the others, its picks padded with more
    ``-1``: the same bits."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the interpreter's dot on bf16 is not the GPU's")
    monkeypatch.setattr(module, "batch_invariant", lambda device: True)
    on = inputs(dtype, k=150, seed=1)
    assert module.SPLIT_ROWS < W + 150, "meant to cover several splits"
    monkeypatch.setattr(module, "SPREAD_BELOW", 1 << 30)
    spread = attend(on)
    monkeypatch.setattr(module, "SPREAD_BELOW", 0)
    together = attend(on)
    assert torch.equal(spread, together)
    padded = torch.cat([on[4], torch.full_like(on[4], -1)[:, :70]], dim=1)
    assert torch.equal(attend([*on[:4], padded, *on[5:]]), together)
    monkeypatch.setattr(module, "SPREAD_BELOW", 1 << 30)
    for i in (0, 5, 9):
        alone = [on[0][i : i + 1], *on[1:4], on[4][i : i + 1], *[x[i : i + 1] for x in on[5:9]]]
        assert torch.equal(attend([*alone, on[9]]), together[i : i + 1]), i
