"""Engram table gather: ``[T, C]`` row ids -> ``[T, C * D]``, fp8 e4m3 rows with one e8m0 scale
per 32 elements dequantised exactly (bit for bit what the torch reference's fp32 product, rounded
once to bf16, gives; NaN payloads aside), or bf16/fp32 rows copied. Rows outside
``[row_start, row_start + num_rows)`` belong to another shard and read as -0.0, written as its
bit pattern.

The kernel is bound by random row reads in flight, and by the fp8 decode's integer work once
they are many: a persistent grid of programs walks tiles of ``pairs`` (token, column) rows, and
a row whose scale byte lies in [10, 246] (every realistic one) is decoded in a few integer
operations; a tile holding anything else (tiny or huge scales, NaN bytes) takes the general
path, which rounds through fp32 like the reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl


@triton.jit
def _pow2_f32(exponent):
    """2**exponent for integer exponents in [-126, 127], built from its bits (exact)."""
    return ((exponent + 127) << 23).to(tl.int32).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_bits(x):
    """fp32 -> bf16 bit pattern, round to nearest even, by integer arithmetic: exact for
    subnormals too (the interpreter's float conversion is not), NaN kept quiet."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, (u >> 16) | 0x40, r)
    return r.to(tl.int32)


@triton.jit
def _easy_bits(b, e):
    """e4m3 byte ``b`` times 2**(e - 127) as bf16 bits, for 10 <= e <= 246 and b not NaN.
    |value| = m * 2**-9 with the integer m = man (subnormal) or (8 + man) << (ex - 1); m < 2**24
    converts to fp32 exactly, and adding e - 136 to its exponent field scales it exactly while
    the result stays normal, which the range of e guarantees. At most 4 significant bits: the
    top half of the fp32 word is the bf16 value, no rounding."""
    ex, man = (b >> 3) & 15, b & 7
    m = tl.where(ex == 0, man, (8 + man) << tl.maximum(ex - 1, 0))
    u = m.to(tl.float32).to(tl.int32, bitcast=True)
    u = tl.where(m == 0, 0, u + ((e - 136) << 23))
    return (u >> 16) | ((b >> 7) << 15)


@triton.jit
def _exact_bits(b, e):
    """The general case: any byte, any scale, through an fp32 product like the reference."""
    sign, ex, man = (b >> 7) & 1, (b >> 3) & 15, b & 7
    normal = (8 + man).to(tl.float32) * _pow2_f32(ex - 10)
    value = tl.where(ex == 0, man.to(tl.float32) * 0.001953125, normal)  # 2**-9
    value = tl.where((ex == 15) & (man == 7), float("nan"), value)  # magnitude only
    scale = (e << 23).to(tl.float32, bitcast=True)
    tiny = tl.full(scale.shape, 0x00400000, tl.int32).to(tl.float32, bitcast=True)
    scale = tl.where(e == 0, tiny, scale)  # e8m0 byte 0 is 2**-127
    scale = tl.where(e == 255, float("nan"), scale)
    # the sign goes in as a bit: -x can compile to 0 - x, which turns -0.0 into +0.0
    return _bf16_bits(value * scale) | (sign << 15)


@triton.jit(do_not_specialize=["num_pairs"])
def _gather_fp8_kernel(
    ids_ptr,
    weight_ptr,
    scale_ptr,
    out_ptr,
    num_pairs,
    num_rows,
    row_start,
    NB: tl.constexpr,
    NB_PAD: tl.constexpr,
    PAIRS: tl.constexpr,
):
    # a tile is [PAIRS, NB blocks, 32 elements]: the scale byte broadcasts over its block
    D: tl.constexpr = NB * 32
    k = tl.arange(0, NB_PAD)[None, :, None]
    j = tl.arange(0, 32)[None, None, :]
    num_tiles = tl.cdiv(num_pairs, PAIRS)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        pp = (tile * PAIRS + tl.arange(0, PAIRS)[:, None, None]).to(tl.int64)
        live = (pp < num_pairs) & (k < NB)
        row = tl.load(ids_ptr + pp, mask=pp < num_pairs, other=0) - row_start
        owned = live & (row >= 0) & (row < num_rows)
        e = tl.load(scale_ptr + row * NB + k, mask=owned, other=127).to(tl.int32)
        b = tl.load(weight_ptr + row * D + k * 32 + j, mask=owned, other=0).to(tl.int32)
        hard = (e < 10) | (e > 246) | ((b & 0x7F) == 0x7F)
        if tl.max(hard.to(tl.int32)) > 0:
            bits = _exact_bits(b, e)
        else:
            bits = _easy_bits(b, e)
        bits = tl.where(owned, bits, -32768).to(tl.int16)  # -0.0 where the row is not ours
        tl.store(out_ptr + pp * D + k * 32 + j, bits, mask=live)  # out_ptr: int16 view of bf16


@triton.jit(do_not_specialize=["num_pairs"])
def _gather_copy_kernel(
    ids_ptr,
    weight_ptr,
    out_ptr,
    num_pairs,
    num_rows,
    row_start,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NEG_ZERO: tl.constexpr,
    PAIRS: tl.constexpr,
):
    # plain tables are copied as integers (compilers may fold a -0.0 literal to +0.0)
    d = tl.arange(0, BLOCK_D)[None, :]
    num_tiles = tl.cdiv(num_pairs, PAIRS)
    for tile in range(tl.program_id(0), num_tiles, tl.num_programs(0)):
        pp = (tile * PAIRS + tl.arange(0, PAIRS)[:, None]).to(tl.int64)
        live = (d < D) & (pp < num_pairs)
        row = tl.load(ids_ptr + pp, mask=pp < num_pairs, other=0) - row_start
        owned = live & (row >= 0) & (row < num_rows)
        bits = tl.load(weight_ptr + row * D + d, mask=owned, other=0)
        tl.store(out_ptr + pp * D + d, tl.where(owned, bits, NEG_ZERO).to(bits.dtype), mask=live)


@dataclass(frozen=True)
class GatherConfig:
    """Launch shape: ``pairs`` rows per tile, ``num_warps`` per program, at most
    ``max_programs`` programs (the grid is persistent beyond that; 0: one per tile)."""

    pairs: int = 4
    num_warps: int = 4
    max_programs: int = 0


# from a sweep of launch shapes on an H200 (benchmarks/HISTORY.md, 2026-11-30). Device tables: small
# tiles, about 16 programs per SM. Host tables: PCIe, not the SMs, bounds the reads, and a
# program waiting on PCIe holds an SM that a GEMM running beside a read-ahead then cannot use
# (measured: a 1 ms host gather beside a GEMM delays it by 0.6-1.1 ms). So few programs: 64 of
# four rows for a decode-sized read, 32 of sixteen rows for a prefill-sized one.
DEVICE_TABLES = GatherConfig(pairs=4, num_warps=4, max_programs=2048)
HOST_SMALL, HOST_LARGE = GatherConfig(4, 4, 64), GatherConfig(16, 4, 32)
HOST_SMALL_PAIRS = 256 * 24  # up to a 256-token step of a 24-column Engram


def default_config(weight: torch.Tensor, ids: torch.Tensor) -> GatherConfig:
    if weight.device.type == "cpu" and ids.is_cuda:
        return HOST_SMALL if ids.numel() <= HOST_SMALL_PAIRS else HOST_LARGE
    return DEVICE_TABLES


_INT_VIEW = {2: torch.int16, 4: torch.int32}


def gather(
    ids: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor | None,
    row_start: int = 0,
    config: GatherConfig | None = None,
) -> torch.Tensor:
    """The kernel behind ``EngramTable.lookup``: same inputs, same bits. ``weight`` may be a
    registered host tensor, which the GPU reads in place."""
    t, cols = ids.shape
    rows, dim = weight.shape
    fp8 = scale is not None
    out_dtype = torch.bfloat16 if fp8 else weight.dtype
    out = torch.empty(t, cols * dim, dtype=out_dtype, device=ids.device)
    if t * cols == 0:
        return out
    config = config or default_config(weight, ids)
    pairs = t * cols
    tiles = triton.cdiv(pairs, config.pairs)
    grid = (min(tiles, config.max_programs or tiles),)
    ids = ids.long().contiguous()
    as_int = _INT_VIEW[out.element_size()]
    if fp8:
        nb = dim // 32  # one e8m0 scale per 32 elements
        _gather_fp8_kernel[grid](
            ids,
            weight.view(torch.uint8),
            scale.view(torch.uint8),
            out.view(torch.int16),
            pairs,
            rows,
            row_start,
            NB=nb,
            NB_PAD=triton.next_power_of_2(nb),
            PAIRS=config.pairs,
            num_warps=config.num_warps,
        )
    else:
        _gather_copy_kernel[grid](
            ids,
            weight.view(as_int),
            out.view(as_int),
            pairs,
            rows,
            row_start,
            D=dim,
            BLOCK_D=triton.next_power_of_2(dim),
            NEG_ZERO=-(2 ** (8 * out.element_size() - 1)),  # the sign bit alone: -0.0
            PAIRS=config.pairs,
            num_warps=config.num_warps,
        )
    return out
