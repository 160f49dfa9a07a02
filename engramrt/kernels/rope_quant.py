"""DeepSeek-V4.1's RoPE, FP8/FP4 round trip and cache write of one projection in one launch
(``engramrt.models.deepseek_v41.attention.rope_quant``; the torch path rotates in about ten
elementwise launches, round-trips in another and scatters in a third, five times a layer).

A program takes one row of ``D`` values (a token's head): its pairs of adjacent values loaded as
evens and odds (with ``norm``, RMS-normalised first and rounded as RMSNorm's own launch rounds:
V4.1's window latents and index keys are normalised projections), the trailing ``2 *
HALF_ROT`` rotated by the token's ``cos``/``sin`` in fp32 (inverse: the conjugate) and rounded
to the input's dtype once (by its bits, to nearest even), then, per ``KIND``, each block of
``B`` values through the round trip of ``engramrt.kernels.quant_roundtrip`` (a block's evens
and odds share its amax). The result goes to ``out`` and, where ``rows[t] >= 0``, to row
``rows[t]`` of ``cache``. Products and sums are not fused into FMAs (``enable_fp_fusion``), so
the rotation rounds as the torch path's separate multiplies and subtract do: bitwise equal.
The norm's sum of squares runs in another order than torch's (fp32 rounding apart).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engramrt.kernels.quant_roundtrip import BLOCK_OF, block_scales, on_grid, round_to_grid

NONE = -1  # no round trip; else quant_roundtrip's ACT, FP4_POW2, FP4_E4M3
# (mantissa bits, least normal exponent) of a 16-bit input dtype; fp32 needs no rounding
GRID = {torch.bfloat16: (7, -126), torch.float16: (10, -14), torch.float32: (0, 0)}


@triton.jit
def _rope_quant_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    cache_ptr,
    rows_ptr,
    norm_ptr,
    eps,
    H,
    D: tl.constexpr,
    HALF_ROT: tl.constexpr,
    KIND: tl.constexpr,
    B: tl.constexpr,
    INVERSE: tl.constexpr,
    WRITE: tl.constexpr,
    NORM: tl.constexpr,
    MBITS: tl.constexpr,
    EMIN: tl.constexpr,
):
    r = tl.program_id(0).to(tl.int64)  # token t's head h
    t = r // H
    j = tl.arange(0, D // 2)
    e = tl.load(x_ptr + r * D + 2 * j).to(tl.float32)
    o = tl.load(x_ptr + r * D + 2 * j + 1).to(tl.float32)
    if NORM:  # the row's RMSNorm first, rounded to the input's dtype as its own launch's was
        rr = tl.rsqrt((tl.sum(e * e, axis=0) + tl.sum(o * o, axis=0)) / D + eps)
        e = e * rr * tl.load(norm_ptr + 2 * j).to(tl.float32)
        o = o * rr * tl.load(norm_ptr + 2 * j + 1).to(tl.float32)
        if MBITS:
            e, o = round_to_grid(e, MBITS, EMIN), round_to_grid(o, MBITS, EMIN)
    first: tl.constexpr = D // 2 - HALF_ROT  # the first rotated pair
    tail = j >= first
    c = tl.load(cos_ptr + t * HALF_ROT + j - first, mask=tail, other=1.0)
    s = tl.load(sin_ptr + t * HALF_ROT + j - first, mask=tail, other=0.0)
    if INVERSE:
        s = -s
    dtype = x_ptr.dtype.element_ty
    re = tl.where(tail, e * c - o * s, e)
    im = tl.where(tail, e * s + o * c, o)
    if MBITS:  # rounded to the input's dtype by bits (the interpreter's casts truncate)
        re, im = round_to_grid(re, MBITS, EMIN), round_to_grid(im, MBITS, EMIN)
    if KIND >= 0:  # block b holds pairs b * B / 2 .. (b + 1) * B / 2 - 1
        re2 = tl.reshape(re, (D // B, B // 2))
        im2 = tl.reshape(im, (D // B, B // 2))
        amax = tl.maximum(tl.max(tl.abs(re2), axis=1), tl.max(tl.abs(im2), axis=1))
        scale, inv = block_scales(amax, KIND)
        re = tl.reshape(on_grid(re2, scale, inv, KIND), (D // 2,))
        im = tl.reshape(on_grid(im2, scale, inv, KIND), (D // 2,))
    tl.store(out_ptr + r * D + 2 * j, re.to(dtype))
    tl.store(out_ptr + r * D + 2 * j + 1, im.to(dtype))
    if WRITE:
        row = tl.load(rows_ptr + t)
        at = row * (H * D) + (r - t * H) * D + 2 * j
        keep = (j * 0 + row) >= 0
        tl.store(cache_ptr + at, re.to(cache_ptr.dtype.element_ty), mask=keep)
        tl.store(cache_ptr + at + 1, im.to(cache_ptr.dtype.element_ty), mask=keep)


def rope_quant(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kind: int = NONE,
    inverse: bool = False,
    cache: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    norm: tuple[torch.Tensor, float] | None = None,
) -> torch.Tensor:
    """``x`` [T, ..., D] rotated on its last ``2 * cos.shape[-1]`` dims (``cos``/``sin``
    [T, rd / 2] fp32), through the ``kind`` round trip; also written to ``cache`` [R, ...] at
    ``rows`` [T] (-1: nowhere). ``norm`` (weight [D], eps): each row RMS-normalised first
    (a projection's norm in the same launch)."""
    t, d = x.shape[0], x.shape[-1]
    if d & (d - 1) or d < 2:
        raise ValueError(f"the rotated width must be a power of two, got {d}")
    block = BLOCK_OF.get(kind, 2)
    if d % block:
        raise ValueError(f"the width ({d}) must be a multiple of the round trip's block {block}")
    if norm is not None and (x.dim() != 2 or norm[0].numel() != d):
        raise ValueError(
            f"a norm in the launch takes rows [T, D] (one head) and a weight of D values, "
            f"got {list(x.shape)} and {norm[0].numel()} weights"
        )
    x = x.contiguous()
    out = torch.empty_like(x)
    heads = x.numel() // max(t * d, 1)
    if x.numel() == 0:
        return out
    write = cache is not None
    _rope_quant_kernel[(t * heads,)](
        x,
        cos.contiguous(),
        sin.contiguous(),
        out,
        cache if write else out,
        rows if write else cos,
        norm[0] if norm is not None else cos,
        norm[1] if norm is not None else 0.0,
        heads,
        D=d,
        HALF_ROT=cos.shape[-1],
        KIND=kind,
        B=block,
        INVERSE=inverse,
        WRITE=write,
        NORM=norm is not None,
        MBITS=GRID[x.dtype][0],
        EMIN=GRID[x.dtype][1],
        enable_fp_fusion=False,
    )
    return out
