"""Paged attention and the paged K/V write, in Triton (the GPU runner's attention).

Decode: one program per (request, KV head) walks the request's block table ``BLOCK_N`` keys at a
time with an online softmax in fp32, for all the query heads that share the KV head, so each K/V
row is read once. Prefill: one program per (tile of ``BLOCK_M`` queries of one request, query
head), the same walk with a causal mask on absolute positions, so a prefix-cache hit simply reads
the blocks the cache already holds. Rows the caller marks as padding (cache slot -1, context
length 0) write nothing and read nothing. Both match the torch path
(``engramrt.model.attention``) within floating-point reordering.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engramrt.kernels.tiles import PREFILL_TILE


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, tables_ptr, width_ptr, lens_ptr, out_ptr, scale,
    H: tl.constexpr, KVH: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr,
    D: tl.constexpr, BLOCK_D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    b, kvh = tl.program_id(0), tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gm, dm = g < G, d < D
    heads = kvh * G + g
    q = tl.load(q_ptr + (b * H + heads)[:, None] * D + d[None, :], mask=gm[:, None] & dm[None, :],
                other=0).to(tl.float32)  # fmt: skip
    n = tl.load(lens_ptr + b)
    max_blocks = tl.load(width_ptr)  # from memory: a graph replays any table width
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for start in range(0, n, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < n
        block = tl.load(tables_ptr + b * max_blocks + pos // BS, mask=valid, other=0).to(tl.int64)
        rows = ((block * BS + pos % BS) * KVH + kvh)[:, None] * D + d[None, :]
        kv_mask = valid[:, None] & dm[None, :]
        k = tl.load(k_ptr + rows, mask=kv_mask, other=0).to(tl.float32)  # [N, D]
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G, N]
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + rows, mask=kv_mask, other=0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]  # a padded row (no keys) stores zeros
    tl.store(out_ptr + (b * H + heads)[:, None] * D + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=gm[:, None] & dm[None, :])  # fmt: skip


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, qstart_ptr, pos0_ptr, tile_req_ptr, tile_m0_ptr,
    scale, max_blocks,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    BS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    tile, h = tl.program_id(0), tl.program_id(1)
    kvh = h // (H // KVH)
    b = tl.load(tile_req_ptr + tile)
    m0 = tl.load(tile_m0_ptr + tile)
    q0 = tl.load(qstart_ptr + b)
    n = tl.load(qstart_ptr + b + 1) - q0
    p0 = tl.load(pos0_ptr + b)
    m = m0 + tl.arange(0, BLOCK_M)
    mvalid = m < n
    qpos = p0 + m
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(q_ptr + ((q0 + m).to(tl.int64)[:, None] * H + h) * D + d[None, :],
                mask=mvalid[:, None] & dm[None, :], other=0)  # fmt: skip
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    hi = p0 + tl.minimum(m0 + BLOCK_M, n)  # keys up to the tile's last query
    for start in range(0, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kvalid = kpos < hi
        block = tl.load(tables_ptr + b * max_blocks + kpos // BS, mask=kvalid, other=0)
        rows = (block.to(tl.int64) * BS + kpos % BS) * KVH + kvh
        kt = tl.load(k_ptr + rows[None, :] * D + d[:, None], mask=kvalid[None, :] & dm[:, None],
                     other=0)  # fmt: skip
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = s * scale
        causal = (kpos[None, :] <= qpos[:, None]) & kvalid[None, :]
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past the run see no key
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(v_ptr + rows[:, None] * D + d[None, :], mask=kvalid[:, None] & dm[None, :],
                    other=0)  # fmt: skip
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(out_ptr + ((q0 + m).to(tl.int64)[:, None] * H + h) * D + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mvalid[:, None] & dm[None, :])  # fmt: skip


@triton.jit
def _write_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slots_ptr, ROW: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = (i < ROW) & (i * 0 + slot >= 0)  # slot -1: a padded row writes nothing
    tl.store(kc_ptr + slot * ROW + i, tl.load(k_ptr + t * ROW + i, mask=m), mask=m)
    tl.store(vc_ptr + slot * ROW + i, tl.load(v_ptr + t * ROW + i, mask=m), mask=m)


def _keys_per_step(row_elems: int) -> int:
    """Keys per decode iteration: about 8K fp32 products in flight per program."""
    return max(16, min(64, triton.next_power_of_2(max(1, 8192 // row_elems))))


def _group(heads: int, kv_heads: int) -> int:
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    return heads // kv_heads


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    table_width: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [B, H, D]`` against each request's first ``context_lens[b]`` cached positions;
    ``block_tables`` row-major with ``table_width`` (a device scalar; default: its columns)
    ids per request, caches ``[blocks * block_size, KVH, D]``."""
    bsz, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = _group(heads, kv_heads)
    out = torch.empty_like(q)
    if bsz == 0:
        return out
    if table_width is None:
        table_width = torch.tensor([block_tables.shape[1]], device=q.device)
    _decode_kernel[(bsz, kv_heads)](
        q.contiguous(), k_cache, v_cache, block_tables.contiguous(), table_width,
        context_lens.contiguous(), out, dim**-0.5,
        H=heads, KVH=kv_heads, G=group, BLOCK_G=triton.next_power_of_2(group), D=dim,
        BLOCK_D=triton.next_power_of_2(dim), BS=block_size,
        BLOCK_N=_keys_per_step(triton.next_power_of_2(group) * triton.next_power_of_2(dim)),
    )  # fmt: skip
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    start_pos: torch.Tensor,
    tile_req: torch.Tensor,
    tile_m0: torch.Tensor,
    block_size: int,
) -> torch.Tensor:
    """``q [T, H, D]``: request b's queries are rows ``query_start[b]:query_start[b + 1]`` at
    absolute positions from ``start_pos[b]``; each attends causally over its cached positions
    (its K/V already written). Tiles: ``engramrt.kernels.tiles.prefill_tiles``."""
    tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    _group(heads, kv_heads)
    out = torch.zeros_like(q)
    if tile_req.numel() == 0:
        return out
    _prefill_kernel[(tile_req.numel(), heads)](
        q.contiguous(), k_cache, v_cache, out, block_tables.contiguous(), query_start,
        start_pos, tile_req, tile_m0, dim**-0.5, block_tables.shape[1],
        H=heads, KVH=kv_heads, D=dim, BLOCK_D=max(16, triton.next_power_of_2(dim)),
        BS=block_size, BLOCK_M=PREFILL_TILE, BLOCK_N=32,
        IEEE=q.dtype == torch.float32,
    )  # fmt: skip
    return out


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    slots: torch.Tensor,
) -> None:  # fmt: skip
    """``k, v [T, KVH, D]`` into cache rows ``slots [T]`` (-1: skip the row)."""
    t, kv_heads, dim = k.shape
    if t == 0:
        return
    row = kv_heads * dim
    _write_kernel[(t,)](k.contiguous(), v.contiguous(), k_cache, v_cache, slots.contiguous(),
                        ROW=row, BLOCK=triton.next_power_of_2(row))  # fmt: skip
