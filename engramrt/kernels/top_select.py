"""DeepSeek-V4.1's top-k selection in Triton: each row's ``k`` best entries among its first
``seen``, equal scores going to the lower position, returned in position order with ``-1`` past
the last pick (``engramrt.models.deepseek_v41.attention.top_by_position``, whose torch path sorts).
No
sort: the picks are wanted in position order, so it is enough to find the k-th best value. A
program takes one row; scores become unsigned keys that order as the floats do (``-0.0`` as
``+0.0``, as a sort compares them), and a radix select finds the k-th best key a byte a pass (a
histogram of the next byte among the keys that share the bytes found so far; 2 passes for bf16
scores). A last pass keeps every key above it and, of those equal to it, the lowest positions up
to ``k``, each kept position written at its running count (a prefix sum). Only the ``seen``
entries are read, so a CUDA graph's row as wide as the cache's capacity costs what the token
sees, and a row with ``seen <= k`` skips the search. ``allowed`` (a block mask) scores the
entries of blocks outside it as ``-inf``: still pickable, as in the sort.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
RADIX = 8  # bits of the key a pass decides: 2 passes for bf16 scores, 4 for fp32


@triton.jit
def _keys(row_ptr, allow_ptr, c, valid, BS: tl.constexpr, MASKED: tl.constexpr, BITS: tl.constexpr):
    """Keys of entries ``c``: the score's bits, sign-magnitude turned into an unsigned order."""
    x = tl.load(row_ptr + c, mask=valid, other=0.0)
    if MASKED:
        ok = tl.load(allow_ptr + c // BS, mask=valid, other=0) != 0
        x = tl.where(ok, x, float("-inf")).to(x.dtype)
    if BITS == 16:
        b = x.to(tl.int16, bitcast=True).to(tl.int64)
    else:
        b = x.to(tl.int32, bitcast=True).to(tl.int64)
    half: tl.constexpr = 1 << (BITS - 1)
    b = tl.where(b == -half, 0, b)  # -0.0 (the sign bit alone) ties +0.0
    return tl.where(b >= 0, b + half, half - 1 - (b & (half - 1)))


@triton.jit(do_not_specialize=["C", "K", "NB"])
def _top_select_kernel(
    scores_ptr,
    seen_ptr,
    allow_ptr,
    out_ptr,
    C,
    K,
    NB,
    BS: tl.constexpr,
    MASKED: tl.constexpr,
    BITS: tl.constexpr,
    BLOCK: tl.constexpr,
    RADIX: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    row = scores_ptr + t * C
    allow = allow_ptr + t * NB
    seen = tl.minimum(tl.load(seen_ptr + t), C)
    span = tl.where(seen > K, seen, 0)  # seen <= k: every entry is a pick, no search
    bins = tl.arange(0, 1 << RADIX)
    thr = tl.zeros((), tl.int64)  # the k-th best key, a digit a pass (-1 when no search)
    above = tl.zeros((), tl.int64)  # keys known to be above it
    for i in tl.static_range(BITS // RADIX):
        shift = BITS - RADIX * (i + 1)
        hist = tl.zeros((1 << RADIX,), tl.int32)
        for c0 in range(0, span, BLOCK):
            c = c0 + tl.arange(0, BLOCK)
            valid = c < span
            key = _keys(row, allow, c, valid, BS, MASKED, BITS)
            match = valid & ((key >> (shift + RADIX)) == thr)
            digit = tl.where(match, (key >> shift) & ((1 << RADIX) - 1), 0).to(tl.int32)
            # keys outside the prefix count as digit 0: the k-th key's digit is found from the
            # top, and digit 0 is taken only when no higher one holds k keys
            hist += tl.histogram(digit, 1 << RADIX)
        at_least = tl.sum(hist) - tl.cumsum(hist, 0) + hist  # keys of this digit or more
        best = tl.sum((above + at_least >= K).to(tl.int32)) - 1  # the k-th key's digit
        above += tl.sum(tl.where(bins > best, hist, 0)).to(tl.int64)
        thr = (thr << RADIX) | best
    need = K - above  # of the keys equal to the threshold, the lowest positions
    ties = tl.zeros((), tl.int64)
    kept = tl.zeros((), tl.int64)
    for c0 in range(0, seen, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        valid = c < seen
        key = _keys(row, allow, c, valid, BS, MASKED, BITS)
        tie = (valid & (key == thr)).to(tl.int64)
        keep = valid & ((key > thr) | ((tie != 0) & (ties + tl.cumsum(tie, 0) - tie < need)))
        keep = keep.to(tl.int64)
        at = kept + tl.cumsum(keep, 0) - keep
        tl.store(out_ptr + t * K + at, c.to(tl.int64), mask=(keep != 0) & (at < K))
        ties += tl.sum(tie)
        kept += tl.sum(keep)
    for j0 in range(0, K, BLOCK):
        j = j0 + tl.arange(0, BLOCK)
        tl.store(out_ptr + t * K + j, tl.full((BLOCK,), -1, tl.int64), mask=(j >= kept) & (j < K))


def top_select(
    scores: torch.Tensor,
    seen: torch.Tensor,
    k: int,
    allowed: torch.Tensor | None = None,
    block: int = 1,
) -> torch.Tensor:
    """Picks ``[n, k]`` (int64) of ``scores`` [n, C] (fp32 or a 16-bit float), row ``i`` among
    its first ``seen[i]`` entries; ``allowed`` [n, NB]: entry ``c`` counts as ``-inf`` unless
    ``allowed[i, c // block]``."""
    n, width = scores.shape
    out = torch.empty(n, k, dtype=torch.int64, device=scores.device)
    if n == 0 or k == 0:
        return out
    bits = 8 * scores.element_size()
    if bits not in (16, 32):
        raise ValueError(f"scores must be fp32 or a 16-bit float, got {scores.dtype}")
    masked = allowed is not None
    allow = allowed.contiguous() if masked else seen  # unread without a mask
    _top_select_kernel[(n,)](
        scores.contiguous(),
        seen.contiguous(),
        allow,
        out,
        width,
        k,
        allowed.shape[1] if masked else 0,
        BS=block,
        MASKED=masked,
        BITS=bits,
        BLOCK=BLOCK,
        RADIX=RADIX,
    )
    return out
