"""The Engram gate fused: per (token, copy), one pass of fp32 reductions over the
stream and its key, the gate, then ``x + g * value`` rounded once. Image (dead) rows are copied
through unchanged. Not bitwise equal to the torch reference (reduction order), by design."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gate_kernel(
    x_ptr,
    kv_ptr,
    q_ptr,
    k_ptr,
    dead_ptr,
    out_ptr,
    eps,
    HC: tl.constexpr,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_DEAD: tl.constexpr,
):
    pid = tl.program_id(0)
    t, j = pid // HC, pid % HC
    x_row = x_ptr + t * HC * D + j * D
    key_row = kv_ptr + t * (HC + 1) * D + j * D
    val_row = kv_ptr + t * (HC + 1) * D + HC * D
    sh = tl.zeros((BLOCK,), dtype=tl.float32)
    sk = tl.zeros((BLOCK,), dtype=tl.float32)
    sd = tl.zeros((BLOCK,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK):
        d = d0 + tl.arange(0, BLOCK)
        m = d < D
        h = tl.load(x_row + d, mask=m, other=0).to(tl.float32)
        key = tl.load(key_row + d, mask=m, other=0).to(tl.float32)
        w = tl.load(q_ptr + j * D + d, mask=m, other=0).to(tl.float32) * tl.load(
            k_ptr + j * D + d, mask=m, other=0
        ).to(tl.float32)
        sh += h * h
        sk += key * key
        sd += h * w * key
    rstd = (1.0 / tl.sqrt(tl.sum(sh) / D + eps)) * (1.0 / tl.sqrt(tl.sum(sk) / D + eps))
    dot = tl.sum(sd) * rstd * (1.0 / tl.sqrt(D * 1.0))
    mag = tl.sqrt(tl.maximum(tl.abs(dot), 1e-6))
    negative = dot.to(tl.int32, bitcast=True) < 0  # copysign: -0.0 counts as negative
    g = tl.sigmoid(tl.where(negative, -mag, mag))
    if HAS_DEAD:
        g_keep = tl.load(dead_ptr + t) == 0
    else:
        g_keep = True
    for d0 in range(0, D, BLOCK):
        d = d0 + tl.arange(0, BLOCK)
        m = d < D
        xv = tl.load(x_row + d, mask=m, other=0)
        v = tl.load(val_row + d, mask=m, other=0).to(tl.float32)
        y = (xv.to(tl.float32) + g * v).to(xv.dtype)
        tl.store(out_ptr + t * HC * D + j * D + d, tl.where(g_keep, y, xv), mask=m)


def gate(
    x: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    dead: torch.Tensor | None = None,
) -> torch.Tensor:
    """The kernel behind ``engram_gate``: same inputs and semantics."""
    t, hc, dim = x.shape
    out = torch.empty_like(x)
    if t == 0:
        return out
    _gate_kernel[(t * hc,)](
        x.contiguous(),
        kv.contiguous(),
        q_weight.contiguous(),
        k_weight.contiguous(),
        dead.to(torch.uint8) if dead is not None else x,
        out,
        eps,
        HC=hc,
        D=dim,
        BLOCK=min(1024, triton.next_power_of_2(dim)),
        HAS_DEAD=dead is not None,
    )
    return out
