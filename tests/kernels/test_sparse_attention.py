"""V4.1's sparse attention kernel (``engramrt.kernels.sparse_attention``) against a float64
restatement written token by token: each query over the latents of positions ``p - W + 1 .. p``
(its own run's from the step, earlier ones from its slot's ring) and its picked compressed
rows, a per-head sink in the denominator. Runs of every kind in one launch: a prefill chunk
that starts mid-window, a decode row, a prompt from position 0 longer than the window, a token
with no picks."""

from __future__ import annotations

import pytest
import torch

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


@pytest.mark.parametrize(
    "dtype,ring_len", [(torch.float32, W), (torch.bfloat16, W), (torch.float32, W + 3)]
)
def test_sparse_attention_is_the_restatement(dtype: torch.dtype, ring_len: int) -> None:
    """``ring_len`` > W: rings with room for a verify run's drafts (speculative decoding)."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the interpreter's dot on bf16 is not the GPU's")
    g = torch.Generator().manual_seed(0)
    t = sum(n for _, n, _ in RUNS)
    q = (torch.randn(t, H, D, generator=g) * 2).to(dtype)
    kv = torch.randn(t, D, generator=g).to(dtype)
    ring = torch.randn(4 * ring_len, D, generator=g).to(dtype)
    comp = torch.randn(30, D, generator=g).to(dtype)
    picks = torch.randint(0, 30, (t, K), generator=g)
    picks[picks % 3 == 0] = -1
    picks[4] = -1  # a token with no picks
    sink = torch.randn(H, generator=g)
    pos = torch.tensor([p0 + i for p0, n, _ in RUNS for i in range(n)])
    p0 = torch.tensor([p0 for p0, n, _ in RUNS for _ in range(n)])
    q0 = torch.tensor([q0 for (_, n, _), q0 in zip(RUNS, [0, 5, 6], strict=True) for _ in range(n)])
    slot = torch.tensor([s for _, n, s in RUNS for _ in range(n)])
    on = [x.to(DEVICE) for x in (q, kv, ring, comp, picks, pos, p0, q0, slot, sink)]
    got = sparse_attention(*on[:5], *on[5:9], on[9], D**-0.5, W, ring_len).cpu()
    want = restated(q, kv, ring, comp, picks, sink, D**-0.5, ring_len)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16 probabilities and output
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
