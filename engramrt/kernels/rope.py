"""Rotary embedding of q and k and the KV-cache write of k and v, in one Triton launch.

In torch this is about eight elementwise kernels for q, again for k, and a scatter for the
cache, in every layer: at bs 1 on a 36-layer model, hundreds of tiny launches a decode step.
Here one program takes ``BLOCK_H`` heads of one token's stacked ``[q | k | v]`` projection: q
heads are rotated into the returned q, k heads rotated and v heads copied into the token's cache
row (none for slot -1, a padded row). The same fp32 formula as
``engramrt.model.layers.apply_rope``; the compiler may fuse a product into an add, so results
match to fp32 rounding before the cast, not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_H = 4  # heads per program: several programs per token at bs 1


@triton.jit
def _rope_write_kernel(
    qkv_ptr,
    cos_ptr,
    sin_ptr,
    q_ptr,
    kc_ptr,
    vc_ptr,
    slots_ptr,
    H: tl.constexpr,
    KVH: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t, hb = tl.program_id(0), tl.program_id(1)
    h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    i = tl.arange(0, BLOCK)
    D: tl.constexpr = 2 * HALF
    m = (h < H + 2 * KVH)[:, None] & (i < HALF)[None, :]
    src = t.to(tl.int64) * ((H + 2 * KVH) * D) + h[:, None] * D + i[None, :]
    x1 = tl.load(qkv_ptr + src, mask=m, other=0).to(tl.float32)
    x2 = tl.load(qkv_ptr + src + HALF, mask=m, other=0).to(tl.float32)
    c = tl.load(cos_ptr + t * HALF + i, mask=i < HALF, other=0)[None, :]
    s = tl.load(sin_ptr + t * HALF + i, mask=i < HALF, other=0)[None, :]
    rot = (h < H + KVH)[:, None]  # q and k heads; v heads are copied
    y1 = tl.where(rot, x1 * c - x2 * s, x1)
    y2 = tl.where(rot, x2 * c + x1 * s, x2)
    is_q = (h < H)[:, None]
    q_at = (t.to(tl.int64) * H + h)[:, None] * D + i[None, :]
    tl.store(q_ptr + q_at, y1.to(q_ptr.dtype.element_ty), mask=m & is_q)
    tl.store(q_ptr + q_at + HALF, y2.to(q_ptr.dtype.element_ty), mask=m & is_q)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    kv = tl.where(h < H + KVH, h - H, h - H - KVH)
    at = (slot * KVH + kv)[:, None] * D + i[None, :]
    real = (i * 0 + slot >= 0)[None, :]  # slot -1: a padded row writes nothing
    is_k = ((h >= H) & (h < H + KVH))[:, None] & real
    is_v = (h >= H + KVH)[:, None] & real
    tl.store(kc_ptr + at, y1.to(kc_ptr.dtype.element_ty), mask=m & is_k)
    tl.store(kc_ptr + at + HALF, y2.to(kc_ptr.dtype.element_ty), mask=m & is_k)
    tl.store(vc_ptr + at, y1.to(vc_ptr.dtype.element_ty), mask=m & is_v)
    tl.store(vc_ptr + at + HALF, y2.to(vc_ptr.dtype.element_ty), mask=m & is_v)


def rope_write_kv(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    heads: int,
) -> torch.Tensor:
    """``qkv [T, (heads + 2 * kv_heads) * head_dim]`` with ``cos, sin [T, 1, head_dim / 2]``
    (fp32) and cache rows ``slots [T]`` -> the rotated ``q [T, heads, head_dim]``."""
    _, kv_heads, dim = k_cache.shape
    tokens = qkv.shape[0]
    q = torch.empty(tokens, heads, dim, dtype=qkv.dtype, device=qkv.device)
    if tokens == 0:
        return q
    half = dim // 2
    grid = (tokens, triton.cdiv(heads + 2 * kv_heads, BLOCK_H))
    _rope_write_kernel[grid](
        qkv.contiguous(),
        cos.contiguous(),
        sin.contiguous(),
        q,
        k_cache,
        v_cache,
        slots.contiguous(),
        H=heads,
        KVH=kv_heads,
        HALF=half,
        BLOCK_H=BLOCK_H,
        BLOCK=triton.next_power_of_2(half),
    )
    return q
