"""The mHC glue around one sublayer in three launches: two before it, one after.

In torch, one sublayer's glue is dozens of small fp32 kernels (the mixes matmul, the rsqrt, the
split, a collapse loop, the RMSNorm, a bmm and FMAs for the expand); at decode sizes each reads
a few KiB and the step is launch-bound. Here:

- ``_mixes_kernel``, grid ``(cdiv(T, BLOCK_T), splits)``: program ``(b, s)`` reads its chunk of
  the flattened ``hc * D`` stream of ``BLOCK_T`` tokens once and writes, per token, the partial
  dot products with the ``(2 + hc) * hc`` rows of ``fn`` and the partial sum of squares. The
  split count depends on ``T`` alone (many chunks at decode sizes, to spread the read of ``fn``
  over the GPU; few at prefill sizes), never on data; no atomics, so results are deterministic.
- ``_finish_kernel``, one program per token: adds the partials in a fixed order, applies the
  per-token rsqrt, runs the Sinkhorn split (``mhc_sinkhorn.split_tile``, the same code as the
  stand-alone split), then collapses the stream with the *lagged* pre, rounds it to the stream
  dtype and RMS-normalises the rounded row. Without the mixes part it is the final collapse +
  norm before the LM head.
- ``_post_kernel``, grid ``(T, cdiv(D, BLOCK_D))``: ``out_k = post_k * y + sum_j comb[j][k] *
  residual_j`` in fp32, rounded once.

Same formulas and order of operations as the torch reference in ``engramrt.mhc``; reduction
trees differ, so the results match it to fp32 rounding (and a rounded output to an ulp), not
bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engramrt.kernels.mhc_sinkhorn import split_tile

BLOCK_T = 16  # tokens per mixes program: the smallest tl.dot tile
BLOCK_K = 64  # stream elements per mixes step
TARGET_PROGRAMS = 128  # mixes programs to aim for: about one per SM of a large GPU
MAX_BLOCK_D = 1024  # columns per step of the collapse loop
FINISH_WARPS = 4
POST_BLOCK_D = 256  # columns per expand program


@triton.jit
def _mixes_kernel(
    x_ptr, fn_ptr, part_ptr, num_tokens, K, CHUNK, SPLITS,
    MIX: tl.constexpr, P: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    s = tl.program_id(1)
    tm = t < num_tokens
    p = tl.arange(0, P)
    pm = p < MIX
    x_rows = x_ptr + t.to(tl.int64)[:, None] * K
    acc = tl.zeros((BT, P), dtype=tl.float32)
    sumsq = tl.zeros((BT,), dtype=tl.float32)
    for k0 in range(s * CHUNK, tl.minimum(s * CHUNK + CHUNK, K), BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        xv = tl.load(x_rows + k[None, :], mask=tm[:, None] & km[None, :], other=0).to(tl.float32)
        f = tl.load(fn_ptr + p[None, :] * K + k[:, None], mask=pm[None, :] & km[:, None], other=0)
        acc = tl.dot(xv, f, acc, input_precision="ieee")
        sumsq += tl.sum(xv * xv, axis=1)
    # column MIX (zero in acc: fn has no such row) carries the sum of squares
    out = tl.where(p[None, :] == MIX, sumsq[:, None], acc)
    dst = (t.to(tl.int64)[:, None] * SPLITS + s) * P + p[None, :]
    tl.store(part_ptr + dst, out, mask=tm[:, None])


@triton.jit
def _finish_kernel(
    part_ptr, scale_ptr, base_ptr, x_ptr, prev_ptr, w_ptr, coll_ptr, out_ptr,
    pre_ptr, post_ptr, comb_ptr, SPLITS, iters, hc_eps, norm_eps, D,
    HC: tl.constexpr, P: tl.constexpr, SB: tl.constexpr, BLOCK_D: tl.constexpr,
    MIXES: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, HC)
    if MIXES:
        s = tl.arange(0, SB)
        sm = s < SPLITS
        row = part_ptr + (t * SPLITS + s) * P  # [SB]: this token's partials, split by split
        off = j[:, None] * HC + j[None, :]
        sumsq = tl.sum(tl.load(row + (2 + HC) * HC, mask=sm, other=0), axis=0)
        r = tl.rsqrt(sumsq / (HC * D) + norm_eps)
        zp = tl.sum(tl.load(row[:, None] + j[None, :], mask=sm[:, None], other=0), axis=0) * r
        zq = tl.sum(tl.load(row[:, None] + HC + j[None, :], mask=sm[:, None], other=0), axis=0) * r
        zl = tl.load(row[:, None, None] + 2 * HC + off[None, :, :], mask=sm[:, None, None], other=0)
        zl = tl.sum(zl, axis=0) * r
        pre, post, comb = split_tile(
            zp[None, :], zq[None, :], zl[None, :, :], scale_ptr, base_ptr, iters, hc_eps, HC
        )
        tl.store(pre_ptr + t * HC + j[None, :], pre)
        tl.store(post_ptr + t * HC + j[None, :], post)
        tl.store(comb_ptr + t * HC * HC + off[None, :, :], comb)

    # collapse with the lagged pre: copy order, fp32, one rounding; then RMSNorm of that row
    x_row = x_ptr + t * HC * D
    c_row = coll_ptr + t * D
    w0 = tl.load(prev_ptr + t * HC)
    sq = tl.zeros((BLOCK_D,), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = d < D
        acc = w0 * tl.load(x_row + d, mask=m, other=0).to(tl.float32)
        for jj in tl.static_range(1, HC):
            xj = tl.load(x_row + jj * D + d, mask=m, other=0).to(tl.float32)
            acc = acc + tl.load(prev_ptr + t * HC + jj) * xj
        c = acc.to(coll_ptr.dtype.element_ty)
        tl.store(c_row + d, c, mask=m)
        cf = c.to(tl.float32)
        sq += cf * cf
    rr = tl.rsqrt(tl.sum(sq, axis=0) / D + norm_eps)
    tl.debug_barrier()  # the rounded row written above is read back by other threads
    for d0 in range(0, D, BLOCK_D):
        d = d0 + tl.arange(0, BLOCK_D)
        m = d < D
        c = tl.load(c_row + d, mask=m, other=0).to(tl.float32)
        w = tl.load(w_ptr + d, mask=m, other=0).to(tl.float32)
        tl.store(out_ptr + t * D + d, (c * rr * w).to(out_ptr.dtype.element_ty), mask=m)


@triton.jit
def _post_kernel(
    y_ptr, res_ptr, post_ptr, comb_ptr, out_ptr, D, HC: tl.constexpr, BLOCK_D: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    m = d < D
    k = tl.arange(0, HC)
    res = res_ptr + t * HC * D
    cb = comb_ptr + t * HC * HC
    # mixed_k = sum_j comb[j][k] * residual_j, j in order; then post_k * y + mixed_k
    mixed = tl.load(cb + k)[:, None] * tl.load(res + d, mask=m, other=0).to(tl.float32)[None, :]
    for j in tl.static_range(1, HC):
        rj = tl.load(res + j * D + d, mask=m, other=0).to(tl.float32)
        mixed = mixed + tl.load(cb + j * HC + k)[:, None] * rj[None, :]
    y = tl.load(y_ptr + t * D + d, mask=m, other=0).to(tl.float32)
    out = tl.load(post_ptr + t * HC + k)[:, None] * y[None, :] + mixed
    dst = res_ptr.dtype.element_ty
    tl.store(out_ptr + t * HC * D + k[:, None] * D + d[None, :], out.to(dst), mask=m[None, :])


def mixes_splits(tokens: int, k: int) -> tuple[int, int]:
    """(splits, chunk): the flattened stream of ``k`` elements cut into ``splits`` chunks of
    ``chunk`` (a multiple of BLOCK_K) so that about TARGET_PROGRAMS programs run. A function of
    the token count alone: a decode graph captures one split per batch size."""
    blocks = triton.cdiv(tokens, BLOCK_T)
    want = max(1, min(triton.cdiv(TARGET_PROGRAMS, blocks), triton.cdiv(k, BLOCK_K)))
    chunk = triton.cdiv(triton.cdiv(k, want), BLOCK_K) * BLOCK_K
    return triton.cdiv(k, chunk), chunk


def _finish(
    x: torch.Tensor,
    pre_prev: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    keep_collapsed: bool,
    split: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, float] | None,
) -> tuple[torch.Tensor, torch.Tensor | None, tuple[torch.Tensor, ...]]:
    """Launch ``_finish_kernel``: (normed, collapsed or None, (pre, post, comb) or ()).
    ``split`` = (partials, scale, base, iters, hc_eps) adds the mixes and Sinkhorn part."""
    tokens, hc, dim = x.shape
    x = x.contiguous()
    normed = torch.empty(tokens, dim, dtype=x.dtype, device=x.device)
    collapsed = torch.empty_like(normed) if keep_collapsed else None
    if split is None:  # the mixes pointers are never read: MIXES is off
        part, scale, base, iters, hc_eps = normed, normed, normed, 0, 0.0
        outs: tuple[torch.Tensor, ...] = ()
        splits, p = 1, 1
    else:
        part, scale, base, iters, hc_eps = split
        outs = tuple(
            torch.empty(tokens, *shape, dtype=torch.float32, device=x.device)
            for shape in ((hc,), (hc,), (hc, hc))
        )
        splits, p = part.shape[1], part.shape[2]
    if tokens:
        _finish_kernel[(tokens,)](
            part, scale, base, x, pre_prev.float().contiguous(), norm_weight.contiguous(),
            normed if collapsed is None else collapsed, normed, *(outs or (normed,) * 3),
            splits, iters, hc_eps, norm_eps, dim, HC=hc, P=p, SB=triton.next_power_of_2(splits),
            BLOCK_D=min(MAX_BLOCK_D, triton.next_power_of_2(dim)), MIXES=split is not None,
            num_warps=FINISH_WARPS,
        )  # fmt: skip
    return normed, collapsed, outs


def mhc_pre(
    x: torch.Tensor,
    pre_prev: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_weight: torch.Tensor,
    hc: int,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    keep_collapsed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``engramrt.mhc.mhc_pre`` for a power-of-two ``hc``, in two launches:
    (normed, pre, post, comb, collapsed or None)."""
    x = x.contiguous()
    tokens = x.shape[0]
    k = hc * x.shape[2]
    mix = (2 + hc) * hc
    p = triton.next_power_of_2(mix + 1)  # the mixes, then the sum of squares
    splits, chunk = mixes_splits(tokens, k)
    part = torch.empty(tokens, splits, p, dtype=torch.float32, device=x.device)
    if tokens:
        _mixes_kernel[(triton.cdiv(tokens, BLOCK_T), splits)](
            x, fn.float().contiguous(), part, tokens, k, chunk, splits,
            MIX=mix, P=p, BT=BLOCK_T, BK=BLOCK_K,
        )  # fmt: skip
    split = (part, scale.float().contiguous(), base.float().contiguous(), iters, hc_eps)
    normed, collapsed, (pre, post, comb) = _finish(
        x, pre_prev, norm_weight, norm_eps, keep_collapsed, split
    )
    return normed, pre, post, comb, collapsed


def collapse_norm(
    x: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float
) -> torch.Tensor:
    """``engramrt.mhc.collapse_norm`` in one launch (the finish kernel without the mixes)."""
    return _finish(x, pre, norm_weight, norm_eps, False, None)[0]


def mhc_post(
    y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """``engramrt.mhc.hc_post`` in one launch."""
    residual = residual.contiguous()
    tokens, hc, dim = residual.shape
    out = torch.empty_like(residual)
    if tokens:
        block = min(POST_BLOCK_D, triton.next_power_of_2(dim))
        _post_kernel[(tokens, triton.cdiv(dim, block))](
            y.contiguous(), residual, post.float().contiguous(), comb.float().contiguous(), out,
            dim, HC=hc, BLOCK_D=block,
        )  # fmt: skip
    return out
