"""DeepSeek-V4.1's FP8 and FP4 linears on the tensor cores, reading their weights in the
checkpoint's bytes (FP4 nibbles paired at load): no dequantised copy of a weight is ever written.

``y[m, n] = sum_k a[m, k] w[n, k]`` where ``a`` is the activation after ``act_quant`` (E4M3 codes
and a power-of-two scale per 32 inputs) and ``w`` the stored codes (E4M3 bytes with 32 x 32
E8M0 scales, or E2M1 codes two a byte with an E8M0 scale per 32 inputs, in the paired layout
``quant.pair_fp4`` makes at load: a byte holds element j of a block and element j of the next).

- FP8: each 32-input block is one FP8 tensor-core product of codes, scaled on the accumulator by
  its two scales (the block scaling DeepGEMM does per 128).
- FP4: codes become bf16 values with their block's scale in a few integer operations and one
  bf16x2 multiply for two codes (the Marlin trick: bits moved into place give ``code *
  2**-126``, the multiply by ``2**(s - 1)`` gives the value), and meet the activation's bf16
  values (its ``act_quant`` round trip, exact in bf16) in bf16 tensor-core products that
  accumulate in place: no scale on the accumulator, so the products of successive blocks
  queue without waiting. Every product is exact (2 x 4 significant bits); fp32 sums.

Weight tiles come by TMA (bulk copies from a host tensor descriptor: no address registers, so
more warps in flight; 13-18% faster than pointer loads on the large weights, on an H100), and
Triton's pipeline prefetches them and the activation tiles a few steps ahead; the scales (a
byte a row, too small a load for it) are loaded a step ahead by hand.

Batch invariant by construction: the launch settings depend on the weight's shape only, never
on the row count, and every row's sum runs over the same blocks in the same order (rows are
the tensor cores' narrow dimension: weights fill the wide one). Split K is summed in a fixed
order by the last program of a tile (no atomics on values, no extra launch), so the same row
gives the same bits alone or among 63 others.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from engramrt.kernels.common import MAX_TILES, SMS, SPREAD_BELOW, arrival_counters, interpreted
from engramrt.kernels.quant_roundtrip import act_codes

# rows a program: the tensor cores' narrow side, 16 for decode-sized steps, 64 above (fewer
# reads of each weight tile); a row's operations are the same in either
BM, BM_LARGE, LARGE_ROWS = 16, 64, 64


def _e2m1_ptx() -> str:
    """The PTX of ``_e2m1_pair``: output ``$i`` (i: 0, 1 the low nibbles of bytes 0-1 / 2-3, 2,
    3 their high nibbles) is a byte pair's nibble spread to 16-bit lanes (``prmt``), its sign
    moved to bit 15 and its exponent and mantissa to bits 8..6, times the factor ``$(i + 5)``."""

    def nibble(high: int, out: int) -> str:
        sign, mag = 0x00080008 << 4 * high, 0x00070007 << 4 * high
        return (
            f"and.b32 s, y, {sign:#010x}; shl.b32 s, s, {12 - 4 * high};"
            f"and.b32 m, y, {mag:#010x}; shl.b32 m, m, {6 - 4 * high}; or.b32 m, m, s;"
            f"mul.rn.bf16x2 ${out}, m, ${out + 5};"
        )

    pairs = (
        f"prmt.b32 y, $4, 0, {select}; {nibble(0, pair)} {nibble(1, pair + 2)}"
        for pair, select in ((0, "0x4140"), (1, "0x4342"))
    )
    return "{ .reg .b32 y, s, m; " + " ".join(pairs) + " }"


E2M1_PTX = tl.constexpr(_e2m1_ptx())


@triton.jit
def _e2m1_pair(byte, f_lo, f_hi, ASM: tl.constexpr):
    """A byte's two E2M1 codes times ``f_lo`` / ``f_hi`` (bf16 ``2**(s - 1)`` of the blocks'
    E8M0 exponents ``s``), (low nibble's, high nibble's), exact. ``ASM``: four bytes a 32-bit
    register, spread to 16-bit lanes by one byte permute; each code's sign to bit 15, exponent
    and mantissa to bits 8..6 (a bf16 ``code * 2**-126``, subnormal for 0.5), then one bf16x2
    multiply for two values (bf16 arithmetic keeps subnormals; Hopper converts slowly element
    by element). Else fp32 in the same steps (the interpreter keeps subnormals too)."""
    if ASM:
        return tl.inline_asm_elementwise(
            asm=E2M1_PTX,
            constraints="=r,=r,=r,=r,r,r,r,r,r",
            args=[byte, f_lo, f_hi],
            dtype=(tl.bfloat16, tl.bfloat16),
            is_pure=True,
            pack=4,
        )
    else:
        b = byte.to(tl.int32)
        lo = (((b & 0x08) << 28) | ((b & 0x07) << 22)).to(tl.float32, bitcast=True)
        hi = (((b & 0x80) << 24) | ((b & 0x70) << 18)).to(tl.float32, bitcast=True)
        return lo * f_lo.to(tl.float32), hi * f_hi.to(tl.float32)


@triton.jit
def _e8m0(raw):
    """E8M0 scale bytes as fp32 powers of two: the byte is the exponent field (exact)."""
    return ((raw.to(tl.int32) & 0xFF) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _bf16_factor(raw, ASM: tl.constexpr):
    """E8M0 scale bytes ``s`` as ``2**(s - 1)``: what a decoded ``code * 2**-126`` is multiplied
    by (bf16 on a GPU: exact for ``s <= 128``, which ``quant.check_fp4_scales`` holds at load)."""
    f = (((raw.to(tl.int32) & 0xFF) + 126) << 23).to(tl.float32, bitcast=True)
    return f.to(tl.bfloat16) if ASM else f


@triton.jit
def _scaled_dot(acc, w, a_ptr, src, stride, blk, aok, sw, sa):
    """``acc`` plus ``w`` [BN, 32] E4M3 times the activation's 32 codes of block ``blk`` (rows
    ``stride`` apart, read where ``aok``), scaled by the features' ``sw`` [BN] and the rows'
    ``sa`` [BM]. One FP8 tensor-core product."""
    c32 = tl.arange(0, 32)
    amask = aok[:, None] & (c32[None, :] < 32)
    a = tl.load(a_ptr + src[:, None] * stride + blk * 32 + c32[None, :], mask=amask, other=0.0)
    # an explicit FMA: whether the compiler fuses the scaling into the sum must not depend on
    # the tile's shape (it did for the mHC expand)
    return tl.fma(tl.dot(w, tl.trans(a)), sw[:, None] * sa[None, :], acc)


@triton.jit
def _scales(ptr, rows, ok, blocks, kb, kb_stop, G: tl.constexpr, other):
    """``[len(rows), G]``: the scales of blocks ``kb ..`` of each row (``other`` past
    ``kb_stop`` and where not ``ok``): loaded an iteration ahead of their use, since a load
    of a byte a row is too small for the pipeline's prefetch and was waited for each step."""
    cg = tl.arange(0, G)
    at = kb + cg[None, :]
    mask = ok[:, None] & (at < kb_stop)
    return tl.load(ptr + rows[:, None] * blocks + at, mask=mask, other=other)


@triton.jit
def _row_scales(ptr, src, live, blocks, kb, kb_stop, G: tl.constexpr, VALUES: tl.constexpr):
    """The rows' ``_scales`` (codes); activations that come as values have none (``ptr`` is
    then a placeholder, unread)."""
    if VALUES:
        out = tl.zeros([src.shape[0], G], dtype=tl.float32)
    else:
        out = _scales(ptr, src, live, blocks, kb, kb_stop, G, 0.0)
    return out


@triton.jit
def _column(tile, j: tl.constexpr, G: tl.constexpr):
    """Column ``j`` of ``tile`` [R, G] (G: 1, 2 or 4), by splits in registers."""
    R: tl.constexpr = tile.shape[0]
    if G == 1:
        col = tl.reshape(tile, [R])
    elif G == 2:
        c0, c1 = tl.split(tile)
        col = c0 if j == 0 else c1
    else:
        even, odd = tl.split(tl.reshape(tile, [R, 2, 2]))  # columns (0, 2) and (1, 3)
        c0, c1 = tl.split(even if j % 2 == 0 else odd)
        col = c0 if j // 2 == 0 else c1
    return col


@triton.jit
def _value_dot(acc, w, a_ptr, src, stride, at, width, aok, ASM: tl.constexpr):
    """``acc`` plus ``w`` [BN, 32] (scaled values) times the activation's bf16 values from
    column ``at`` (``width`` of them; zeros past; rows ``stride`` apart), accumulated in the
    product: one bf16 tensor-core product (fp32 at full precision in the interpreter, whose
    bf16 product is wrong; the values are exact in either)."""
    c32 = tl.arange(0, 32)
    amask = aok[:, None] & (c32[None, :] < width)
    a = tl.load(a_ptr + src[:, None] * stride + at + c32[None, :], mask=amask, other=0.0)
    if ASM:
        acc = tl.dot(w, tl.trans(a), acc)
    else:
        acc = tl.dot(w, tl.trans(a.to(tl.float32)), acc, input_precision="ieee")
    return acc


@triton.jit
def _weight_tile(w_desc, e, n0, col, BN: tl.constexpr, GROUPED: tl.constexpr):
    """``[BN, 32]`` weight bytes from feature ``n0``, byte ``col`` (expert ``e``'s where
    ``GROUPED``): one TMA copy, so the pipeline's prefetch costs no registers for addresses
    (156 a thread with pointer loads held occupancy to one warp group a scheduler); features
    past the weight's and bytes past a row's end come as zeros (the FP4 odd last block's)."""
    if GROUPED:
        tile = tl.reshape(w_desc.load([e, n0, col]), [BN, 32])
    else:
        tile = w_desc.load([n0, col])
    return tile


@triton.jit
def _blocks_sum(
    a_ptr,
    sa_ptr,
    w_desc,
    e,
    n0,
    sw_ptr,
    src,
    live,
    rn,
    nmask,
    K,
    A_STRIDE,
    kb0,
    kb_stop,
    FP4: tl.constexpr,
    VALUES: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    G: tl.constexpr,
    ASM: tl.constexpr,
    GROUPED: tl.constexpr,
):
    """``[BN, BM]``: K blocks ``[kb0, kb_stop)`` in ascending order, summed in fp32 from zero
    (activation rows ``A_STRIDE`` apart). FP8: each an FP8 tensor-core product of 32 codes
    scaled by its two scales; with ``VALUES`` (the activation's bf16 values, not codes) the
    weight's codes times their scale as bf16 values (exact) in a bf16 product instead. FP4
    (``VALUES`` always): weights come paired (``quant.pair_fp4``): a 32-byte load holds two
    blocks, the low nibbles one and the high the next, each already in element order (no
    shuffle between decoding and the product); a K whose blocks are odd ends in one block
    split the same way in halves."""
    blocks = K // 32
    rn64 = rn.to(tl.int64)
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    # each iteration's scales come from the one before (FP4: the features'; FP8: the 32-feature
    # groups' and the rows')
    sw_rows = rn64 if FP4 else rn64 // 32
    next_sw = _scales(sw_ptr, sw_rows, nmask, blocks, kb0, kb_stop, G, 127)
    next_sa = _row_scales(sa_ptr, src, live, blocks, kb0, kb_stop, G, VALUES)
    for kb in range(kb0, kb_stop, G):
        sw_tile, sa_tile = next_sw, next_sa
        next_sw = _scales(sw_ptr, sw_rows, nmask, blocks, kb + G, kb_stop, G, 127)
        next_sa = _row_scales(sa_ptr, src, live, blocks, kb + G, kb_stop, G, VALUES)
        if FP4:
            for g in tl.static_range(0, G, 2):  # kb, G and every split's start are even
                b = kb + g
                # (vectors: the interpreter cannot mask with a scalar)
                aok = live & (src * 0 + b < kb_stop)
                half = tl.where(b + 1 < blocks, 32, 16)  # a pair, or the odd last block
                byte = _weight_tile(w_desc, e, n0, b * 16, BN, GROUPED)
                f_lo = _bf16_factor(_column(sw_tile, g, G), ASM)
                # the odd last block's second half: its own scale
                f_hi = tl.where(half == 32, _bf16_factor(_column(sw_tile, g + 1, G), ASM), f_lo)
                lo, hi = _e2m1_pair(
                    byte,
                    tl.broadcast_to(f_lo[:, None], [BN, 32]),
                    tl.broadcast_to(f_hi[:, None], [BN, 32]),
                    ASM,
                )
                acc = _value_dot(acc, lo, a_ptr, src, A_STRIDE, b * 32, half, aok, ASM)
                acc = _value_dot(acc, hi, a_ptr, src, A_STRIDE, b * 32 + half, half, aok, ASM)
        else:
            for g in tl.static_range(G):
                b = kb + g
                aok = live & (src * 0 + b < kb_stop)
                w = _weight_tile(w_desc, e, n0, b * 32, BN, GROUPED).to(tl.float8e4nv, bitcast=True)
                sw = _e8m0(_column(sw_tile, g, G))
                if VALUES:
                    wv = w.to(tl.float32) * sw[:, None]  # a code times a power of two: exact
                    wv = wv.to(tl.bfloat16) if ASM else wv
                    acc = _value_dot(acc, wv, a_ptr, src, A_STRIDE, b * 32, 32, aok, ASM)
                else:
                    sa = _column(sa_tile, g, G)
                    acc = _scaled_dot(acc, w, a_ptr, src, A_STRIDE, b, aok, sw, sa)
    return acc


@triton.jit
def _partial(parts, p, programs, stride, omask):
    """Split ``p``'s partial sums (zeros past the last split), from L2."""
    ok = omask & (omask.to(tl.int32) * 0 + p < programs)  # (a tensor mask: the interpreter's)
    return tl.load(parts + p * stride, mask=ok, other=0.0, cache_modifier=".cg")


@triton.jit
def _store_out(total, out_ptr, rm, rn, live, omask, N, add_ptr, by_id_ptr, TOP_K,
               ADD: tl.constexpr):  # fmt: skip
    """The tile's sums ``total`` [BN, BM] as the output's rows ``rm``; ``ADD``: rounded to the
    added rows' dtype, after the fp32 sum of each row's ``TOP_K`` added rows (``by_id``'s, in
    order; the MoE's combine: the routed experts' outputs in ascending id, then the shared
    one's)."""
    if ADD:
        own = total.to(add_ptr.dtype.element_ty).to(tl.float32)
        total = tl.zeros(total.shape, tl.float32)
        for s in range(TOP_K):
            row = tl.load(by_id_ptr + rm.to(tl.int64) * TOP_K + s, mask=live, other=0)
            rows = add_ptr + row[None, :].to(tl.int64) * N + rn[:, None]
            total += tl.load(rows, mask=omask, other=0.0).to(tl.float32)
        total += own
    outs = out_ptr + rm[None, :].to(tl.int64) * N + rn[:, None]
    tl.store(outs, total.to(out_ptr.dtype.element_ty), mask=omask)


# the row count varies by step (and by routing): specialising on it compiled variants while
# serving
@triton.jit(do_not_specialize=["M", "R", "SPLITS", "PROGRAMS", "TOP_K"])
def _stored_linear_kernel(
    a_ptr,  # E4M3 codes [R, K]; VALUES: bf16 values [R, K] (rows A_STRIDE apart)
    sa_ptr,  # fp32 scales [R, K / 32] (FP8)
    w_desc,  # the weight's bytes [N, K or K / 2] ([E, N, ..] GROUPED), tiles of [BN, 32]
    sw_ptr,
    out_ptr,  # [M, N]
    part_ptr,  # fp32 [SPLITS, M, N] when PROGRAMS > 1
    count_ptr,  # int32 arrival counters, zero between launches
    rows_ptr,  # GATHER: the activation row of each output row, times TOP_K
    tiles_ptr,  # GROUPED: (expert, lo, hi) a row tile
    add_ptr,  # ADD: rows added to the output's, [P, N]
    by_id_ptr,  # ADD: each output row's TOP_K added rows, [M, TOP_K]
    M,
    R,
    N,
    K,
    A_STRIDE,
    GROUP_N,
    BLOCKS_SPLIT,
    S_STRIDE,
    SPLITS,
    PROGRAMS,
    TOP_K,
    FP4: tl.constexpr,
    VALUES: tl.constexpr,
    GROUPED: tl.constexpr,
    GATHER: tl.constexpr,
    ADD: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    G: tl.constexpr,
    ASM: tl.constexpr,
):
    """Program (row tile, feature tile, k program): ``BN`` features x ``BM`` rows. K is cut
    into ``SPLITS`` ranges of ``BLOCKS_SPLIT`` blocks, each summed from zero, and the ranges'
    sums added in order from zero: by ``SPLITS`` programs, the last to arrive adding the
    partials (``PROGRAMS == SPLITS``, few rows), or by one program in turn (``PROGRAMS == 1``,
    many rows): the same operations, so the same bits. ``GROUPED``: row tile ``pid_m`` is
    ``tiles[pid_m]`` against its expert's weight (scales ``S_STRIDE`` apart); an empty
    tile reads nothing. Features come in groups of ``GROUP_N``, each reading its own ``K``
    columns of the activation's rows (V4.1's grouped ``wo_a``; one group: all of them)."""
    pid_m, pid_n, pid_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if GROUPED:
        e = tl.load(tiles_ptr + 3 * pid_m).to(tl.int32)
        lo, end = tl.load(tiles_ptr + 3 * pid_m + 1), tl.load(tiles_ptr + 3 * pid_m + 2)
        sw_ptr += e.to(tl.int64) * S_STRIDE
    else:
        e, lo, end = 0, pid_m * BM, M
    rm = lo + tl.arange(0, BM)
    live = rm < end
    src = tl.load(rows_ptr + rm, mask=live, other=0) // TOP_K if GATHER else rm
    src = src.to(tl.int64)
    n0 = pid_n * BN
    a_ptr += (n0 // GROUP_N) * K  # a tile lies in one group
    rn = n0 + tl.arange(0, BN)
    nmask = rn < N
    blocks = K // 32
    total = tl.zeros([BN, BM], dtype=tl.float32)
    mine = SPLITS // PROGRAMS
    for s in range(pid_k * mine, pid_k * mine + mine):
        kb0 = s * BLOCKS_SPLIT
        kb_stop = tl.minimum(kb0 + BLOCKS_SPLIT, blocks)
        kb_stop = tl.where(lo < end, kb_stop, kb0)  # an empty tile loops zero times
        total += _blocks_sum(
            a_ptr,
            sa_ptr,
            w_desc,
            e,
            n0,
            sw_ptr,
            src,
            live,
            rn,
            nmask,
            K,
            A_STRIDE,
            kb0,
            kb_stop,
            FP4,
            VALUES,
            BM,
            BN,
            G,
            ASM,
            GROUPED,
        )
    omask = live[None, :] & nmask[:, None]
    if PROGRAMS == 1:
        _store_out(total, out_ptr, rm, rn, live, omask, N, add_ptr, by_id_ptr, TOP_K, ADD)
    else:
        # each split's sum to memory; the last to arrive adds them in split order
        parts = part_ptr + rm[None, :].to(tl.int64) * N + rn[:, None]
        tl.store(parts + pid_k.to(tl.int64) * M * N, total, mask=omask)
        tl.debug_barrier()
        tile = pid_m * tl.num_programs(1) + pid_n
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == PROGRAMS - 1:
            total = tl.zeros([BN, BM], dtype=tl.float32)
            # four partials loaded at once, then added in split order: one partial at a time
            # held the reduction to a round trip to L2 per split (a split past the last adds
            # +0.0, which leaves a sum that starts at +0.0 as it is)
            for p in range(0, PROGRAMS, 4):
                p0 = _partial(parts, p, PROGRAMS, M * N, omask)
                p1 = _partial(parts, p + 1, PROGRAMS, M * N, omask)
                p2 = _partial(parts, p + 2, PROGRAMS, M * N, omask)
                p3 = _partial(parts, p + 3, PROGRAMS, M * N, omask)
                total = (((total + p0) + p1) + p2) + p3
            _store_out(total, out_ptr, rm, rn, live, omask, N, add_ptr, by_id_ptr, TOP_K, ADD)
            tl.atomic_xchg(count_ptr + tile, 0)


# launch settings by weight shape, (features a program, blocks an iteration, warps, stages,
# splits), written by ``python -m benchmarks.linear_sweep --write`` (each with the GPU that
# picked it); other shapes take ``_default``
TUNED_FILE = Path(__file__).with_name("stored_linear_tuned.json")


Config = tuple[int, int, int, int, int]


def _tuned() -> dict[tuple[bool, int, int], Config]:
    if not TUNED_FILE.exists():
        return {}
    raw = json.loads(TUNED_FILE.read_text())
    return {(e["fp4"], e["n"], e["k"]): tuple(e["config"][:5]) for e in raw["shapes"]}


TUNED = _tuned()


def _default(fp4: bool, n: int, k: int, programs: int) -> Config:
    """Split K until ``programs`` feature tiles (times the expert tiles a launch expects) fill
    every multiprocessor twice; never less than four blocks a split."""
    bn = 64 if fp4 else 128
    tiles = triton.cdiv(n, bn) * programs
    blocks = k // 32
    splits = max(1, min(blocks // 4, triton.cdiv(2 * SMS, tiles), 16))
    return bn, 2, 4, 3, splits


def settings(fp4: bool, n: int, k: int, programs: int = 1) -> Config:
    """(BN, G, warps, stages, splits) for a weight's shape: never the row count."""
    return TUNED.get((fp4, n, k)) or _default(fp4, n, k, programs)


def _launch(
    q: Codes,
    weight: torch.Tensor,
    scale: torch.Tensor,
    fp4: bool,
    rows_out: int,
    config: Config,
    rows: torch.Tensor | None = None,
    tiles: torch.Tensor | None = None,
    bm: int | None = None,
    top_k: int = 1,
    out: torch.Tensor | None = None,
    added: Added | None = None,
    groups: int = 1,
) -> torch.Tensor:
    """``tiles`` (grouped) come with their row count ``bm``; else the rows pick it. ``q``
    without codes: its bf16 values meet the weight (FP8 too); ``groups``: the weight's features
    in that many groups, each over its own slice of an activation row (values only)."""
    values = fp4 or q.codes is None
    a, sa, dtype = (q.values if values else q.codes), q.scale, q.dtype
    if values and a is None:
        raise ValueError("FP4 weights meet the activation's bf16 values: quantize(x, values=True)")
    if groups > 1 and not values:
        raise ValueError("grouped features read the activation's values, not codes")
    k = a.shape[-1] // groups
    n = weight.shape[-2]
    bn, g, warps, stages, splits = config
    if g not in ((2, 4) if fp4 else (1, 2, 4)):
        raise ValueError(f"{'FP4' if fp4 else 'FP8'} blocks a step: G of {g} not taken")
    while groups > 1 and (n // groups) % bn:  # a feature tile within one group (>= 32 wide)
        bn //= 2
    if bn < 16:  # the interpreter runs narrower tiles; the GPU faults on their TMA copies
        raise ValueError(f"a feature tile of {bn} is under the tensor cores' 16")
    if tiles is None:
        bm = BM if rows_out <= LARGE_ROWS else BM_LARGE
        grid_m = triton.cdiv(rows_out, bm)
    else:  # the rows' tiles come first: at most one partial tile an expert the rows touch
        grid_m = min(len(tiles), triton.cdiv(rows_out, bm) + min(rows_out, len(weight)))
    blocks = k // 32
    per = triton.cdiv(triton.cdiv(blocks, splits), g) * g
    splits = triton.cdiv(blocks, per)
    if out is None:
        out = torch.empty(rows_out, n, dtype=dtype, device=a.device)
    elif out.shape != (rows_out, n) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{rows_out}, {n}], got {list(out.shape)}")
    if added is not None:
        top_k = added.by_id.shape[1]
        if added.by_id.shape[0] != rows_out or added.rows.shape[1] != n:
            raise ValueError(
                f"added rows for [{rows_out}, {n}], got {list(added.rows.shape)} by "
                f"{list(added.by_id.shape)}"
            )
    if rows_out == 0:
        return out
    # a program a split while the tiles alone leave multiprocessors idle
    programs = splits if grid_m * triton.cdiv(n, bn) < SPREAD_BELOW else 1
    grid = (grid_m, triton.cdiv(n, bn), programs)
    if programs > 1 and grid[0] * grid[1] > MAX_TILES:
        raise ValueError(f"{grid[0] * grid[1]} tiles exceed the {MAX_TILES} counters")
    part = (
        torch.empty(splits, rows_out, n, dtype=torch.float32, device=a.device)
        if programs > 1
        else out
    )
    sa = a if sa is None else sa  # (values: no scales to read)
    _stored_linear_kernel[grid](
        a,
        sa,
        _weight_tiles(weight, bn),
        scale.view(torch.uint8),
        out,
        part,
        arrival_counters(a.device),
        rows if rows is not None else sa,
        tiles if tiles is not None else sa,
        added.rows.contiguous() if added is not None else sa,
        added.by_id.contiguous() if added is not None else sa,
        rows_out,
        len(a),
        n,
        k,
        a.stride(0),
        n // groups,
        per,
        scale[0].numel() if tiles is not None else 0,
        splits,
        programs,
        top_k,
        FP4=fp4,
        VALUES=values,
        GROUPED=tiles is not None,
        GATHER=rows is not None,
        ADD=added is not None,
        BM=bm,
        BN=bn,
        G=g,
        ASM=not interpreted(),
        num_warps=warps,
        num_stages=stages,
    )
    return out


def _weight_tiles(weight: torch.Tensor, bn: int) -> TensorDescriptor:
    """The kernel's view of a weight's bytes: ``[bn, 32]`` tiles (``[1, bn, 32]`` of an
    expert's), copied by TMA."""
    w = weight.view(torch.uint8)
    if w.data_ptr() % 16:
        raise ValueError(
            f"a stored weight must start on 16 bytes (TMA reads it), got address {w.data_ptr()}"
        )
    return TensorDescriptor.from_tensor(w, [1, bn, 32] if w.dim() == 3 else [bn, 32])


class Added(NamedTuple):
    """Rows added to a linear's output rows, each row's sum in fp32 from zero: output row
    ``t``'s ``rows[by_id[t, 0]] + rows[by_id[t, 1]] + ...`` and then its own product rounded
    to ``rows``' dtype (the MoE's combine: the routed experts' outputs in ascending id, then
    the shared expert's)."""

    rows: torch.Tensor  # [P, N]
    by_id: torch.Tensor  # int64 [M, k]


class Codes(NamedTuple):
    """An activation through ``act_quant`` (E4M3 codes [R, K], fp32 scales [R, K / 32]), the
    dtype products of it come out in, and for FP4 weights its round trip's bf16 values [R, K]
    (exact): quantised once, read by every linear it feeds. Without codes: bf16 values as they
    are (``grouped_values_linear``)."""

    codes: torch.Tensor | None
    scale: torch.Tensor | None
    dtype: torch.dtype
    values: torch.Tensor | None = None


def quantize(x: torch.Tensor | Codes, values: bool = False) -> Codes:
    """``x`` [R, K] as the codes the kernel reads, with ``values`` for FP4 weights too (one
    launch); ``Codes`` as they are."""
    if isinstance(x, Codes):
        return x
    if x.shape[-1] % 32:
        raise ValueError(f"inputs must come in whole 32-wide scale blocks, got {x.shape[-1]}")
    codes, scale, vals = act_codes(x, values)
    return Codes(codes, scale, x.dtype, vals)


def stored_linear(
    x: torch.Tensor | Codes,
    weight: torch.Tensor,
    scale: torch.Tensor,
    fp4: bool,
    out: torch.Tensor | None = None,
    added: Added | None = None,
) -> torch.Tensor:
    """``x`` [M, K] through ``act_quant`` (or its ``Codes``) times the stored weight (``weight``
    E4M3 ``[N, K]`` with 32 x 32 scales, or I8 ``[N, K / 2]`` paired by ``quant.pair_fp4``
    (the checkpoint's order would give a wrong product) with a scale per 32; scales as E8M0
    bytes); out ``[M, N]`` in ``x``'s dtype. ``x`` may already be on ``act_quant``'s grid
    (a round trip of it is exact). ``out``: where the output goes (its dtype); ``added``:
    rows summed in before each output row (``Added``)."""
    q = quantize(x, fp4)
    n, k = weight.shape[0], q.codes.shape[-1]
    config = settings(fp4, n, k)
    return _launch(q, weight, scale, fp4, len(q.codes), config, out=out, added=added)


def grouped_values_linear(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, groups: int
) -> torch.Tensor:
    """``x`` [M, G, K] as it is (no ``act_quant``: bf16 values; fp32 in the interpreter) times
    an FP8 weight ``[G * N, K]`` with 32 x 32 scales, each group's slice of ``x`` through its
    ``N`` features: out ``[M, G, N]``, ``einsum('mgk,gnk->mgn')`` over the dequantised weight
    (V4.1's ``wo_a``, which the reference dequantises for it). The products are exact, so only
    the order of the fp32 sums differs from that einsum's, and it is fixed."""
    n, k = weight.shape
    if x.dim() != 3 or x.shape[1:] != (groups, k) or n % groups or (n // groups) % 32:
        raise ValueError(
            f"x [M, {groups}, {k}] and {groups} groups of whole 32-feature scale blocks, got x "
            f"{list(x.shape)} and a weight of {n} features"
        )
    if not interpreted() and x.dtype != torch.bfloat16:
        raise ValueError(f"the activation meets the weight in bf16 products, got {x.dtype}")
    m = len(x)
    x2 = x.reshape(m, groups * k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    q = Codes(None, None, x.dtype, x2)
    out = _launch(q, weight, scale, False, m, settings(False, n, k), groups=groups)
    return out.view(m, groups, n // groups)


def group_tiles(counts: torch.Tensor, rows: int, bm: int) -> torch.Tensor:
    """``[cdiv(rows, bm) + E, 3]`` int64 tiles (expert, lo, hi) over ``rows`` rows sorted by
    expert, ``counts[e]`` each: every expert's rows in ``bm``-row tiles, the rest empty
    (``E - 1, 0, 0``). Device ops of fixed shapes only (no host sync); the torch construction,
    which ``moe_routing.expert_rows`` builds bit for bit in its one launch on CUDA."""
    e = len(counts)
    ends = counts.cumsum(0)
    per = (counts + bm - 1) // bm
    tile_end = per.cumsum(0)
    i = torch.arange(triton.cdiv(rows, bm) + e, device=counts.device)
    ex = torch.searchsorted(tile_end, i, right=True).clamp_max(e - 1)
    lo = ends[ex] - counts[ex] + (i - (tile_end[ex] - per[ex])) * bm
    hi = torch.minimum(lo + bm, ends[ex])
    used = i < tile_end[-1]
    return torch.stack([ex, torch.where(used, lo, 0), torch.where(used, hi, 0)], 1).contiguous()


def group_tile_rows(rows: int, experts: int) -> int:
    """Rows a tile of ``grouped_stored_linear`` over ``rows`` rows of ``experts`` experts: 16,
    or 64 where an expert averages more (fewer reads of each weight tile); the tiles are built
    for it once a layer, before its launches."""
    return BM if rows <= BM * experts else BM_LARGE


def grouped_stored_linear(
    x: torch.Tensor | Codes,
    weight: torch.Tensor,
    scale: torch.Tensor,
    fp4: bool,
    tiles: torch.Tensor,
    rows: torch.Tensor | None = None,
    experts_hint: int = 8,
    top_k: int = 1,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows sorted by expert times their expert's stored weight (``weight`` [E, N, ...], FP4
    paired as ``stored_linear`` takes it, ``scale`` [E, ...]) in one launch. The rows are ``x``
    [P, K]'s (through ``act_quant``), or, given ``rows`` [P], ``x[rows // top_k]`` (the gather
    happens in the kernel: each token is quantised once; ``rows`` may be a step's sorted (token,
    expert) pairs, ``token * top_k + slot``). ``tiles``: the rows' (expert, lo, hi) tiles of
    ``group_tile_rows(P, E)`` rows (``group_tiles``, or on CUDA ``moe_routing.expert_rows``:
    built once, read by both of a layer's launches). Out ``[P, N]``. ``experts_hint``: the
    experts a launch is expected to touch (sets the split, never from the routing); ``out``:
    where the output goes."""
    q = quantize(x, fp4)
    p = len(rows) if rows is not None else len(q.codes)
    experts, n, k = weight.shape[0], weight.shape[-2], q.codes.shape[-1]
    bm = group_tile_rows(p, experts)
    if tiles.shape != (triton.cdiv(p, bm) + experts, 3):
        raise ValueError(
            f"tiles of {bm} rows for {p} rows and {experts} experts, got {list(tiles.shape)}"
        )
    config = settings(fp4, n, k, experts_hint)
    return _launch(q, weight, scale, fp4, p, config, rows, tiles, bm, top_k, out)
