"""The two steps of DeepSeek-V4.1's MoE between and after its grouped projections, one launch
each (the torch path took some twenty small launches a layer for them):

- ``swiglu_codes``: the clamped SwiGLU of a ``[gate | up]`` row times its routing weight,
  rounded to the activation dtype and quantised (``act_quant``) for the down projection: the
  E4M3 codes and scales the FP8 tensor cores take.
- ``combine``: each token's expert outputs added in fp32 in ascending expert id, then the shared
  expert's: the torch path's additions in its order (bitwise).

``moe.clamped_swiglu`` is the formula: silu as torch's CUDA kernel computes it,
``x / (1 + exp(-x))`` with an accurate exp and a correctly rounded division.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from engramrt.kernels.common import interpreted
from engramrt.kernels.quant_roundtrip import act_codes_of

NB = 8  # 32-wide blocks a program


@triton.jit
def _swiglu_codes_kernel(
    x_ptr,  # [R, 2 * I]: gate then up
    w_ptr,  # fp32 routing weights (HAS_W): row r's at w_at[r]
    w_at_ptr,  # int64 [R]
    codes_ptr,  # E4M3 [R, I]
    scale_ptr,  # fp32 [R, I / 32]
    values_ptr,  # bf16 [R, I] (VALUES)
    INTER,
    LIMIT,
    HAS_W: tl.constexpr,
    VALUES: tl.constexpr,
    NB: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    r, j = tl.program_id(0).to(tl.int64), tl.program_id(1)
    blk = j * NB + tl.arange(0, NB)
    cols = blk[:, None] * 32 + tl.arange(0, 32)[None, :]
    mask = cols < INTER
    row = x_ptr + r * 2 * INTER
    gate = tl.load(row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(row + INTER + cols, mask=mask, other=0.0).to(tl.float32)
    gate = tl.minimum(gate, LIMIT)
    up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    e = libdevice.exp(-gate) if LIBDEVICE else tl.exp(-gate)  # CUDA's expf, as torch's silu
    h = tl.div_rn(gate, 1.0 + e) * up
    if HAS_W:
        h = tl.load(w_ptr + tl.load(w_at_ptr + r)) * h
    h = h.to(x_ptr.dtype.element_ty).to(tl.float32)  # the activation dtype, as the torch path
    codes, scale, values = act_codes_of(h)
    tl.store(codes_ptr + r * INTER + cols, codes, mask=mask)
    tl.store(scale_ptr + r * (INTER // 32) + blk, scale, mask=blk < INTER // 32)
    if VALUES:
        tl.store(values_ptr + r * INTER + cols, values, mask=mask)


def swiglu_codes(
    gate_up: torch.Tensor,
    limit: float,
    weight: torch.Tensor | None = None,
    weight_at: torch.Tensor | None = None,
    values: bool = False,
) -> tuple[torch.Tensor, ...]:
    """``gate_up`` [R, 2 I] -> (E4M3 codes [R, I], fp32 scales [R, I / 32], with ``values``
    the round trip's bf16 values [R, I] or None: what FP4 weights multiply) of
    ``act_quant(clamped_swiglu(gate, up, limit, weight).to(gate_up.dtype))``; ``weight`` [R],
    or with ``weight_at`` [R] ``weight.flatten()[weight_at]`` (read in the kernel)."""
    rows, width = gate_up.shape
    inter = width // 2
    if inter % 32:
        raise ValueError(f"the intermediate width ({inter}) must be a multiple of 32")
    codes = torch.empty(rows, inter, dtype=torch.float8_e4m3fn, device=gate_up.device)
    scale = torch.empty(rows, inter // 32, dtype=torch.float32, device=gate_up.device)
    out = torch.empty(rows, inter, dtype=torch.bfloat16, device=gate_up.device) if values else None
    if rows:
        w = weight.reshape(-1).float().contiguous() if weight is not None else scale
        if weight is not None and weight_at is None:
            weight_at = torch.arange(rows, device=gate_up.device)
        at = weight_at.contiguous() if weight_at is not None else scale
        grid = (rows, triton.cdiv(inter // 32, NB))
        _swiglu_codes_kernel[grid](
            gate_up.contiguous(),
            w,
            at,
            codes,
            scale,
            out if values else scale,
            inter,
            limit,
            HAS_W=weight is not None,
            VALUES=values,
            NB=NB,
            LIBDEVICE=not interpreted(),
        )
    return codes, scale, out


@triton.jit
def _combine_kernel(out_ptr, by_id_ptr, shared_ptr, y_ptr, D, K: tl.constexpr, BLOCK: tl.constexpr):
    t, j = tl.program_id(0).to(tl.int64), tl.program_id(1)
    cols = j * BLOCK + tl.arange(0, BLOCK)
    mask = cols < D
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(K):
        row = tl.load(by_id_ptr + t * K + s).to(tl.int64)
        acc += tl.load(out_ptr + row * D + cols, mask=mask, other=0.0).to(tl.float32)
    acc += tl.load(shared_ptr + t * D + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * D + cols, acc.to(y_ptr.dtype.element_ty), mask=mask)


def combine(
    out: torch.Tensor,
    by_id: torch.Tensor,
    shared: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Sorted expert rows ``out`` [T * k, D]; ``by_id`` [T, k] each token's rows in ascending
    expert id; ``shared`` [T, D]: each token's fp32 sum, experts first, then the shared one,
    stored in ``dtype`` (fp32 where ranks add their sums)."""
    tokens, k = by_id.shape
    d = out.shape[-1]
    y = torch.empty(tokens, d, dtype=dtype, device=out.device)
    if tokens:
        block = 1024
        _combine_kernel[(tokens, triton.cdiv(d, block))](
            out.contiguous(), by_id.contiguous(), shared.contiguous(), y, d, K=k, BLOCK=block
        )
    return y
