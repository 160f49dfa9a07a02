"""DeepSeek-V4.1's FP8 and FP4 linears reading their weights as the checkpoint stores them: no
dequantised copy of a weight is ever written.

``y[m, n] = sum_k a[m, k] w[n, k]`` where ``a`` is the activation after ``act_quant`` (E4M3 per
32 with a power-of-two scale: exact in bf16) and ``w`` the stored codes (E4M3 bytes, or E2M1
codes two a byte, the even element low) times their E8M0 scales (32 x 32 blocks, or one per 32
inputs), decoded in the kernel. Every product is exact and sums in fp32, so the result is the
torch path's (``quant.quantized_linear``) up to the order of the fp32 sums.

Decode-sized inputs (a few rows) split K across programs so that a GEMV fills the GPU; the
partial sums are added in a fixed order afterwards (no atomics: the same inputs give the same
bits).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SMS = 132  # H200; only a split heuristic
BLOCK_K = 128
BN = 64  # output features a program computes


@triton.jit
def _e2m1(code):
    """4-bit E2M1 codes as fp32, built from their bits: exponent ``e`` and mantissa ``m`` are
    ``m / 2`` at ``e = 0`` and ``(1 + m / 2) 2**(e-1)`` above, bit 3 the sign (no table: a
    gather per code was the first version's bottleneck)."""
    e, m = (code >> 1) & 3, code & 1
    bits = tl.where(e == 0, m * 0x3F000000, ((e + 126) << 23) | (m << 22))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0(raw):
    """E8M0 scale bytes as fp32 powers of two: the byte is the exponent field (exact)."""
    return ((raw.to(tl.int32) & 0xFF) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _spread(scale, BN: tl.constexpr, G: tl.constexpr, WIDTH: tl.constexpr):
    """Scales [BN, G] repeated over each group's columns: [BN, WIDTH] (a tile's scales loaded
    once each; a per-element gather costs the 16- and 64-row tiles 2-5x)."""
    return tl.reshape(tl.broadcast_to(scale[:, :, None], [BN, G, WIDTH // G]), [BN, WIDTH])


@triton.jit
def _dot_acc(acc, a, w, IEEE: tl.constexpr):
    """``acc + a @ w.T`` with ``w`` (exact values) in ``a``'s dtype."""
    if IEEE:
        acc += tl.dot(a, tl.trans(w.to(a.dtype)), input_precision="ieee")
    else:
        acc += tl.dot(a, tl.trans(w.to(a.dtype)))
    return acc


# the row count varies by step (and, in the eager per-expert loop, by routing): specialising
# on it compiled a variant while serving
@triton.jit(do_not_specialize=["M"])
def _stored_linear_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    tiles_ptr,
    M,
    N,
    K,
    K_SPLIT,
    W_STRIDE,
    S_STRIDE,
    FP4: tl.constexpr,
    IEEE: tl.constexpr,
    GROUPED: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    """``GROUPED``: program ``pid_m`` takes the rows ``[lo, hi)`` of ``tiles[pid_m]`` = (expert,
    lo, hi) against expert ``e``'s weight (``W_STRIDE`` / ``S_STRIDE`` apart); an empty tile
    loads nothing. FP4 bytes are read once each: even inputs against low nibbles, odd ones
    against high nibbles."""
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    if GROUPED:
        e = tl.load(tiles_ptr + 3 * pid_m).to(tl.int64)
        lo, hi = tl.load(tiles_ptr + 3 * pid_m + 1), tl.load(tiles_ptr + 3 * pid_m + 2)
        w_ptr += e * W_STRIDE
        s_ptr += e * S_STRIDE
        rm = lo + tl.arange(0, BM)
        end = hi
    else:
        lo, end = pid_m * BM, M
        rm = lo + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rn64 = rn[:, None].to(tl.int64)
    a_rows = a_ptr + rm[:, None].to(tl.int64) * K
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    row = tl.zeros([BN], dtype=tl.float32)  # BM == 1: a GEMV, fp32 FMAs, no 16-row dot
    k_start = split * K_SPLIT
    live = (tl.zeros([BN, 1], dtype=tl.int64) + lo) < end  # an empty tile reads no weights
    nmask = (rn[:, None] < N) & live
    G: tl.constexpr = BK // 32  # scale groups a step
    k_stop = tl.minimum(k_start + K_SPLIT, K)
    if BM == 1:  # an empty grouped tile loops zero times (masked loops cost bs 1 ~3.5 ms a step)
        k_stop = tl.where(lo < end, k_stop, k_start)
    for k0 in range(k_start, k_stop, BK):
        kg = k0 // 32 + tl.arange(0, G)
        if FP4:
            kp = k0 // 2 + tl.arange(0, BK // 2)  # byte columns; inputs 2 kp and 2 kp + 1
            pm = nmask & (kp[None, :] < K // 2)
            byte = tl.load(w_ptr + rn64 * (K // 2) + kp[None, :], mask=pm, other=0)
            byte = byte.to(tl.int32) & 0xFF
            if BM == 1:  # the GEMV: each scale gathered per element (the faster form here)
                sc = _e8m0(
                    tl.load(s_ptr + rn64 * (K // 32) + kp[None, :] // 16, mask=pm, other=127)
                )
            else:
                sc = _spread(
                    _e8m0(
                        tl.load(
                            s_ptr + rn64 * (K // 32) + kg[None, :],
                            mask=nmask & (kg[None, :] < K // 32),
                            other=127,
                        )
                    ),
                    BN,
                    G,
                    BK // 2,
                )
            w_even, w_odd = _e2m1(byte & 15) * sc, _e2m1(byte >> 4) * sc
            am = (rm[:, None] < end) & (kp[None, :] < K // 2)
            a_even = tl.load(a_rows + 2 * kp[None, :], mask=am, other=0.0)
            a_odd = tl.load(a_rows + 2 * kp[None, :] + 1, mask=am, other=0.0)
            if BM == 1:
                row += tl.sum(w_even * a_even.to(tl.float32) + w_odd * a_odd.to(tl.float32), 1)
            else:
                acc = _dot_acc(acc, a_even, w_even, IEEE)
                acc = _dot_acc(acc, a_odd, w_odd, IEEE)
        else:
            rk = k0 + tl.arange(0, BK)
            wm = nmask & (rk[None, :] < K)
            byte = tl.load(w_ptr + rn64 * K + rk[None, :], mask=wm, other=0)
            srow = s_ptr + (rn64 // 32) * tl.cdiv(K, 32)
            if BM == 1:
                sc = _e8m0(tl.load(srow + rk[None, :] // 32, mask=wm, other=127))
            else:
                sc = _spread(
                    _e8m0(
                        tl.load(
                            srow + kg[None, :],
                            mask=nmask & (kg[None, :] < tl.cdiv(K, 32)),
                            other=127,
                        )
                    ),
                    BN,
                    G,
                    BK,
                )
            w = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32) * sc
            a = tl.load(
                a_rows + rk[None, :], mask=(rm[:, None] < end) & (rk[None, :] < K), other=0.0
            )
            if BM == 1:
                row += tl.sum(w * a.to(tl.float32), axis=1)
            else:
                acc = _dot_acc(acc, a, w, IEEE)
    if BM == 1:
        acc = row[None, :]
    out = out_ptr + split.to(tl.int64) * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out, acc, mask=(rm[:, None] < end) & (rn[None, :] < N))


def _launch(
    a, weight, scale, fp4, grid_m, bm, splits, tiles, bn=BN, bk=BLOCK_K, warps=4
) -> torch.Tensor:
    m, k = a.shape
    if k % 32:
        raise ValueError(f"inputs must come in whole 32-wide scale blocks, got {k}")
    n = weight.shape[-2]
    steps = triton.cdiv(k, bk)
    per = triton.cdiv(steps, splits) * bk
    splits = triton.cdiv(k, per)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(n, bn), grid_m, splits)
    grouped = tiles is not None
    _stored_linear_kernel[grid](
        a,
        weight.view(torch.uint8),
        scale.view(torch.uint8),
        part,
        tiles if grouped else a,
        m,
        n,
        k,
        per,
        weight[0].numel() if grouped else 0,
        scale[0].numel() if grouped else 0,
        FP4=fp4,
        IEEE=a.dtype == torch.float32,
        GROUPED=grouped,
        BM=bm,
        BN=bn,
        BK=bk,
        num_warps=warps,
    )
    return (part[0] if splits == 1 else part.sum(0)).to(a.dtype)


def _settings(rows: int, fp4: bool) -> tuple[int, int, int]:
    """(rows a tile, output features a program, warps) for ``rows`` rows a weight, from a
    sweep of launch settings on an H200 (benchmarks/HISTORY.md, 2026-12-01): an FP8 GEMV reads
    128 features a program with 8 warps (half the time of 64 with 4), an FP4 one 64 with 4; FP4
    tiles stop at 16 rows (64-row tiles decode every weight for rows an expert mostly lacks: 2x
    slower)."""
    if rows == 1:
        return (1, 64, 4) if fp4 else (1, 128, 8)
    return (16, BN, 4) if rows <= 16 or fp4 else (64, BN, 4)


def stored_linear(
    a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fp4: bool
) -> torch.Tensor:
    """``a`` [M, K] (already through ``act_quant``, bf16 or fp32) times the stored weight
    (``weight`` E4M3 ``[N, K]`` with 32 x 32 scales, or I8 ``[N, K / 2]`` with a scale per 32;
    scales as E8M0 bytes); out ``[M, N]`` in ``a``'s dtype."""
    m, k = a.shape
    n = weight.shape[0]
    a = a.contiguous()
    bm, bn, warps = _settings(m, fp4)
    tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    splits = max(1, min(triton.cdiv(k, BLOCK_K), 2 * SMS // tiles)) if m <= 16 else 1
    return _launch(a, weight, scale, fp4, triton.cdiv(m, bm), bm, splits, None, bn, warps=warps)


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


def group_tile_rows(rows: int, experts: int, fp4: bool) -> int:
    """Rows a tile of ``grouped_stored_linear`` over ``rows`` rows of ``experts`` experts: by the
    rows an expert averages (``_settings``); the tiles are built for it before the launches."""
    return _settings(-(-rows // experts), fp4)[0]


def grouped_stored_linear(
    a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fp4: bool, tiles: torch.Tensor
) -> torch.Tensor:
    """Rows of ``a`` [R, K] sorted by expert times their expert's stored weight (``weight``
    [E, N, ...], ``scale`` [E, ...]): one launch for every expert (a mixture-of-experts
    layer's). ``tiles``: the rows' (expert, lo, hi) tiles of ``group_tile_rows(R, E, fp4)`` rows
    (``group_tiles``, or on CUDA ``moe_routing.expert_rows``: built once, read by both of a
    layer's launches). Out ``[R, N]``."""
    rows, experts = len(a), weight.shape[0]
    bm, bn, warps = _settings(-(-rows // experts), fp4)
    if tiles.shape != (triton.cdiv(rows, bm) + experts, 3):
        raise ValueError(
            f"tiles of {bm} rows for {rows} rows and {experts} experts, got {tiles.shape}"
        )
    return _launch(a.contiguous(), weight, scale, fp4, len(tiles), bm, 1, tiles, bn, warps=warps)
