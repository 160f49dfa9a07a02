"""DeepSeek-V4.1's MoE routing on CUDA in two launches: the router after its logits (scores,
top-k, weights) and the rows the grouped expert kernel reads, with no sort and no host sync.
The torch path (``route_logits``, ``ExpertPairs``' sort, ``group_tiles`` once per grouped
launch) took 84 small launches a layer for the same values (an H200's profile at Flash's 384
experts, top-6: the router 16 launches, now 4 with the gate's cast and GEMV; the rows and tiles
73, now 1).

``route``: a program a token. Scores are ``sqrt(softplus(logits))`` as torch's CUDA kernels
compute them (``x > 20 ? x : log1p(exp(x))`` through libdevice's ``expf`` and ``log1pf``,
without flushing denormals, then a correctly rounded square root), so the scores, the chosen
experts and their order are torch's bits on a GPU. Each biased score becomes an int64 key that
orders as the float does (NaN above everything, as torch's sort compares them) with
``65535 - expert`` in its low bits: keys are distinct, the largest is the next pick, and equal
scores give the lower expert first, as the stable descending sort does. ``k`` passes of a max
over the row pick the experts in that order. The weights' sum is added in the order of torch's
CUDA reduction of a ``k``-wide row (the upper half folded onto the lower, repeatedly: the order
of torch's warp reduction since its shuffle offsets decrease) and divided with IEEE rounding, so
the weights are torch's bits too.

The gate's logits stay an fp32 ``F.linear`` before it: in the kernel each token would read the
whole gate (``E x dim`` fp32, 7.5 MiB for Flash) in one program, or the GEMV would be split over
programs and need a second pass; cuBLAS already reads it at full bandwidth in one launch.

``expert_rows``: a program an expert, each reading all ``T * k`` ids (a few KiB from L2). It
counts every expert's pairs (a histogram), so it knows its rows' offset; its pairs' ranks are
running counts over the flat pairs in order, which is the stable sort's order (each expert's
tokens ascending) without sorting. It writes its rows of ``order``, its entries of ``by_id``,
its count and its tiles, and a share of the empty tiles: every output element has one writer,
so the bits never depend on scheduling.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from engramrt.kernels.common import interpreted

MAX_EXPERTS = 1 << 16  # an expert id fits the low 16 bits of a key
MAX_K = 32  # torch sums a row of up to a warp's width as ``_torch_row_sum`` does
BLOCK = 1024  # pairs a step of ``expert_rows``
TILE_BLOCK = 64  # tiles a store of ``expert_rows``


@triton.jit
def sqrt_softplus(x, LIBDEVICE: tl.constexpr):
    """``sqrt(softplus(x))`` of fp32 ``x`` as torch computes it on CUDA (``F.softplus``, beta
    1, threshold 20). ``LIBDEVICE``: the CUDA math library's ``expf`` and ``log1pf`` (not
    ``tl.exp``, which is ``ex2.approx``); the interpreter has no libdevice, so there ``log1p``
    is ``log(u) * y / (u - 1)`` with ``u = 1 + y`` (accurate to a few ulps)."""
    if LIBDEVICE:
        soft = libdevice.log1p(libdevice.exp(x))
    else:
        y = tl.exp(tl.where(x > 20.0, 20.0, x))  # past 20 the result is x: no overflow
        u = 1.0 + y
        d = u - 1.0
        soft = tl.where(d == 0.0, y, tl.log(u) * tl.div_rn(y, tl.where(d == 0.0, 1.0, d)))
    return tl.sqrt_rn(tl.where(x > 20.0, x, soft))


@triton.jit
def _order_keys(v):
    """Signed int32 keys ordering as the fp32 values ``v`` do in torch's sort, where every NaN
    (of either sign) is above ``+inf``. (``-0.0`` would fall below ``+0.0``, but a biased score
    is never ``-0.0``: scores are ``+0.0`` or more.)"""
    bits = v.to(tl.int32, bitcast=True)
    key = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # negatives: magnitude order reversed
    return tl.where(v != v, 0x7FFFFFFF, key)


@triton.jit
def _torch_row_sum(w, KP: tl.constexpr):
    """The sum of ``w`` [KP] (zeros past ``k``) in the order torch's CUDA reduction adds a
    contiguous ``k``-wide row (``k <= 32``): ``W`` threads (the largest power of two up to
    ``k``), thread ``j`` adding slots ``j`` and ``j + W``, then warp shuffles at offsets
    ``W/2, W/4, ..., 1``. Both steps fold the upper half onto the lower: ``w[j] + w[j + KP/2]``
    until one value is left. Each ``tl.sum`` below adds two values (one rounding, either
    order)."""
    if KP >= 32:
        w = tl.sum(tl.reshape(w, [2, 16]), axis=0)
    if KP >= 16:
        w = tl.sum(tl.reshape(w, [2, 8]), axis=0)
    if KP >= 8:
        w = tl.sum(tl.reshape(w, [2, 4]), axis=0)
    if KP >= 4:
        w = tl.sum(tl.reshape(w, [2, 2]), axis=0)
    if KP >= 2:
        w = tl.sum(tl.reshape(w, [2, 1]), axis=0)
    return tl.sum(w, axis=0)


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    bias_vl_ptr,
    image_ptr,
    weights_ptr,
    ids_ptr,
    route_scale,
    E: tl.constexpr,
    K: tl.constexpr,
    BE: tl.constexpr,
    KP: tl.constexpr,
    IMAGE: tl.constexpr,
    LIBDEVICE: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BE)
    valid = e < E
    scores = sqrt_softplus(tl.load(logits_ptr + t * E + e, mask=valid, other=0.0), LIBDEVICE)
    bias = tl.load(bias_ptr + e, mask=valid, other=0.0)
    if IMAGE:
        image = tl.load(image_ptr + t).to(tl.int32)
        bias = tl.where(image != 0, tl.load(bias_vl_ptr + e, mask=valid, other=0.0), bias)
    key = _order_keys(scores + bias).to(tl.int64) * 65536 + (65535 - e)
    taken: tl.constexpr = -(1 << 62)  # below every key (keys are above -2**47)
    key = tl.where(valid, key, taken)
    slot = tl.arange(0, KP)
    w = tl.zeros([KP], tl.float32)
    ids = tl.zeros([KP], tl.int64)
    for j in tl.static_range(K):
        best = tl.max(key, axis=0)
        pick = 65535 - (best & 65535)
        w = tl.where(slot == j, tl.sum(tl.where(e == pick, scores, 0.0), axis=0), w)
        ids = tl.where(slot == j, pick, ids)
        key = tl.where(key == best, taken, key)
    if K > 1:
        w = tl.div_rn(w, tl.broadcast_to(_torch_row_sum(w, KP) + 1e-20, [KP]))
    tl.store(weights_ptr + t * K + slot, w * route_scale, mask=slot < K)
    tl.store(ids_ptr + t * K + slot, ids, mask=slot < K)


@functools.cache
def exact_options() -> dict:
    """Launch options that keep the GPU's arithmetic torch's: no contraction into FMAs, and
    libdevice without flushing denormals (torch's kernels keep them). An older Triton without
    an option gets its default (and the GPU test shows what that costs)."""
    if interpreted():
        return {}
    from triton.backends.nvidia.compiler import CUDAOptions

    wanted = {"enable_fp_fusion": False, "enable_reflect_ftz": False}
    return {k: v for k, v in wanted.items() if k in CUDAOptions.__dataclass_fields__}


def route(
    logits: torch.Tensor,
    bias: torch.Tensor,
    k: int,
    route_scale: float,
    bias_vl: torch.Tensor | None = None,
    image: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k]`` fp32, expert ids ``[T, k]`` int64) of fp32 gate logits ``[T, E]``:
    experts by score plus ``bias`` (``bias_vl`` for the tokens where ``image`` [T] is true,
    when both are given), best first, equal values to the lower id; weights the chosen raw
    scores, normalised (+1e-20) when ``k > 1``, times ``route_scale``."""
    tokens, experts = logits.shape
    if logits.dtype != torch.float32 or not 0 < k <= min(experts, MAX_K) or experts > MAX_EXPERTS:
        raise ValueError(
            f"fp32 logits, 0 < k <= min(E, {MAX_K}) and E <= {MAX_EXPERTS}, got "
            f"{logits.dtype}, k {k}, E {experts}"
        )
    weights = torch.empty(tokens, k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(tokens, k, dtype=torch.int64, device=logits.device)
    if tokens == 0:
        return weights, ids
    with_image = image is not None and bias_vl is not None
    _route_kernel[(tokens,)](
        logits.contiguous(),
        bias.float().contiguous(),
        bias_vl.float().contiguous() if with_image else bias,
        image.contiguous() if with_image else bias,
        weights,
        ids,
        route_scale,
        E=experts,
        K=k,
        BE=triton.next_power_of_2(experts),
        KP=triton.next_power_of_2(k),
        IMAGE=with_image,
        LIBDEVICE=not interpreted(),
        num_warps=1 if experts <= 512 else 4,  # the k max-reductions stay in a warp's shuffles
        **exact_options(),
    )
    return weights, ids


@dataclass
class ExpertRows:
    """The (token, expert) pairs in rows grouped by expert, each expert's pairs in flat order
    (``token * k + slot``: tokens ascending): ``order`` [T * k] the pair at each row, ``counts``
    [E] each expert's rows, ``by_id`` [T, k] each token's rows by ascending expert id, and
    ``tiles`` (``stored_linear.group_tiles``' (expert, lo, hi) rows) when asked for."""

    order: torch.Tensor
    counts: torch.Tensor
    by_id: torch.Tensor
    tiles: torch.Tensor | None


@triton.jit(do_not_specialize=["N", "BM"])
def _expert_rows_kernel(
    ids_ptr,
    order_ptr,
    counts_ptr,
    by_id_ptr,
    tiles_ptr,
    N,
    BM,
    E: tl.constexpr,
    K: tl.constexpr,
    BE: tl.constexpr,
    KP: tl.constexpr,
    BLOCK: tl.constexpr,
    TILE_BLOCK: tl.constexpr,
):
    x = tl.program_id(0)
    bins = tl.arange(0, BE)
    hist = tl.zeros([BE], tl.int32)
    for p0 in range(0, N, BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        hist += tl.histogram(tl.load(ids_ptr + p, mask=p < N, other=0).to(tl.int32), BE)
    # the padding past N was counted as expert 0
    hist -= tl.where(bins == 0, tl.cdiv(N, BLOCK) * BLOCK - N, 0)
    counts = hist.to(tl.int64)
    mine = bins == x
    count = tl.sum(tl.where(mine, counts, 0), axis=0)
    start = tl.sum(tl.where(bins < x, counts, 0), axis=0)  # rows of the experts before
    tl.store(counts_ptr + x, count)

    run = tl.zeros((), tl.int64)  # this expert's pairs seen so far
    slots = tl.arange(0, KP)
    for p0 in range(0, tl.where(count > 0, N, 0), BLOCK):
        p = p0 + tl.arange(0, BLOCK)
        hit = (p < N) & (tl.load(ids_ptr + p, mask=p < N, other=-1) == x)
        h = hit.to(tl.int64)
        row = start + run + tl.cumsum(h, 0) - h
        tl.store(order_ptr + row, p.to(tl.int64), mask=hit)
        # the slot's place among its token's experts: lower ids, then equal ids in earlier slots
        tok, slot = p // K, p % K
        peer = hit[:, None] & (slots[None, :] < K)
        ids = tl.load(ids_ptr + tok[:, None].to(tl.int64) * K + slots[None, :], mask=peer, other=0)
        before = peer & ((ids < x) | ((ids == x) & (slots[None, :] < slot[:, None])))
        place = tl.sum(before.to(tl.int64), axis=1)
        tl.store(by_id_ptr + tok.to(tl.int64) * K + place, row, mask=hit)
        run += tl.sum(h, axis=0)

    # tiles of BM rows (none when BM is 0: a runtime value, so the per-expert loop's call and the
    # grouped launches' share one compiled variant)
    bm = tl.maximum(BM, 1)
    per = tl.where(BM > 0, (counts + bm - 1) // bm, 0)
    first = tl.sum(tl.where(bins < x, per, 0), axis=0)
    mine_tiles = tl.sum(tl.where(mine, per, 0), axis=0)
    i = tl.arange(0, TILE_BLOCK)
    zero = tl.zeros([TILE_BLOCK], tl.int64)
    for j0 in range(0, mine_tiles, TILE_BLOCK):
        j = j0 + i
        lo = start + j * bm
        at = tiles_ptr + (first + j) * 3
        m = j < mine_tiles
        tl.store(at, zero + x, mask=m)
        tl.store(at + 1, lo, mask=m)
        tl.store(at + 2, tl.minimum(lo + bm, start + count), mask=m)
    # the empty tiles after the last used one: (E - 1, 0, 0), a share per program
    n_tiles = tl.where(BM > 0, tl.cdiv(N, bm) + E, 0)
    for j0 in range(tl.sum(per, axis=0) + x * TILE_BLOCK, n_tiles, E * TILE_BLOCK):
        j = j0 + i
        at = tiles_ptr + j.to(tl.int64) * 3
        m = j < n_tiles
        tl.store(at, zero + (E - 1), mask=m)
        tl.store(at + 1, zero, mask=m)
        tl.store(at + 2, zero, mask=m)


def expert_rows(ids: torch.Tensor, experts: int, tile_rows: int | None = None) -> ExpertRows:
    """``ExpertRows`` of ids ``[T, k]`` (each in ``[0, experts)``); ``tile_rows``: the row
    tiles of ``grouped_stored_linear`` too, ``tile_rows`` a tile."""
    tokens, k = ids.shape
    n = tokens * k
    dev = ids.device
    if experts > MAX_EXPERTS:
        raise ValueError(f"at most {MAX_EXPERTS} experts, got {experts}")
    order = torch.empty(n, dtype=torch.int64, device=dev)
    counts = torch.empty(experts, dtype=torch.int64, device=dev)
    by_id = torch.empty(tokens, k, dtype=torch.int64, device=dev)
    tiles = None
    if tile_rows is not None:
        tiles = torch.empty(triton.cdiv(n, tile_rows) + experts, 3, dtype=torch.int64, device=dev)
    _expert_rows_kernel[(experts,)](
        ids.contiguous(),
        order,
        counts,
        by_id,
        order if tiles is None else tiles,
        n,
        tile_rows or 0,
        E=experts,
        K=k,
        BE=triton.next_power_of_2(experts),
        KP=triton.next_power_of_2(k),
        BLOCK=BLOCK,
        TILE_BLOCK=TILE_BLOCK,
    )
    return ExpertRows(order, counts, by_id, tiles)
