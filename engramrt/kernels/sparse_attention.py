"""DeepSeek-V4.1's sparse latent attention in Triton: one launch a layer for every token of a
step (decode rows, prefill chunks, a mixed step's both), the torch path's
``V41Attention.attend`` without gathering rows into memory first.

A token's rows are its window (positions ``p - window + 1 .. p``: its own run's latents from
``kv``, earlier ones from its slot's ring) then its picked rows of the compressed cache. They
are cut into splits of ``SPLIT_ROWS``; each split is an online softmax in fp32 over ``BLOCK_N``
rows a step (probabilities cast to the activation dtype before they weigh the rows, as the
reference's kernel does), and the splits' (sum, max, denominator) are merged in ascending order,
the per-head sink joining the denominator at the end. A program takes ``BLOCK_H`` query heads of
one token (one shared latent is every head's K and V, so the heads read each row once) and all
its splits; or, when a step is too small to fill the GPU even with a program a split, one
split, the tile's last program to arrive merging the others' from memory. The same operations
in the same order either way. A larger step takes its rows as one split (the merges cost
about as much as the rest: 2x at 64 tokens), unless ``--batch-invariant`` asks that a token's
bits not depend on its batch. Rows it cannot see
score ``-inf``; a token that sees nothing outputs zeros. Shapes depend on the token count only:
CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engramrt.kernels import batch_invariant
from engramrt.kernels.common import (
    MAX_TILES,
    SPREAD_BELOW,
    arrival_counters,
    dot_f32,
    interpreted,
)

NO_SCORE = tl.constexpr(-1e30)  # the running max before any row: exp(-inf - it) is 0, not NaN
SPLIT_ROWS = 64  # rows a split: fixed, so a token's sums are the same in any step


@triton.jit
def _softmax_step(acc, m_i, l_i, q, rows, valid, scale, F32: tl.constexpr):
    """One block of ``rows`` [N, D] (``valid`` [N]) into the running (acc, max, sum)."""
    s = tl.where(valid[None, :], dot_f32(q, tl.trans(rows), F32) * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    acc = acc * alpha[:, None] + dot_f32(p.to(rows.dtype), rows, F32)
    return acc, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit
def _merge(acc, m_i, l_i, acc_s, m_s, l_s):
    """A split's (acc, max, sum) into the running ones; the FMAs written out, so that merging
    in registers and merging from memory round alike (the compiler fuses as it sees fit)."""
    m_new = tl.maximum(m_i, m_s)
    a, b = tl.exp(m_i - m_new), tl.exp(m_s - m_new)
    acc = tl.fma(acc_s, b[:, None], acc * a[:, None])
    return acc, m_new, tl.fma(l_s, b, l_i * a)


@triton.jit(do_not_specialize=["K_PICKS", "SPLITS", "ROWS"])  # K_PICKS: varies by step
def _sparse_attention_kernel(
    q_ptr,
    kv_ptr,
    ring_ptr,
    comp_ptr,
    picks_ptr,
    pos_ptr,
    p0_ptr,
    q0_ptr,
    slot_ptr,
    sink_ptr,
    out_ptr,
    part_ptr,
    ml_ptr,
    count_ptr,
    scale,
    T,
    K_PICKS,
    SPLITS,
    H: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    RING: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ROWS,
    SPREAD: tl.constexpr,
    F32: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hm = heads < H
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (t * H + heads)[:, None] * D + d[None, :], mask=hm[:, None], other=0)
    p, p0 = tl.load(pos_ptr + t), tl.load(p0_ptr + t)
    q0, slot = tl.load(q0_ptr + t), tl.load(slot_ptr + t)
    base = tl.maximum(p - W + 1, 0)
    total = W + K_PICKS
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    m_i = tl.full((BLOCK_H,), NO_SCORE, tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    first = tl.program_id(2) if SPREAD else 0
    for s in range(first, first + 1 if SPREAD else SPLITS):
        acc_s = tl.zeros((BLOCK_H, D), tl.float32)
        m_s = tl.full((BLOCK_H,), NO_SCORE, tl.float32)
        l_s = tl.zeros((BLOCK_H,), tl.float32)
        lo, hi = s * ROWS, tl.minimum(s * ROWS + ROWS, total)
        for i0 in range(lo, tl.minimum(hi, W), BLOCK_N):  # window rows, oldest first
            i = i0 + tl.arange(0, BLOCK_N)
            u = base + i
            valid = (i < tl.minimum(hi, W)) & (u <= p)
            mine = valid & (u >= p0)  # this run's rows: kv; earlier ones: the ring
            rows = tl.load(
                kv_ptr + (q0 + u - p0)[:, None] * D + d[None, :], mask=mine[:, None], other=0
            )
            rows += tl.load(
                ring_ptr + (slot * RING + u % RING)[:, None] * D + d[None, :],
                mask=(valid & ~mine)[:, None],
                other=0,
            )
            acc_s, m_s, l_s = _softmax_step(acc_s, m_s, l_s, q, rows, valid, scale, F32)
        for i0 in range(tl.maximum(lo, W), hi, BLOCK_N):  # picked compressed rows (-1: none)
            j = i0 - W + tl.arange(0, BLOCK_N)
            r = tl.load(picks_ptr + t * K_PICKS + j, mask=j < hi - W, other=-1)
            valid = r >= 0
            rows = tl.load(comp_ptr + r[:, None] * D + d[None, :], mask=valid[:, None], other=0)
            acc_s, m_s, l_s = _softmax_step(acc_s, m_s, l_s, q, rows, valid, scale, F32)
        if SPREAD:  # this split's sums for the tile's last program
            at = (s * T + t) * H + heads
            tl.store(part_ptr + at[:, None] * D + d[None, :], acc_s, mask=hm[:, None])
            tl.store(ml_ptr + 2 * at, m_s, mask=hm)
            tl.store(ml_ptr + 2 * at + 1, l_s, mask=hm)
        else:
            acc, m_i, l_i = _merge(acc, m_i, l_i, acc_s, m_s, l_s)
    last = True
    if SPREAD:
        tl.debug_barrier()
        tile = t * tl.num_programs(1) + tl.program_id(1)
        last = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel") == SPLITS - 1
        if last:
            for s in range(SPLITS):
                at = (s * T + t) * H + heads
                acc_s = tl.load(
                    part_ptr + at[:, None] * D + d[None, :],
                    mask=hm[:, None],
                    other=0.0,
                    cache_modifier=".cg",
                )
                m_s = tl.load(ml_ptr + 2 * at, mask=hm, other=0.0, cache_modifier=".cg")
                l_s = tl.load(ml_ptr + 2 * at + 1, mask=hm, other=0.0, cache_modifier=".cg")
                acc, m_i, l_i = _merge(acc, m_i, l_i, acc_s, m_s, l_s)
            tl.atomic_xchg(count_ptr + tile, 0)
    if last:
        sink = tl.load(sink_ptr + heads, mask=hm, other=0.0).to(tl.float32)
        out = acc / (l_i + tl.exp(sink - m_i))[:, None]
        tl.store(
            out_ptr + (t * H + heads)[:, None] * D + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=hm[:, None],
        )


def sparse_attention(
    q: torch.Tensor,
    kv: torch.Tensor,
    ring: torch.Tensor,
    comp: torch.Tensor | None,
    picks: torch.Tensor | None,
    pos: torch.Tensor,
    p0: torch.Tensor,
    q0: torch.Tensor,
    slot: torch.Tensor,
    sink: torch.Tensor,
    scale: float,
    window: int,
    ring_len: int | None = None,
) -> torch.Tensor:
    """``q`` [T, H, D] over each token's window (``kv`` [T, D] this step's latents, ``ring``
    [slots * window, D] the earlier ones) and its ``picks`` [T, k] (rows of ``comp``, -1:
    none); ``pos``/``p0``/``q0``/``slot`` [T]: position, its run's first position and first
    row, its ring slot. Out ``[T, H, D]`` in ``q``'s dtype."""
    t, h, d = q.shape
    if d & (d - 1):
        raise ValueError(f"the latent width must be a power of two, got {d}")
    out = torch.empty_like(q)
    if t == 0:
        return out
    if picks is None:
        picks, comp = torch.empty(t, 0, dtype=torch.int64, device=q.device), kv
    block_h = 16  # tl.dot's least rows; heads past H are masked
    head_tiles = triton.cdiv(h, block_h)
    block_n = 64 if d <= 128 else 32
    total = window + picks.shape[1]
    splits = triton.cdiv(total, SPLIT_ROWS)
    spread = splits > 1 and t * head_tiles * splits <= SPREAD_BELOW  # else partials cost more
    if not spread and not batch_invariant(q.device):  # one split: no merges
        rows, splits = triton.cdiv(total, block_n) * block_n, 1
    else:  # the same splits in any step
        rows = SPLIT_ROWS
    if spread and t * head_tiles > MAX_TILES:
        raise ValueError(f"{t * head_tiles} tiles exceed the {MAX_TILES} counters")
    part = q.new_empty((splits, t, h, d), dtype=torch.float32) if spread else out
    ml = q.new_empty((splits, t, h, 2), dtype=torch.float32) if spread else out
    _sparse_attention_kernel[(t, head_tiles, splits if spread else 1)](
        q.contiguous(),
        kv.contiguous(),
        ring,
        comp,
        picks.contiguous(),
        pos,
        p0,
        q0,
        slot,
        sink,
        out,
        part,
        ml,
        arrival_counters(q.device),
        scale,
        t,
        picks.shape[1],
        splits,
        H=h,
        D=d,
        W=window,
        RING=ring_len or window,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        ROWS=rows,
        SPREAD=spread,
        F32=q.dtype == torch.float32 or interpreted(),
    )
    return out
