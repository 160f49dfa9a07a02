"""V4.1's indexer scores kernel (``engramrt.kernels.index_scores``) against a brute-force
restatement: each token's visible entries found through its request's block table by a Python
loop, scored with the torch path's rounding points; ``-inf`` exactly where the token cannot
see. Two requests, ratios 1 and 2, entries spread over scattered blocks, more entries than one
program's chunk."""

from __future__ import annotations

import pytest
import torch

from engramrt.kernels import index_scores as kernel
from engramrt.kernels.index_scores import index_scores

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, DI, BS = 5, 32, 8


@pytest.mark.parametrize("ratio,extra", [(1, 0), (2, 0), (2, 70)])
def test_index_scores_are_the_restatement(ratio: int, extra: int, monkeypatch) -> None:
    """``extra``: entries past every token's own, as in a CUDA graph's capacity-wide scan."""
    monkeypatch.setattr(kernel, "CHUNK", 64)  # several programs a token
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    g = torch.Generator().manual_seed(ratio)
    per = BS // ratio
    blocks = 40
    keys = torch.randn(blocks * per, DI, generator=g).to(dtype)
    table = torch.stack([torch.randperm(blocks, generator=g)[:30] for _ in range(2)])
    pos = torch.tensor([150, 3, 0, 151, 152, 97])  # request 0 decodes and prefills; request 1
    req = torch.tensor([0, 1, 1, 0, 0, 1])
    count = max((int(p) + 1) // ratio for p in pos) + extra
    q = torch.randn(len(pos), H, DI, generator=g).to(dtype)
    w = (torch.randn(len(pos), H, generator=g) * 0.3).to(dtype)
    on = [x.to(DEVICE) for x in (q, w, keys, table, req, pos)]
    got = index_scores(*on, ratio, BS, count).cpu()
    assert got.shape == (len(pos), count) and got.dtype == dtype
    for t in range(len(pos)):
        seen = (int(pos[t]) + 1) // ratio
        assert torch.isneginf(got[t, seen:]).all()
        if not seen:
            continue
        rows = [
            int(table[req[t], c * ratio // BS]) * per + (c * ratio % BS) // ratio
            for c in range(seen)
        ]
        s = (q[t] @ keys[rows].T).to(dtype).relu()  # [H, seen]: the torch path's roundings
        want = (s * w[t, :, None]).sum(0)
        tol = 1e-5 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(
            got[t, :seen], want, rtol=tol, atol=tol * float(want.abs().max())
        )
