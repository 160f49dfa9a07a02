"""The mHC split and Sinkhorn normalisation in one Triton launch.

In torch, ``hc_split_sinkhorn`` is about 4 small kernels per Sinkhorn iteration, 20 iterations,
twice per layer: on a GPU that is thousands of launches a decode step, each doing almost nothing.
Here one program holds ``BLOCK_T`` tokens' hc x hc matrices in registers for all iterations.
Same formulas and order of operations as ``engramrt.model.mhc.hc_split_sinkhorn``; exp and the
4-term sums may round differently, so it matches the torch path to fp32 rounding, not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_T = 16


@triton.jit
def split_tile(zp, zq, zl, scale_ptr, base_ptr, iters, eps, HC: tl.constexpr):
    """The split of already-projected mixes held in registers: ``zp``, ``zq`` ``[BT, HC]`` and
    ``zl`` ``[BT, HC, HC]`` -> (pre, post, comb) of the same shapes. The one copy of the
    Sinkhorn math for every kernel that needs it (here and ``mhc_fused``)."""
    j = tl.arange(0, HC)
    off = j[:, None] * HC + j[None, :]  # [HC, HC]: comb[j][k]
    s0, s1, s2 = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    pre = tl.sigmoid(zp * s0 + tl.load(base_ptr + j)[None, :]) + eps
    post = 2 * tl.sigmoid(zq * s1 + tl.load(base_ptr + HC + j)[None, :])
    logits = zl * s2 + tl.load(base_ptr + 2 * HC + off)[None, :, :]
    e = tl.exp(logits - tl.max(logits, axis=2)[:, :, None])
    comb = e / tl.sum(e, axis=2)[:, :, None] + eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + eps)
    return pre, post, comb


@triton.jit(do_not_specialize=["num_tokens"])
def _sinkhorn_kernel(
    z_ptr,
    scale_ptr,
    base_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    num_tokens,
    iters,
    eps,
    HC: tl.constexpr,
    BT: tl.constexpr,
):
    width: tl.constexpr = (2 + HC) * HC
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tm = t < num_tokens
    j = tl.arange(0, HC)
    row = t.to(tl.int64)[:, None] * width
    off = j[:, None] * HC + j[None, :]
    zp = tl.load(z_ptr + row + j[None, :], mask=tm[:, None], other=0)
    zq = tl.load(z_ptr + row + HC + j[None, :], mask=tm[:, None], other=0)
    zl = tl.load(
        z_ptr + row[:, :, None] + 2 * HC + off[None, :, :], mask=tm[:, None, None], other=0
    )
    pre, post, comb = split_tile(zp, zq, zl, scale_ptr, base_ptr, iters, eps, HC)
    out = t.to(tl.int64)[:, None] * HC + j[None, :]
    tl.store(pre_ptr + out, pre, mask=tm[:, None])
    tl.store(post_ptr + out, post, mask=tm[:, None])
    dst = t.to(tl.int64)[:, None, None] * (HC * HC) + off[None, :, :]
    tl.store(comb_ptr + dst, comb, mask=tm[:, None, None])


def split_sinkhorn(
    mixes: torch.Tensor, scale: torch.Tensor, base: torch.Tensor, hc: int, iters: int, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``hc_split_sinkhorn`` for a power-of-two ``hc``: (pre, post, comb) in fp32."""
    z = mixes.float().contiguous()
    tokens = z.shape[0]
    pre = torch.empty(tokens, hc, dtype=torch.float32, device=z.device)
    post = torch.empty_like(pre)
    comb = torch.empty(tokens, hc, hc, dtype=torch.float32, device=z.device)
    if tokens:
        _sinkhorn_kernel[(triton.cdiv(tokens, BLOCK_T),)](
            z,
            scale.float().contiguous(),
            base.float().contiguous(),
            pre,
            post,
            comb,
            tokens,
            iters,
            eps,
            HC=hc,
            BT=BLOCK_T,
        )
    return pre, post, comb
