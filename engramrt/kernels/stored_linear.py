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

import functools

import torch
import triton
import triton.language as tl

SMS = 132  # H200; only a split heuristic
BLOCK_K = 128


@triton.jit
def _fp4_values(packed, k, lut_ptr):
    """E2M1 codes (the byte's low nibble at even ``k``) as fp32, from a 16-entry table (one
    cached load a code instead of building the float from its bits)."""
    code = tl.where(k % 2 == 0, packed & 15, packed >> 4)
    return tl.load(lut_ptr + code)


@triton.jit
def _stored_linear_kernel(
    a_ptr, w_ptr, s_ptr, lut_ptr, out_ptr, M, N, K, K_SPLIT,
    FP4: tl.constexpr, IEEE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    row = tl.zeros([BN], dtype=tl.float32)  # BM == 1: a GEMV, fp32 FMAs, no 16-row dot
    k_start = split * K_SPLIT
    for k0 in range(k_start, tl.minimum(k_start + K_SPLIT, K), BK):
        rk = k0 + tl.arange(0, BK)
        a = tl.load(a_ptr + rm[:, None].to(tl.int64) * K + rk[None, :],
                    mask=(rm[:, None] < M) & (rk[None, :] < K), other=0.0)  # fmt: skip
        wmask = (rn[:, None] < N) & (rk[None, :] < K)
        if FP4:
            byte = tl.load(w_ptr + rn[:, None].to(tl.int64) * (K // 2) + rk[None, :] // 2,
                           mask=wmask, other=0).to(tl.int32) & 0xFF  # fmt: skip
            sb = tl.load(s_ptr + rn[:, None].to(tl.int64) * (K // 32) + rk[None, :] // 32,
                         mask=wmask, other=127).to(tl.int32)  # fmt: skip
            w = _fp4_values(byte, rk[None, :], lut_ptr)
        else:
            byte = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + rk[None, :], mask=wmask,
                           other=0)  # fmt: skip
            sb = tl.load(s_ptr + (rn[:, None] // 32) * tl.cdiv(K, 32) + rk[None, :] // 32,
                         mask=wmask, other=127).to(tl.int32)  # fmt: skip
            w = byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        w = w * (sb << 23).to(tl.float32, bitcast=True)  # E8M0: the exponent field, exact
        if BM == 1:
            row += tl.sum(w * a.to(tl.float32), axis=1)
        elif IEEE:
            acc += tl.dot(a, tl.trans(w.to(a.dtype)), input_precision="ieee")
        else:
            acc += tl.dot(a, tl.trans(w.to(a.dtype)))
    if BM == 1:
        acc = row[None, :]
    out = out_ptr + split.to(tl.int64) * M * N + rm[:, None].to(tl.int64) * N + rn[None, :]
    tl.store(out, acc, mask=(rm[:, None] < M) & (rn[None, :] < N))


@functools.cache
def _lut(device: torch.device) -> torch.Tensor:
    """The 16 E2M1 values, by code (bit 3 the sign), on ``device``."""
    mags = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    return torch.tensor([*mags, *(-m for m in mags)], device=device)


def stored_linear(a: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                  fp4: bool) -> torch.Tensor:  # fmt: skip
    """``a`` [M, K] (already through ``act_quant``, bf16 or fp32) times the stored weight
    (``weight`` E4M3 ``[N, K]`` with 32 x 32 scales, or I8 ``[N, K / 2]`` with a scale per 32;
    scales as E8M0 bytes); out ``[M, N]`` in ``a``'s dtype."""
    m, k = a.shape
    n = weight.shape[0]
    a = a.contiguous()
    bm, bn = (1, 64) if m == 1 else (16, 64) if m <= 16 else (64, 64)
    tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    steps = triton.cdiv(k, BLOCK_K)
    splits = max(1, min(steps, 2 * SMS // tiles)) if m <= 16 else 1
    per = triton.cdiv(steps, splits) * BLOCK_K
    splits = triton.cdiv(k, per)
    part = torch.empty(splits, m, n, dtype=torch.float32, device=a.device)
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), splits)
    _stored_linear_kernel[grid](
        a, weight.view(torch.uint8), scale.view(torch.uint8), _lut(a.device), part, m, n, k, per,
        FP4=fp4, IEEE=a.dtype == torch.float32, BM=bm, BN=bn, BK=BLOCK_K,
    )  # fmt: skip
    return (part[0] if splits == 1 else part.sum(0)).to(a.dtype)
