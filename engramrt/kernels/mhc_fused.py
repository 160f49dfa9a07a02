"""The mHC glue around one sublayer in three launches: two before it, one after.

In torch, one sublayer's glue is dozens of small fp32 kernels (the mixes matmul, the rsqrt, the
split, a collapse loop, the RMSNorm, a bmm and FMAs for the expand); at decode sizes each reads
a few KiB and the step is launch-bound. Here:

- ``_mixes_collapse_kernel``, two kinds of program in one launch, since neither needs the
  other's result. Mixes programs, one per (block of BT tokens, chunk of the flattened ``hc * D``
  stream): read the chunk once and write, per token, the partial dot products with the
  ``(2 + hc) * hc`` rows of ``fn`` and the partial sum of squares, as plain fp32 FMAs (Triton's
  fp32 ``tl.dot`` was 3-4x slower here, and a tensor-core dot would not be fp32). The chunk count
  depends on ``T`` alone (many at decode sizes, to spread the read of ``fn`` over the GPU, few
  at prefill sizes), never on data; no atomics, so results are deterministic. Collapse programs,
  one per token: collapse the stream with the *lagged* pre, round to the stream dtype,
  RMS-normalise the rounded row. Without mixes programs it is the final collapse + norm.
- ``_split_kernel``, one program (one warp) per token: adds the partials in a fixed order,
  applies the per-token rsqrt and runs the Sinkhorn split (``mhc_sinkhorn.split_tile``, the same
  code as the stand-alone split).
- ``_post_kernel``, grid ``(T, cdiv(D, BLOCK_D))``: ``out_k = post_k * y + sum_j comb[j][k] *
  residual_j`` in fp32, rounded once.

Same formulas and order of operations as the torch reference in ``engramrt.model.mhc``; reduction
trees differ, so the results match it to fp32 rounding (and a rounded output to an ulp), not
bitwise.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from engramrt.kernels import NORM_VALUES, batch_invariant
from engramrt.kernels.mhc_sinkhorn import split_tile
from engramrt.kernels.quant_roundtrip import store_act_codes

TARGET_PROGRAMS = 512  # mixes programs to aim for: a few per SM of a large GPU
MAX_SPLITS = 64  # chunks per token at most: the split kernel adds them one program per token
MAX_BLOCK_D = 8192  # a collapsed row up to this long stays in registers (else: a second pass)
SPLIT_BLOCK = 8  # partials added per step of the split kernel
SPLIT_WARPS = 1


class MixesPlan(NamedTuple):
    block_t: int  # tokens per mixes program
    block_k: int  # stream elements per step
    splits: int  # chunks of the stream
    chunk: int  # elements per chunk, a multiple of block_k
    warps: int  # of the first launch


@triton.jit
def _mixes_part(
    x_ptr,
    fn_ptr,
    part_ptr,
    pid,
    num_tokens,
    K,
    CHUNK,
    SPLITS,
    MIX: tl.constexpr,
    P: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
):
    t = (pid // SPLITS) * BT + tl.arange(0, BT)
    s = pid % SPLITS
    tm = t < num_tokens
    p = tl.arange(0, P)
    pm = p < MIX
    x_rows = x_ptr + t.to(tl.int64)[:, None] * K
    acc = tl.zeros((BT, P, BK), dtype=tl.float32)
    sq = tl.zeros((BT, BK), dtype=tl.float32)
    for k0 in range(s * CHUNK, tl.minimum(s * CHUNK + CHUNK, K), BK):
        k = k0 + tl.arange(0, BK)
        km = k < K
        xv = tl.load(x_rows + k[None, :], mask=tm[:, None] & km[None, :], other=0).to(tl.float32)
        f = tl.load(fn_ptr + p[:, None] * K + k[None, :], mask=pm[:, None] & km[None, :], other=0)
        acc += xv[:, None, :] * f[None, :, :]
        sq += xv * xv
    # column MIX (zero in acc: fn has no such row) carries the sum of squares
    out = tl.where(p[None, :] == MIX, tl.sum(sq, axis=1)[:, None], tl.sum(acc, axis=2))
    dst = (t.to(tl.int64)[:, None] * SPLITS + s) * P + p[None, :]
    tl.store(part_ptr + dst, out, mask=tm[:, None])


@triton.jit
def _collapse(x_row, w_ptr, d, m, D, HC: tl.constexpr, dtype: tl.constexpr):
    """Columns ``d`` of one row: Σ_j w_j x_j in fp32 in copy order, rounded once to ``dtype``."""
    acc = tl.load(w_ptr) * tl.load(x_row + d, mask=m, other=0).to(tl.float32)
    for j in tl.static_range(1, HC):
        acc = acc + tl.load(w_ptr + j) * tl.load(x_row + j * D + d, mask=m, other=0).to(tl.float32)
    return acc.to(dtype)


# what the linears after a sublayer's norm read, made with the row (``QUANT``): its act_quant
# codes and scales (FP8 weights), and with ``NORM_VALUES`` the round trip's bf16 values (FP4
# weights) and the row in fp32 (a router's input)
_VALUES = tl.constexpr(NORM_VALUES)  # (a kernel reads only constexpr globals)


class NormInputs(NamedTuple):
    codes: torch.Tensor  # E4M3 [T, D]
    scale: torch.Tensor  # fp32 [T, D / 32]
    values: torch.Tensor | None  # bf16 [T, D] (``NORM_VALUES``)
    wide: torch.Tensor | None  # fp32 [T, D] (``NORM_VALUES``)


@triton.jit
def _store_inputs(y, t, D, codes_ptr, scale_ptr, values_ptr, wide_ptr, QUANT: tl.constexpr,
                  BLOCK_D: tl.constexpr):  # fmt: skip
    """Row ``t``'s ``y`` [BLOCK_D] fp32 (zeros past ``D``) as ``quant_roundtrip.act_codes``
    makes it from the rounded row, bit for bit (and ``y`` itself in fp32)."""
    blk = tl.arange(0, BLOCK_D // 32)
    g = tl.reshape(y, [BLOCK_D // 32, 32])
    at, live = t * (D // 32) + blk, blk < D // 32
    store_act_codes(g, at, live, codes_ptr, scale_ptr, values_ptr, QUANT >= _VALUES)
    if QUANT >= _VALUES:
        d = tl.arange(0, BLOCK_D)
        tl.store(wide_ptr + t * D + d, y, mask=d < D)


@triton.jit
def _collapse_norm(
    x_ptr,
    prev_ptr,
    w_ptr,
    coll_ptr,
    out_ptr,
    t,
    D,
    norm_eps,
    HC: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINGLE: tl.constexpr,
    STORE_C: tl.constexpr,
    codes_ptr,
    scale_ptr,
    values_ptr,
    wide_ptr,
    QUANT: tl.constexpr,
):
    """Row ``t`` collapsed with its lagged pre, then RMSNorm of the rounded row. ``SINGLE``: the
    row fits one block and stays in registers; otherwise it goes to ``coll_ptr`` and is read
    back (``STORE_C`` is then set). ``QUANT`` (single rows): the rounded normed row's
    ``_store_inputs`` too."""
    x_row = x_ptr + t * HC * D
    c_row = coll_ptr + t * D
    o_row = out_ptr + t * D
    pre = prev_ptr + t * HC
    dtype = out_ptr.dtype.element_ty
    if SINGLE:
        d = tl.arange(0, BLOCK_D)
        m = d < D
        c = _collapse(x_row, pre, d, m, D, HC, dtype)
        if STORE_C:
            tl.store(c_row + d, c, mask=m)
        cf = c.to(tl.float32)
        rr = tl.rsqrt(tl.sum(cf * cf, axis=0) / D + norm_eps)
        w = tl.load(w_ptr + d, mask=m, other=0).to(tl.float32)
        y = (cf * rr * w).to(dtype)
        tl.store(o_row + d, y, mask=m)
        if QUANT > 0:
            ins = (codes_ptr, scale_ptr, values_ptr, wide_ptr)
            _store_inputs(y.to(tl.float32), t, D, *ins, QUANT, BLOCK_D)
    else:
        sq = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            d = d0 + tl.arange(0, BLOCK_D)
            m = d < D
            c = _collapse(x_row, pre, d, m, D, HC, dtype)
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
            tl.store(o_row + d, (c * rr * w).to(dtype), mask=m)


@triton.jit(do_not_specialize=["num_tokens", "CHUNK", "SPLITS", "MIX_PROGRAMS"])
def _mixes_collapse_kernel(
    x_ptr,
    fn_ptr,
    part_ptr,
    prev_ptr,
    w_ptr,
    coll_ptr,
    out_ptr,
    num_tokens,
    K,
    D,
    CHUNK,
    SPLITS,
    MIX_PROGRAMS,
    norm_eps,
    codes_ptr,
    scale_ptr,
    values_ptr,
    wide_ptr,
    HC: tl.constexpr,
    MIX: tl.constexpr,
    P: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SINGLE: tl.constexpr,
    STORE_C: tl.constexpr,
    QUANT: tl.constexpr,
):
    pid = tl.program_id(0)
    if pid < MIX_PROGRAMS:
        _mixes_part(x_ptr, fn_ptr, part_ptr, pid, num_tokens, K, CHUNK, SPLITS, MIX, P, BT, BK)
    else:
        t = (pid - MIX_PROGRAMS).to(tl.int64)
        _collapse_norm(
            x_ptr, prev_ptr, w_ptr, coll_ptr, out_ptr, t, D, norm_eps, HC, BLOCK_D, SINGLE,
            STORE_C, codes_ptr, scale_ptr, values_ptr, wide_ptr, QUANT,
        )  # fmt: skip


@triton.jit(do_not_specialize=["SPLITS"])
def _split_kernel(
    part_ptr,
    scale_ptr,
    base_ptr,
    pre_ptr,
    post_ptr,
    comb_ptr,
    SPLITS,
    K,
    iters,
    hc_eps,
    norm_eps,
    HC: tl.constexpr,
    P: tl.constexpr,
    SB: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, HC)
    off = j[:, None] * HC + j[None, :]
    sq = tl.zeros((SB,), dtype=tl.float32)
    zp = tl.zeros((SB, HC), dtype=tl.float32)
    zq = tl.zeros((SB, HC), dtype=tl.float32)
    zl = tl.zeros((SB, HC, HC), dtype=tl.float32)
    for s0 in range(0, SPLITS, SB):
        s = s0 + tl.arange(0, SB)
        sm = s < SPLITS
        row = part_ptr + (t * SPLITS + s) * P  # [SB]: this token's partials, split by split
        sq += tl.load(row + (2 + HC) * HC, mask=sm, other=0)
        zp += tl.load(row[:, None] + j[None, :], mask=sm[:, None], other=0)
        zq += tl.load(row[:, None] + HC + j[None, :], mask=sm[:, None], other=0)
        zl += tl.load(
            row[:, None, None] + 2 * HC + off[None, :, :], mask=sm[:, None, None], other=0
        )
    r = tl.rsqrt(tl.sum(sq, axis=0) / K + norm_eps)
    pre, post, comb = split_tile(
        (tl.sum(zp, axis=0) * r)[None, :],
        (tl.sum(zq, axis=0) * r)[None, :],
        (tl.sum(zl, axis=0) * r)[None, :, :],
        scale_ptr,
        base_ptr,
        iters,
        hc_eps,
        HC,
    )
    tl.store(pre_ptr + t * HC + j[None, :], pre)
    tl.store(post_ptr + t * HC + j[None, :], post)
    tl.store(comb_ptr + t * HC * HC + off[None, :, :], comb)


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
    # mixed_k = sum_j comb[j][k] * residual_j, j in order; then post_k * y + mixed_k. Every
    # multiply-add an explicit FMA: left to the compiler, whether a product fuses with its sum
    # differed between the BLOCK_D variants, so a token's bits followed its step's size
    mixed = tl.load(cb + k)[:, None] * tl.load(res + d, mask=m, other=0).to(tl.float32)[None, :]
    for j in tl.static_range(1, HC):
        rj = tl.load(res + j * D + d, mask=m, other=0).to(tl.float32)
        mixed = tl.fma(tl.load(cb + j * HC + k)[:, None], rj[None, :], mixed)
    y = tl.load(y_ptr + t * D + d, mask=m, other=0).to(tl.float32)
    out = tl.fma(tl.load(post_ptr + t * HC + k)[:, None], y[None, :], mixed)
    dst = res_ptr.dtype.element_ty
    tl.store(out_ptr + t * HC * D + k[:, None] * D + d[None, :], out.to(dst), mask=m[None, :])


# a token count in each bucket of mixes_plan's and post_block_d's compile-time tiles: the steps
# StageRunner.warm_up runs, so that serving compiles no variant of these kernels
WARM_UP_TOKENS = (2, 3, 17, 33, 129)


def mixes_plan(tokens: int, k: int, fixed: bool = False) -> MixesPlan:
    """Tiles of the mixes programs for ``tokens`` tokens of a ``k``-element stream: a function of
    the token count alone, so a decode graph captures one plan per batch size. Each program's
    accumulator is block_t x 32 x block_k fp32. Few tokens: one per program and many chunks,
    to spread the read of ``fn`` over the GPU; more tokens: 16 per program, since every token
    block re-reads ``fn`` (from L2). Chosen on an H200 at hidden 3072 (benchmarks/HISTORY.md).
    ``fixed`` (``--batch-invariant``): one plan for every count (a token's partial sums then run
    in the same order in any step), 16 tokens a program and the most chunks: at prefill sizes
    many more programs and partials than its own plan (8,192 tokens: 32,768 programs, 64 MiB
    of fp32 partials at Flash's widths), the flag's price there."""
    if fixed:
        block_t, block_k = 16, 16
    elif tokens <= 2:
        block_t, block_k = 1, 64
    elif tokens <= 32:
        block_t, block_k = 4, 32
    else:
        block_t, block_k = 16, 16
    blocks = 1 if fixed else triton.cdiv(tokens, block_t)
    want = max(1, min(triton.cdiv(TARGET_PROGRAMS, blocks), MAX_SPLITS, triton.cdiv(k, block_k)))
    chunk = triton.cdiv(triton.cdiv(k, want), block_k) * block_k
    return MixesPlan(block_t, block_k, triton.cdiv(k, chunk), chunk, 4 if block_t >= 16 else 8)


def post_block_d(tokens: int) -> int:
    """Columns per expand program: narrow at decode sizes, where programs are few (an H200 ran
    T = 1 in 1.2 us with 64 columns, 2.0 us with 256)."""
    return 64 if tokens <= 16 else 128 if tokens <= 128 else 256


def _first_launch(
    x: torch.Tensor,
    pre_prev: torch.Tensor,
    norm_weight: torch.Tensor,
    norm_eps: float,
    keep_collapsed: bool,
    fn: torch.Tensor | None,
    quant: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, NormInputs | None]:
    """(normed, collapsed or None, partials or None, the normed rows' ``NormInputs`` or None):
    the collapse programs always, the mixes programs when ``fn`` is given; ``quant``:
    ``NORM_CODES`` or ``NORM_VALUES`` (rows held whole in registers and whole scale blocks
    only, else None)."""
    x = x.contiguous()
    tokens, hc, dim = x.shape
    k = hc * dim
    normed = torch.empty(tokens, dim, dtype=x.dtype, device=x.device)
    collapsed = torch.empty_like(normed) if keep_collapsed else None
    block_d = min(MAX_BLOCK_D, triton.next_power_of_2(dim))
    single = dim <= block_d
    inputs = None
    if quant and single and dim % 32 == 0:
        wide = quant >= NORM_VALUES
        inputs = NormInputs(
            *(
                torch.empty(tokens, n, dtype=dt, device=x.device) if made else None
                for n, dt, made in (
                    (dim, torch.float8_e4m3fn, True),
                    (dim // 32, torch.float32, True),
                    (dim, torch.bfloat16, wide),
                    (dim, torch.float32, wide),
                )
            )
        )
    mix = (2 + hc) * hc
    p = triton.next_power_of_2(mix + 1)  # the mixes, then the sum of squares
    plan = mixes_plan(tokens, k, batch_invariant(x.device))
    if fn is None:
        part, mix_programs = None, 0
    else:
        mix_programs = triton.cdiv(tokens, plan.block_t) * plan.splits
        part = torch.empty(tokens, plan.splits, p, dtype=torch.float32, device=x.device)
    # the rounded row goes to memory when asked for, or to be read back when it is too long
    if collapsed is not None:
        c_buf = collapsed
    else:
        c_buf = normed if single else torch.empty_like(normed)  # normed: never written as c
    if tokens:
        _mixes_collapse_kernel[(mix_programs + tokens,)](
            x,
            normed if fn is None else fn.float().contiguous(),
            normed if part is None else part,
            pre_prev.float().contiguous(),
            norm_weight.contiguous(),
            c_buf,
            normed,
            tokens,
            k,
            dim,
            plan.chunk,
            plan.splits,
            mix_programs,
            norm_eps,
            *(normed if t is None else t for t in inputs or (None,) * 4),
            HC=hc,
            MIX=mix,
            P=p,
            BT=plan.block_t,
            BK=plan.block_k,
            BLOCK_D=block_d,
            SINGLE=single,
            STORE_C=collapsed is not None or not single,
            QUANT=0 if inputs is None else quant,
            num_warps=plan.warps,
        )
    return normed, collapsed, part, inputs


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
    quant: int = 0,
) -> tuple[
    torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, NormInputs | None
]:
    """``engramrt.model.mhc.mhc_pre`` for a power-of-two ``hc``, in two launches:
    (normed, pre, post, comb, collapsed or None, ``NormInputs`` or None: ``_first_launch``)."""
    normed, collapsed, part, inputs = _first_launch(
        x, pre_prev, norm_weight, norm_eps, keep_collapsed, fn, quant
    )
    tokens = x.shape[0]
    pre = torch.empty(tokens, hc, dtype=torch.float32, device=x.device)
    post = torch.empty_like(pre)
    comb = torch.empty(tokens, hc, hc, dtype=torch.float32, device=x.device)
    if tokens:
        _split_kernel[(tokens,)](
            part,
            scale.float().contiguous(),
            base.float().contiguous(),
            pre,
            post,
            comb,
            part.shape[1],
            hc * x.shape[2],
            iters,
            hc_eps,
            norm_eps,
            HC=hc,
            P=part.shape[2],
            SB=SPLIT_BLOCK,
            num_warps=SPLIT_WARPS,
        )
    return normed, pre, post, comb, collapsed, inputs


def collapse_norm(
    x: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float
) -> torch.Tensor:
    """``engramrt.model.mhc.collapse_norm`` in one launch (collapse programs only)."""
    return _first_launch(x, pre, norm_weight, norm_eps, False, None)[0]


def mhc_post(
    y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """``engramrt.model.mhc.hc_post`` in one launch."""
    residual = residual.contiguous()
    tokens, hc, dim = residual.shape
    out = torch.empty_like(residual)
    if tokens:
        block = post_block_d(tokens)
        _post_kernel[(tokens, triton.cdiv(dim, block))](
            y.contiguous(),
            residual,
            post.float().contiguous(),
            comb.float().contiguous(),
            out,
            dim,
            HC=hc,
            BLOCK_D=block,
        )
    return out
