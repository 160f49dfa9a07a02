"""Rotary embedding of q or k in one Triton launch.

In torch the rotation is about eight elementwise kernels (two upcasts, four products, two sums,
a concatenation and a downcast) for q and again for k, in every layer: at bs 1 on a 36-layer
model that is hundreds of tiny launches a decode step. Here one program rotates ``BLOCK_H``
heads of one token with the step's cos/sin rows (computed once per forward for all layers).
The same fp32 formula as ``engramrt.model.layers.apply_rope``; the compiler may fuse a product
into an add, so results match to fp32 rounding before the cast, not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    x_ptr, cos_ptr, sin_ptr, out_ptr, H: tl.constexpr, HALF: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t, hb = tl.program_id(0), tl.program_id(1)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK)
    m = (h < H)[:, None] & (i < HALF)[None, :]
    row = (t.to(tl.int64) * H + h)[:, None] * (2 * HALF) + i[None, :]
    x1 = tl.load(x_ptr + row, mask=m, other=0).to(tl.float32)
    x2 = tl.load(x_ptr + row + HALF, mask=m, other=0).to(tl.float32)
    c = tl.load(cos_ptr + t * HALF + i, mask=i < HALF, other=0)[None, :]
    s = tl.load(sin_ptr + t * HALF + i, mask=i < HALF, other=0)[None, :]
    ty = out_ptr.dtype.element_ty
    tl.store(out_ptr + row, (x1 * c - x2 * s).to(ty), mask=m)
    tl.store(out_ptr + row + HALF, (x2 * c + x1 * s).to(ty), mask=m)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, heads, head_dim]`` rotated by ``cos, sin [T, 1, head_dim / 2]`` (fp32)."""
    tokens, heads, dim = x.shape
    out = torch.empty_like(x)
    if tokens == 0:
        return out
    half = dim // 2
    block_h = min(8, triton.next_power_of_2(heads))
    _rope_kernel[(tokens, triton.cdiv(heads, block_h))](
        x.contiguous(), cos.contiguous(), sin.contiguous(), out, H=heads, HALF=half,
        BLOCK_H=block_h, BLOCK=triton.next_power_of_2(half),
    )  # fmt: skip
    return out
