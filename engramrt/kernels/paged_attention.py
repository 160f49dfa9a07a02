"""Paged decode attention and the paged K/V write, in Triton (for the GPU runner).

Decode: one program per (request, query head) walks the request's block table, one KV block at
a time, with an online softmax in fp32; grouped-query heads read their shared KV head. The write
kernel scatters a step's K/V rows to their cache slots. Both match the torch path
(``engramrt.model.attention``) within floating-point reordering.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, lens_ptr, out_ptr, scale, max_blocks,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BS: tl.constexpr,
):  # fmt: skip
    b, h = tl.program_id(0), tl.program_id(1)
    kvh = h // (H // KVH)
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(q_ptr + (b * H + h) * D + d, mask=dm, other=0).to(tl.float32)
    n = tl.load(lens_ptr + b)
    m_i = float("-inf")
    l_i = 0.0
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    s = tl.arange(0, BS)
    for blk in range(0, tl.cdiv(n, BS)):
        block = tl.load(tables_ptr + b * max_blocks + blk).to(tl.int64)
        pos = blk * BS + s
        valid = pos < n
        rows = (block * BS + s)[:, None] * (KVH * D) + kvh * D + d[None, :]
        k = tl.load(k_ptr + rows, mask=valid[:, None] & dm[None, :], other=0).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        scores = tl.where(valid, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=0))
        p = tl.exp(scores - m_new)
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + rows, mask=valid[:, None] & dm[None, :], other=0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l_i = l_i * alpha + tl.sum(p, axis=0)
        m_i = m_new
    out = acc / l_i
    tl.store(out_ptr + (b * H + h) * D + d, out.to(out_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < ROW
    tl.store(kc_ptr + slot * ROW + i, tl.load(k_ptr + t * ROW + i, mask=m), mask=m)
    tl.store(vc_ptr + slot * ROW + i, tl.load(v_ptr + t * ROW + i, mask=m), mask=m)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """``q [B, H, D]`` against each request's first ``context_lens[b]`` cached positions;
    ``block_tables [B, max_blocks]`` (padded), caches ``[blocks * block_size, KVH, D]``."""
    bsz, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    out = torch.empty_like(q)
    if bsz == 0:
        return out
    _decode_kernel[(bsz, heads)](
        q.contiguous(), k_cache, v_cache, block_tables.contiguous(), context_lens.contiguous(),
        out, dim**-0.5, block_tables.shape[1],
        H=heads, KVH=kv_heads, D=dim, BLOCK_D=triton.next_power_of_2(dim), BS=block_size,
    )  # fmt: skip
    return out


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:  # fmt: skip
    """``k, v [T, KVH, D]`` into cache rows ``slots [T]``."""
    t, kv_heads, dim = k.shape
    if t == 0:
        return
    row = kv_heads * dim
    _write_kernel[(t,)](k.contiguous(), v.contiguous(), k_cache, v_cache, slots.contiguous(),
                        ROW=row, BLOCK=triton.next_power_of_2(row))  # fmt: skip
