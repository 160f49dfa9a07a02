"""SwiGLU's activation in one Triton launch: ``silu(a) * b`` of a stacked ``[a | b]`` row.

The same fp32 formula as ``engramrt.model.layers.silu_mul``; Triton's sigmoid may differ from
torch's in the last fp32 bit, so results match to fp32 rounding before the cast, not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, INTER: tl.constexpr, BLOCK: tl.constexpr):
    t, j = tl.program_id(0), tl.program_id(1)
    i = j * BLOCK + tl.arange(0, BLOCK)
    m = i < INTER
    row = t.to(tl.int64) * (2 * INTER)
    a = tl.load(x_ptr + row + i, mask=m, other=0).to(tl.float32)
    b = tl.load(x_ptr + row + INTER + i, mask=m, other=0).to(tl.float32)
    out = a * tl.sigmoid(a) * b
    tl.store(out_ptr + t.to(tl.int64) * INTER + i, out.to(out_ptr.dtype.element_ty), mask=m)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``gate_up [T, 2 * inter]`` -> ``[T, inter]``."""
    tokens, width = gate_up.shape
    inter = width // 2
    out = torch.empty(tokens, inter, dtype=gate_up.dtype, device=gate_up.device)
    if tokens:
        _silu_mul_kernel[(tokens, triton.cdiv(inter, BLOCK))](
            gate_up.contiguous(), out, INTER=inter, BLOCK=BLOCK
        )
    return out
