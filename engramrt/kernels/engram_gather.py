"""Engram table gather: ``[T, C]`` row ids -> ``[T, C * D]``, fp8 e4m3 rows with one e8m0 scale
per 32 elements dequantised exactly (both formats decoded with integer bit operations, the product
formed in fp32 and rounded once to bf16, as the torch reference does), or bf16/fp32 rows copied.
Rows outside ``[row_start, row_start + num_rows)`` belong to another shard and read as -0.0,
written as its bit pattern."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pow2_f32(exponent):
    """2**exponent for integer exponents in [-126, 127], built from its bits (exact)."""
    return ((exponent + 127) << 23).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["num_pairs"])
def _gather_kernel(
    ids_ptr, weight_ptr, scale_ptr, out_ptr, num_pairs, num_rows, row_start,
    D: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr, NEG_ZERO: tl.constexpr,
    PAIRS: tl.constexpr,
):  # fmt: skip
    # PAIRS consecutive (token, column) pairs per program: their output rows are contiguous,
    # and several random table rows are in flight at once
    pp = tl.program_id(0).to(tl.int64) * PAIRS + tl.arange(0, PAIRS)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    dm = (d < D) & (pp < num_pairs)
    row = tl.load(ids_ptr + pp, mask=pp < num_pairs, other=0) - row_start
    owned = dm & (row >= 0) & (row < num_rows)
    if FP8:
        b = tl.load(weight_ptr + row * D + d, mask=owned, other=0).to(tl.int32)
        sign, ex, man = (b >> 7) & 1, (b >> 3) & 15, b & 7
        normal = (8 + man).to(tl.float32) * _pow2_f32(ex - 10)
        value = tl.where(ex == 0, man.to(tl.float32) * 0.001953125, normal)  # 2**-9
        value = tl.where((ex == 15) & (man == 7), float("nan"), value)  # magnitude only
        e = tl.load(scale_ptr + row * (D // 32) + d // 32, mask=owned, other=127).to(tl.int32)
        scale = (e << 23).to(tl.float32, bitcast=True)
        tiny = tl.full((1, BLOCK_D), 0x00400000, tl.int32).to(tl.float32, bitcast=True)
        scale = tl.where(e == 0, tiny, scale)  # e8m0 byte 0 is 2**-127
        scale = tl.where(e == 255, float("nan"), scale)
        # the sign goes in as a bit: -x can compile to 0 - x, which turns -0.0 into +0.0
        bits = _bf16_bits(value * scale) | (sign << 15).to(tl.int16)
        bits = tl.where(owned, bits, NEG_ZERO)
        tl.store(out_ptr + pp * D + d, bits, mask=dm)  # out_ptr: an int16 view of bf16
    else:  # plain tables are copied as integers (compilers may fold a -0.0 literal to +0.0)
        bits = tl.load(weight_ptr + row * D + d, mask=owned, other=0)
        tl.store(out_ptr + pp * D + d, tl.where(owned, bits, NEG_ZERO).to(bits.dtype), mask=dm)


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bit pattern, round to nearest even, by integer arithmetic: exact for
    subnormals too (the interpreter's float conversion is not), NaN kept quiet."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, (u >> 16) | 0x40, r)
    return r.to(tl.int32).to(tl.int16)


_INT_VIEW = {2: torch.int16, 4: torch.int32}
PAIRS = 8


def gather(
    ids: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    row_start: int = 0,
) -> torch.Tensor:
    """The kernel behind ``EngramTable.lookup``: same inputs, same bits."""
    t, cols = ids.shape
    rows, dim = weight.shape
    fp8 = scale is not None
    out_dtype = torch.bfloat16 if fp8 else weight.dtype
    out = torch.empty(t, cols * dim, dtype=out_dtype, device=ids.device)
    if t * cols == 0:
        return out
    as_int = _INT_VIEW[out.element_size()]
    w = weight.view(torch.uint8) if fp8 else weight.view(as_int)
    s = scale.view(torch.uint8) if fp8 else w
    _gather_kernel[(triton.cdiv(t * cols, PAIRS),)](
        ids.long().contiguous(), w, s, out.view(as_int), t * cols, rows, row_start,
        D=dim, BLOCK_D=triton.next_power_of_2(dim), FP8=fp8,
        NEG_ZERO=-(2 ** (8 * out.element_size() - 1)),  # the sign bit alone: -0.0
        PAIRS=PAIRS,
    )  # fmt: skip
    return out
