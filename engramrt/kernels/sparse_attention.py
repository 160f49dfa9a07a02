"""DeepSeek-V4.1's sparse latent attention in Triton: one launch a layer for every token of a
step (decode rows, prefill chunks, a mixed step's both), the torch path's
``V41Attention.attend`` without gathering rows into memory first.

A program takes one token and ``BLOCK_H`` of its query heads (one shared 512-d latent is every
head's K and V, so the heads of a token read each row once). It walks the token's window
(positions ``p - window + 1 .. p``: its own run's latents from ``kv``, earlier ones from its
slot's ring) and then its picked rows of the compressed cache, ``BLOCK_N`` rows a step, with an
online softmax in fp32 whose probabilities are cast to the activation dtype before they weigh
the rows (the reference's kernel does both, in blocks of 64 indices); the per-head sink joins
the denominator at the end. Rows it cannot see score ``-inf``; a token that sees nothing
outputs zeros. Shapes depend on the token count only: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engramrt.kernels.common import dot_f32, interpreted

NO_SCORE = tl.constexpr(-1e30)  # the running max before any row: exp(-inf - it) is 0, not NaN


@triton.jit
def _softmax_step(acc, m_i, l_i, q, rows, valid, scale, F32: tl.constexpr):
    """One block of ``rows`` [N, D] (``valid`` [N]) into the running (acc, max, sum)."""
    s = tl.where(valid[None, :], dot_f32(q, tl.trans(rows), F32) * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    alpha = tl.exp(m_i - m_new)
    acc = acc * alpha[:, None] + dot_f32(p.to(rows.dtype), rows, F32)
    return acc, m_new, l_i * alpha + tl.sum(p, axis=1)


@triton.jit(do_not_specialize=["K_PICKS"])  # min(top-k, entries): varies by step
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
    scale,
    K_PICKS,
    H: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    RING: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
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
    m_i = tl.full((BLOCK_H,), NO_SCORE, tl.float32)
    l_i = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, D), tl.float32)
    for w0 in range(0, W, BLOCK_N):  # the window, oldest first
        u = base + w0 + tl.arange(0, BLOCK_N)
        valid = (w0 + tl.arange(0, BLOCK_N) < W) & (u <= p)
        mine = valid & (u >= p0)  # this run's rows: kv; earlier ones: the ring
        rows = tl.load(
            kv_ptr + (q0 + u - p0)[:, None] * D + d[None, :], mask=mine[:, None], other=0
        )
        rows += tl.load(
            ring_ptr + (slot * RING + u % RING)[:, None] * D + d[None, :],
            mask=(valid & ~mine)[:, None],
            other=0,
        )
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, rows, valid, scale, F32)
    for j0 in range(0, K_PICKS, BLOCK_N):  # the picked compressed rows (-1: none)
        j = j0 + tl.arange(0, BLOCK_N)
        r = tl.load(picks_ptr + t * K_PICKS + j, mask=j < K_PICKS, other=-1)
        valid = r >= 0
        rows = tl.load(comp_ptr + r[:, None] * D + d[None, :], mask=valid[:, None], other=0)
        acc, m_i, l_i = _softmax_step(acc, m_i, l_i, q, rows, valid, scale, F32)
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
    _sparse_attention_kernel[(t, triton.cdiv(h, block_h))](
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
        scale,
        picks.shape[1],
        H=h,
        D=d,
        W=window,
        RING=ring_len or window,
        BLOCK_H=block_h,
        BLOCK_N=64 if d <= 128 else 32,
        F32=q.dtype == torch.float32 or interpreted(),
    )
    return out
