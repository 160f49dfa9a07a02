"""DeepSeek-V4.1's indexer scores in Triton: ``score[t, c] = sum_h w[t, h] relu(q[t, h] . k[c])``
of every token of a step against the index keys its request holds, read through the block
tables (the torch path gathers each token's keys into memory first).

A program takes one token and ``CHUNK`` entries, its queries loaded once, ``BLOCK_N`` keys a
step; rounded where the torch path rounds in the activation dtype (the dot, the weighted
product; the sum over heads in fp32, rounded once), so the scores equal it up to the order of
fp32 sums. Entries the token cannot see (``c >= (p + 1) // ratio``) score ``-inf`` without a
key read: a CUDA graph's step scores against the cache's capacity, and pays writes, not dots,
for what lies past each token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engramrt.kernels.common import dot_f32, interpreted

BLOCK_N, CHUNK = 64, 1024


# the entry count and table width vary by step: specialising on them compiles while serving
@triton.jit(do_not_specialize=["C", "TW"])
def _index_scores_kernel(
    q_ptr,
    w_ptr,
    keys_ptr,
    table_ptr,
    req_ptr,
    pos_ptr,
    out_ptr,
    C,
    TW,
    R: tl.constexpr,
    BS: tl.constexpr,
    H: tl.constexpr,
    DI: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CHUNK: tl.constexpr,
    F32: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    c0 = tl.program_id(1) * CHUNK
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, DI)
    q = tl.load(q_ptr + (t * H + h)[:, None] * DI + d[None, :], mask=(h < H)[:, None], other=0)
    w = tl.load(w_ptr + t * H + h, mask=h < H, other=0).to(tl.float32)
    req = tl.load(req_ptr + t).to(tl.int64)
    seen = (tl.load(pos_ptr + t) + 1) // R
    hi = tl.minimum(c0 + CHUNK, C)
    # entries the token sees are scored; past them a CUDA graph's step (which scans the cache's
    # capacity) only writes -inf
    mid = c0 + tl.cdiv(tl.maximum(tl.minimum(hi, seen) - c0, 0), BLOCK_N) * BLOCK_N
    for start in range(mid, hi, BLOCK_N):
        c = start + tl.arange(0, BLOCK_N)
        tl.store(out_ptr + t * C + c, tl.full((BLOCK_N,), float("-inf"), q.dtype), mask=c < hi)
    for start in range(c0, mid, BLOCK_N):
        c = start + tl.arange(0, BLOCK_N)
        ok = c < seen
        p = c * R
        block = tl.load(table_ptr + req * TW + p // BS, mask=ok, other=0).to(tl.int64)
        rows = block * (BS // R) + (p % BS) // R
        k = tl.load(keys_ptr + rows[:, None] * DI + d[None, :], mask=ok[:, None], other=0)
        s = dot_f32(q, tl.trans(k), F32).to(q.dtype).to(tl.float32)  # [BLOCK_H, BLOCK_N]
        s = (tl.maximum(s, 0.0) * w[:, None]).to(q.dtype).to(tl.float32)
        total = tl.sum(s, axis=0)
        tl.store(out_ptr + t * C + c, tl.where(ok, total, float("-inf")).to(q.dtype), mask=c < hi)


def index_scores(
    q: torch.Tensor,
    w: torch.Tensor,
    keys: torch.Tensor,
    table: torch.Tensor,
    req: torch.Tensor,
    pos: torch.Tensor,
    ratio: int,
    block_size: int,
    count: int,
) -> torch.Tensor:
    """Scores ``[T, count]`` in ``q``'s dtype of queries ``q`` [T, H, DI] with head weights
    ``w`` [T, H] against ``keys`` (the paged index keys: entry ``c`` of request ``b`` at row
    ``table[b, c*r // bs] * (bs / r) + (c*r % bs) / r``); token ``t`` is request ``req[t]``'s,
    at position ``pos[t]``."""
    t, h, di = q.shape
    out = torch.empty(t, count, dtype=q.dtype, device=q.device)
    if t == 0 or count == 0:
        return out
    _index_scores_kernel[(t, triton.cdiv(count, CHUNK))](
        q.contiguous(),
        w.to(q.dtype).contiguous(),
        keys,
        table,
        req,
        pos,
        out,
        count,
        table.shape[1],
        R=ratio,
        BS=block_size,
        H=h,
        DI=di,
        BLOCK_H=max(16, triton.next_power_of_2(h)),
        BLOCK_N=BLOCK_N,
        CHUNK=CHUNK,
        F32=q.dtype == torch.float32 or interpreted(),
    )
    return out
