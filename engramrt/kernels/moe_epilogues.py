"""The step of DeepSeek-V4.1's MoE between its grouped projections, one launch (the torch path
took some twenty small launches a layer for it): ``swiglu_codes``, the clamped SwiGLU of a
``[gate | up]`` row times its routing weight, rounded to the activation dtype and quantised
(``act_quant``) for the down projection: the E4M3 codes and scales the FP8 tensor cores take.
The routed experts' rows and the shared expert's go through one launch. (The combine after the
down projections is the shared expert's epilogue: ``stored_linear.Added``.)

``moe.clamped_swiglu`` is the formula: silu as torch's CUDA kernel computes it,
``x / (1 + exp(-x))`` with an accurate exp and a correctly rounded division.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from engramrt.kernels.common import interpreted
from engramrt.kernels.quant_roundtrip import store_act_codes

NB = 8  # 32-wide blocks a program


@triton.jit(do_not_specialize=["W_ROWS"])
def _swiglu_codes_kernel(
    x_ptr,  # [R, 2 * I]: gate then up
    w_ptr,  # fp32 routing weights (HAS_W): row r's at w_at[r]
    w_at_ptr,  # int64 [R]
    codes_ptr,  # E4M3 [R, I]
    scale_ptr,  # fp32 [R, I / 32]
    values_ptr,  # bf16 [R, I] (VALUES)
    INTER,
    LIMIT,
    W_ROWS,  # rows from here on take no weight
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
        if r < W_ROWS:
            h = tl.load(w_ptr + tl.load(w_at_ptr + r)) * h
    h = h.to(x_ptr.dtype.element_ty).to(tl.float32)  # the activation dtype, as the torch path
    at = r * (INTER // 32) + blk
    store_act_codes(h, at, blk < INTER // 32, codes_ptr, scale_ptr, values_ptr, VALUES)


def swiglu_codes(
    gate_up: torch.Tensor,
    limit: float,
    weight: torch.Tensor | None = None,
    weight_at: torch.Tensor | None = None,
    values: bool = False,
    weighted: int | None = None,
) -> tuple[torch.Tensor, ...]:
    """``gate_up`` [R, 2 I] -> (E4M3 codes [R, I], fp32 scales [R, I / 32], with ``values``
    the round trip's bf16 values [R, I] or None: what FP4 weights multiply) of
    ``act_quant(clamped_swiglu(gate, up, limit, weight).to(gate_up.dtype))``; ``weight`` [R],
    or with ``weight_at`` [R] ``weight.flatten()[weight_at]`` (read in the kernel), for the first
    ``weighted`` rows (all by default: the MoE's routed rows come first, the shared expert's
    after them, unweighted)."""
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
            rows if weighted is None else weighted,
            HAS_W=weight is not None,
            VALUES=values,
            NB=NB,
            LIBDEVICE=not interpreted(),
        )
    return codes, scale, out
