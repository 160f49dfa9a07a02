"""V4.1's ratio-2 pooling + norm kernel (``engramrt.kernels.compressor``) against a brute-force
restatement, token by token: the group's first half from the previous row of the run or from
the slot's tail, a two-way softmax per channel, the weighted sum rounded to the activation dtype,
RMS-normalised. Runs that start inside a group (reading the tail) and outside one."""

from __future__ import annotations

import math

import pytest
import torch

from engramrt.kernels.compressor import pool_norm

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_pool_norm_is_the_restatement() -> None:
    g = torch.Generator().manual_seed(3)
    d, eps = 32, 1e-6
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    inside = torch.tensor([False, True, True, False, False, True, True, True])  # runs 3, 1, 4
    slot = torch.tensor([2, 2, 2, 0, 1, 1, 1, 1])
    a, s = (torch.randn(len(inside), d, generator=g) * 3 for _ in range(2))
    tail = torch.randn(4, 2, d, generator=g) * 3
    w = (torch.rand(d, generator=g) + 0.5).to(dtype)
    got = pool_norm(*(v.to(DEVICE) for v in (a, s, tail, inside, slot, w)), eps, dtype).cpu()
    for t in range(len(inside)):
        pa, ps = (a[t - 1], s[t - 1]) if inside[t] else (tail[slot[t], 0], tail[slot[t], 1])
        e0, e1 = ([math.exp(v) for v in x.tolist()] for x in (ps, s[t]))
        pooled = (
            torch.tensor([(pa[c] * e0[c] + a[t, c] * e1[c]) / (e0[c] + e1[c]) for c in range(d)])
            .to(dtype)
            .float()
        )
        want = pooled / (pooled.square().mean() + eps).sqrt() * w.float()
        tol = 1e-5 if dtype == torch.float32 else 2**-7
        torch.testing.assert_close(
            got[t].float(), want, rtol=tol, atol=tol * float(want.abs().max())
        )
