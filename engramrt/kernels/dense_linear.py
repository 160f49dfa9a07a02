"""A dense product ``x @ w.T`` (bf16 or fp32 weights, fp32 sums) whose every row's bits are the
same whatever the other rows of its step: the launch settings depend on the weight's shape
alone, K is summed in one fixed order (no split), and rows are the tensor cores' narrow side:
weights fill the wide one (64 features, Hopper's wgmma M) whatever the row tile, since a
16-row tile on the wide side would take another instruction (mma.sync), which rounds its sums
otherwise.
cuBLAS picks its algorithm (and its summation order) by the row count, so a request decoded
alone and the same request among 63 others, or a verify run beside its drafts, part after a few
tokens; ``--batch-invariant`` routes the model's dense products here instead (``kernels.linear``).

fp32 weights multiply in fp32 (``ieee``: FMAs, as cuBLAS does without TF32), bf16 ones on the
tensor cores with fp32 accumulation. ``w`` may be a stack of weights [G, N, K], each applied to
its own slice of ``x`` [M, G, K] (V4.1's grouped output projection).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engramrt.kernels.common import dot_f32, interpreted

BN, BK = 64, 64
BM, BM_LARGE, LARGE_ROWS = 16, 64, 64  # a row's operations are the same in either tile


@triton.jit(do_not_specialize=["M"])
def _dense_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    M,
    N,
    K,
    SXM,
    SXG,
    SWG,
    SYM,
    SYG,
    F32: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
):
    pid_m, pid_n, grp = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    xs = x_ptr + grp * SXG + rm[:, None].to(tl.int64) * SXM
    ws = w_ptr + grp * SWG + rn[:, None].to(tl.int64) * K
    acc = tl.zeros([BN, BM], dtype=tl.float32)
    for k0 in range(0, K, BK):
        kk = k0 + rk
        a = tl.load(xs + kk[None, :], mask=(rm[:, None] < M) & (kk[None, :] < K), other=0.0)
        w = tl.load(ws + kk[None, :], mask=(rn[:, None] < N) & (kk[None, :] < K), other=0.0)
        acc += dot_f32(w, tl.trans(a.to(w.dtype)), F32)
    ys = y_ptr + grp * SYG + rm[None, :].to(tl.int64) * SYM + rn[:, None]
    tl.store(ys, acc.to(y_ptr.dtype.element_ty), mask=(rm[None, :] < M) & (rn[:, None] < N))


def dense_linear(
    x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype | None = None
) -> torch.Tensor:
    """``x [..., K] @ w [N, K].T`` -> ``[..., N]``, or with ``w`` [G, N, K]: ``x [..., G, K]``
    -> ``[..., G, N]`` (each group through its own weight); out in ``out_dtype`` (default
    ``x``'s)."""
    groups = 1 if w.dim() == 2 else w.shape[0]
    n, k = w.shape[-2:]
    if w.dim() not in (2, 3) or x.shape[-1] != k or (groups > 1 and x.shape[-2] != groups):
        raise ValueError(f"dense_linear: x {tuple(x.shape)} does not fit w {tuple(w.shape)}")
    lead = x.shape[: -1 if w.dim() == 2 else -2]
    x2 = x.reshape(-1, groups, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = len(x2)
    y = torch.empty(m, groups, n, dtype=out_dtype or x.dtype, device=x.device)
    if m:
        w = w.contiguous()
        bm = BM if m <= LARGE_ROWS else BM_LARGE
        grid = (triton.cdiv(m, bm), triton.cdiv(n, BN), groups)
        _dense_kernel[grid](
            x2,
            w,
            y,
            m,
            n,
            k,
            x2.stride(0),
            x2.stride(1),
            n * k,
            groups * n,
            n,
            F32=w.dtype == torch.float32 or interpreted(),
            BM=bm,
            BN=BN,
            BK=BK,
        )
    return y.view(*lead, n) if w.dim() == 2 else y.view(*lead, groups, n)
