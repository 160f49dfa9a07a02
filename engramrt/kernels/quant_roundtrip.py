"""DeepSeek-V4.1's block round trips (``engramrt.models.deepseek_v41.quant``'s ``act_roundtrip`` and
``fp4_roundtrip``) in one launch each: the torch path takes some twenty elementwise launches per
call, and a V4.1 step makes hundreds of calls.

Each program takes ``NB`` blocks of ``B`` contiguous values: the block's amax, its scale, every
value divided by it, clamped to the format's range, rounded to nearest even on the format's grid
and multiplied back. Rounding adds and subtracts ``1.5 * 2**23`` times the grid step, which fp32
addition rounds to nearest even (no conversion instruction, so the interpreter's numbers are the
GPU's). Bit-identical to the torch path (``tests/kernels/test_quant_roundtrip.py``), the sign of
an exact zero aside.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACT, FP4_POW2, FP4_E4M3 = 0, 1, 2  # act_quant; fp4_roundtrip POW2_SCALE; E4M3_SCALE
BLOCK_OF = {ACT: 32, FP4_POW2: 32, FP4_E4M3: 16}
NB = 32  # blocks a program


@triton.jit
def round_to_grid(v, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """``v`` rounded to nearest even with ``MBITS`` mantissa bits, subnormal below ``2**EMIN``;
    the sign is ``v``'s bit, so a value rounded to zero keeps it (as torch's casts do; a GPU's
    negation of a rounded zero can give +0)."""
    bits = v.to(tl.int32, bitcast=True)
    mag = tl.abs(v)
    e = ((bits >> 23) & 0xFF) - 127
    e = tl.maximum(e, EMIN)
    magic = ((e - MBITS + 150) << 23).to(tl.float32, bitcast=True) * 1.5  # 1.5 * 2**23 * step
    r = (mag + magic) - magic
    sign = (bits >> 31) << 31  # the sign bit alone (an arithmetic shift keeps it)
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _pow2_ceil(amax, INV: tl.constexpr):
    """(``2**ceil(log2(amax * INV))``, its reciprocal) from the fp32 bits of the product."""
    bits = (amax * INV).to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    return scale, ((254 - exponent) << 23).to(tl.float32, bitcast=True)


@triton.jit
def block_scales(amax, KIND: tl.constexpr):
    """(scale, its reciprocal; the E4M3-scaled kind divides) of blocks whose amax is ``amax``."""
    if KIND == 0:  # E4M3 values, power-of-two scale of amax / 448
        scale, inv = _pow2_ceil(tl.maximum(amax, 1e-4), 0.002232142857142857)
    elif KIND == 1:  # E2M1 values, power-of-two scale of amax / 6
        scale, inv = _pow2_ceil(tl.maximum(amax, 6.0 * 2.0**-126), 0.16666666666666666)
    else:  # E2M1 values, E4M3 scale of amax / 6
        s = tl.div_rn(tl.maximum(amax, 6.0 * 2.0**-9), tl.full(amax.shape, 6.0, tl.float32))
        scale = round_to_grid(tl.minimum(s, 448.0), 3, -6)
        inv = scale
    return scale, inv


@triton.jit
def on_grid(g, scale, inv, KIND: tl.constexpr):
    """Values ``g`` [blocks, n] (fp32) quantised with their block's ``scale`` and back."""
    if KIND == 0:
        v = tl.minimum(tl.maximum(g * inv[:, None], -448.0), 448.0)
        q = round_to_grid(v, 3, -6)
    elif KIND == 1:
        q = round_to_grid(tl.minimum(tl.maximum(g * inv[:, None], -6.0), 6.0), 1, 0)
    else:
        v = tl.div_rn(g, tl.broadcast_to(scale[:, None], g.shape))
        q = round_to_grid(tl.minimum(tl.maximum(v, -6.0), 6.0), 1, 0)
    return q * scale[:, None]


@triton.jit
def _roundtrip_kernel(
    x_ptr, out_ptr, n_blocks, KIND: tl.constexpr, B: tl.constexpr, NB: tl.constexpr
):
    blk = tl.program_id(0) * NB + tl.arange(0, NB)
    offs = blk[:, None].to(tl.int64) * B + tl.arange(0, B)[None, :]
    mask = blk[:, None] < n_blocks
    g = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    scale, inv = block_scales(tl.max(tl.abs(g), axis=1), KIND)
    tl.store(out_ptr + offs, on_grid(g, scale, inv, KIND).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _e4m3_bits(q, v):
    """fp32 values ``q`` on E4M3's grid as their E4M3 bytes, by moving bits (no conversion
    instruction: the same bits in the interpreter and on any GPU): exponent rebiased from 127
    to 7 with the top three mantissa bits, or a subnormal's multiple of 2**-9; the sign is
    that of ``v``, the value rounded (a GPU negates a rounded zero to +0, torch keeps -0)."""
    sign = (v.to(tl.int32, bitcast=True) >> 24) & 0x80
    mag = q.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    normal = (((mag >> 23) - 120) << 3) | ((mag >> 20) & 7)
    sub = (tl.abs(q) * 512.0).to(tl.int32)  # exact: 0 .. 7 multiples of 2**-9
    return (sign | tl.where(mag >= 0x3C800000, normal, sub)).to(tl.uint8)


@triton.jit
def act_codes_of(g):
    """``act_quant`` of blocks ``g`` [blocks, 32] (fp32): (E4M3 codes, fp32 scales [blocks],
    the round trip's bf16 values): the round trip's grid point, as its code (exact: it lies on
    E4M3's grid), and times its scale (exact in bf16: what FP4 weights multiply)."""
    scale, inv = block_scales(tl.max(tl.abs(g), axis=1), 0)
    v = tl.minimum(tl.maximum(g * inv[:, None], -448.0), 448.0)
    q = round_to_grid(v, 3, -6)
    values = (q * scale[:, None]).to(tl.bfloat16)
    return _e4m3_bits(q, v).to(tl.float8e4nv, bitcast=True), scale, values


@triton.jit
def store_act_codes(g, blk, live, codes_ptr, scale_ptr, values_ptr, VALUES: tl.constexpr):
    """``act_codes_of(g)`` stored where ``act_codes`` keeps it: blocks ``g`` [NB, 32] are the
    flat blocks ``blk`` [NB] of a ``[..., K]`` tensor (stored where ``live``), their codes (and
    with ``VALUES`` the bf16 values) at ``blk * 32 ..``, their scales at ``blk``. Every launch
    that quantises for the linears after it stores through here."""
    codes, scale, values = act_codes_of(g)
    offs = blk[:, None].to(tl.int64) * 32 + tl.arange(0, 32)[None, :]
    mask = live[:, None] & (offs >= 0)
    tl.store(codes_ptr + offs, codes, mask=mask)
    tl.store(scale_ptr + blk, scale, mask=live)
    if VALUES:
        tl.store(values_ptr + offs, values, mask=mask)


# a step's block count varies: left unspecialised so that no count compiles a variant mid-run
@triton.jit(do_not_specialize=["n_blocks"])
def _act_codes_kernel(
    x_ptr, codes_ptr, scale_ptr, values_ptr, n_blocks, VALUES: tl.constexpr, NB: tl.constexpr
):
    blk = tl.program_id(0) * NB + tl.arange(0, NB)
    offs = blk[:, None].to(tl.int64) * 32 + tl.arange(0, 32)[None, :]
    g = tl.load(x_ptr + offs, mask=blk[:, None] < n_blocks, other=0.0).to(tl.float32)
    store_act_codes(g, blk, blk < n_blocks, codes_ptr, scale_ptr, values_ptr, VALUES)


def act_codes(x: torch.Tensor, values: bool = False) -> tuple[torch.Tensor, ...]:
    """``quant.act_quant(x)`` in one launch: E4M3 codes ``[..., K]`` and fp32 scales
    ``[..., K / 32]``, and with ``values`` the round trip's bf16 values ``[..., K]`` (what
    FP4 weights multiply) or None."""
    if x.shape[-1] % 32:
        raise ValueError(f"the last dim ({x.shape[-1]}) must be a multiple of 32")
    x = x.contiguous()
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(*x.shape[:-1], x.shape[-1] // 32, dtype=torch.float32, device=x.device)
    out = torch.empty(x.shape, dtype=torch.bfloat16, device=x.device) if values else None
    n_blocks = x.numel() // 32
    if n_blocks:
        grid = (triton.cdiv(n_blocks, NB),)
        _act_codes_kernel[grid](
            x, codes, scale, out if values else scale, n_blocks, VALUES=values, NB=NB
        )
    return codes, scale, out


def roundtrip(x: torch.Tensor, kind: int) -> torch.Tensor:
    """``x`` through the ``kind`` round trip, in ``x``'s dtype (blocks along the last dim)."""
    block = BLOCK_OF[kind]
    if x.shape[-1] % block:
        raise ValueError(f"the last dim ({x.shape[-1]}) must be a multiple of {block}")
    x = x.contiguous()
    out = torch.empty_like(x)
    n_blocks = x.numel() // block
    if n_blocks:
        _roundtrip_kernel[(triton.cdiv(n_blocks, NB),)](x, out, n_blocks, KIND=kind, B=block, NB=NB)
    return out
