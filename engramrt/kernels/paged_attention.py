"""Paged attention in Triton, the GPU runner's attention (the K/V write is fused with RoPE in
``engramrt.kernels.rope``).

Decode is split-K ("flash decoding"), two launches. Stage 1, grid (request, KV head, split):
a program takes the G query heads that share one KV head (so each K/V row is read once) over one
contiguous slice of the request's keys, walking the block table ``BLOCK_N`` keys at a time with
``tl.dot`` (G padded to 16) and an online softmax in fp32, and writes the slice's normalised
partial output and log-sum-exp. Split ``s`` of a request of ``n`` keys covers
``[s * chunk, min((s + 1) * chunk, n))`` with ``chunk = ceil(n / splits)`` rounded up to whole
``BLOCK_N`` steps, computed in the kernel from the context length: the launch shape depends on
the batch size and the KV heads only (``decode_splits``), so one captured CUDA graph serves every
context length. Stage 2, grid (request, query head), merges the splits weighted by their
log-sum-exps. With one split, stage 1 writes the output itself and there is no stage 2.

Prefill (FlashAttention-2 style): one program per (``BLOCK_M`` queries of one request, query
head), walking the block table ``BLOCK_N`` keys at a time with an online softmax in base 2 (the
scale prescaled by log2(e)). Keys below the tile's first query, a prefix-cache hit's cached
blocks included, take steps without a mask; only the steps that straddle the tile's queries apply
the causal mask on absolute positions, and none go past its last query. The host's tiles
(``engramrt.kernels.tiles``) hold ``PREFILL_TILE`` queries, most keys first; a launch with a
smaller ``BLOCK_M`` runs several programs per tile. Rows the caller marks as padding (cache
slot -1, context length 0) write nothing and read nothing (decode stores zeros for them). Both
match the torch path (``engramrt.models.gqa.attention``) within floating-point reordering.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from engramrt.kernels.common import dot_f32, interpreted
from engramrt.kernels.tiles import PREFILL_TILE


@triton.jit(do_not_specialize=["SPLITS"])
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    width_ptr,
    lens_ptr,
    part_ptr,
    lse_ptr,
    out_ptr,
    scale,
    SPLITS,
    H: tl.constexpr,
    KVH: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    F32: tl.constexpr,
):
    """Stage 1: the G query heads of KV head ``kvh`` of request ``b`` over split ``s`` of its
    keys. ``DIRECT`` (one split): the normalised output itself, in the output's dtype."""
    b, kvh, s = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gm, dm = g < G, d < D
    heads = kvh * G + g
    q = tl.load(
        q_ptr + (b * H + heads)[:, None] * D + d[None, :], mask=gm[:, None] & dm[None, :], other=0
    ).to(k_ptr.dtype.element_ty)
    n = tl.load(lens_ptr + b)
    max_blocks = tl.load(width_ptr)  # from memory: a graph replays any table width
    chunk = tl.cdiv(tl.cdiv(n, SPLITS), BLOCK_N) * BLOCK_N  # whole steps; from n, not a constexpr
    lo = s * chunk
    hi = tl.minimum(lo + chunk, n)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for start in range(lo, hi, BLOCK_N):  # every step holds at least one key: m_i stays finite
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < hi
        block = tl.load(tables_ptr + b * max_blocks + pos // BS, mask=valid, other=0).to(tl.int64)
        rows = (block * BS + pos % BS) * KVH + kvh
        kt = tl.load(
            k_ptr + rows[None, :] * D + d[:, None], mask=valid[None, :] & dm[:, None], other=0
        )
        scores = tl.where(valid[None, :], dot_f32(q, kt, F32) * scale, float("-inf"))  # [G, N]
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(
            v_ptr + rows[:, None] * D + d[None, :], mask=valid[:, None] & dm[None, :], other=0
        )
        acc = acc * alpha[:, None] + dot_f32(p.to(v.dtype), v, F32)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]  # no keys: zeros
    if DIRECT:
        tl.store(
            out_ptr + (b * H + heads)[:, None] * D + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=gm[:, None] & dm[None, :],
        )
    else:
        row = (b * H + heads) * SPLITS + s  # [B, H, SPLITS] of lse, then D of the partial
        some = l_i > 0  # the split holds keys
        lse = tl.where(some, m_i + tl.log(tl.maximum(l_i, 1e-30)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=gm)
        # an empty split writes its lse alone: the merge never reads its partial
        tl.store(
            part_ptr + row[:, None] * D + d[None, :], out, mask=(gm & some)[:, None] & dm[None, :]
        )


@triton.jit(do_not_specialize=["SPLITS"])
def _decode_merge_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    SPLITS,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Stage 2: head ``h`` of request ``b``, the splits weighted by exp(lse - max lse); a row
    with no keys in any split (graph padding) stores zeros."""
    row = tl.program_id(0).to(tl.int64) * H + tl.program_id(1)
    sp = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    lse = tl.load(lse_ptr + row * SPLITS + sp, mask=sp < SPLITS, other=float("-inf"))
    top = tl.max(lse, axis=0)
    w = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))  # 0 for an empty split
    live = lse > float("-inf")
    part = tl.load(
        part_ptr + (row * SPLITS + sp)[:, None] * D + d[None, :],
        mask=live[:, None] & (d < D)[None, :],
        other=0,
    )
    out = tl.sum(w[:, None] * part, axis=0) / tl.maximum(tl.sum(w, axis=0), 1e-30)
    tl.store(out_ptr + row * D + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit
def _load(ptrs, dmask, EVEN_D: tl.constexpr):
    """Rows of a tile whose row indices are all in bounds; ``dmask`` only when the head dim is
    not a power of two (unmasked loads vectorise)."""
    if EVEN_D:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=dmask, other=0)
    return x


@triton.jit
def _prefill_steps(
    acc,
    m_i,
    l_i,
    q,
    qpos,
    k_ptr,
    v_ptr,
    trow,
    kvh,
    qk_scale,
    lo,
    hi,
    d,
    dm,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIAG: tl.constexpr,
    EVEN_D: tl.constexpr,
    F32: tl.constexpr,
):
    """Keys ``[lo, hi)``, ``BLOCK_N`` at a time, into the online softmax (base 2: ``qk_scale``
    holds log2(e)). ``DIAG``: the steps that straddle the tile's queries, under the causal mask;
    their key positions are clamped to ``hi - 1`` for the loads (a masked key reads a real row
    and weighs 0), so no load needs a key mask. Otherwise every key precedes every query."""
    for start in range(lo, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        if DIAG:
            kpos = tl.minimum(kpos, hi - 1)
        block = tl.load(trow + kpos // BS).to(tl.int64)
        rows = (block * BS + kpos % BS) * KVH + kvh
        offs = rows[:, None] * D + d[None, :]
        k = _load(k_ptr + offs, dm[None, :], EVEN_D)
        s = dot_f32(q, tl.trans(k), F32)  # [M, N]
        if DIAG:
            causal = (start + tl.arange(0, BLOCK_N))[None, :] <= qpos[:, None]
            s = tl.where(causal, s, float("-inf"))
        # log2 units; the scale is positive, so it commutes with the max (one FMA an element)
        m_new = tl.maximum(m_i, tl.max(s, axis=1) * qk_scale)  # finite: see _prefill_kernel
        p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        v = _load(v_ptr + offs, dm[None, :], EVEN_D)
        acc = acc * alpha[:, None] + dot_f32(p.to(v.dtype), v, F32)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit(do_not_specialize=["max_blocks"])
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    qstart_ptr,
    pos0_ptr,
    tile_req_ptr,
    tile_m0_ptr,
    qk_scale,
    max_blocks,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SUB: tl.constexpr,
    EVEN_D: tl.constexpr,
    F32: tl.constexpr,
):
    """Queries ``[m0, m0 + BLOCK_M)`` of one request (one of the ``SUB`` programs of a host
    tile), head ``h``. Program ids run over heads fastest, so the heads of one KV head, which
    read the same K/V, run side by side (in L2), and over tiles in the host's order (most keys
    first)."""
    pid = tl.program_id(0)
    h = pid % H
    t = pid // H
    kvh = h // (H // KVH)
    tile = t // SUB
    b = tl.load(tile_req_ptr + tile)
    m0 = tl.load(tile_m0_ptr + tile).to(tl.int32) + (t % SUB) * BLOCK_M
    q0 = tl.load(qstart_ptr + b)
    n = (tl.load(qstart_ptr + b + 1) - q0).to(tl.int32)
    if m0 >= n:  # a sub-tile past its run, or a CUDA graph's padded tile: nothing to do
        return
    p0 = tl.load(pos0_ptr + b).to(tl.int32)  # positions in int32, row offsets in int64
    m = m0 + tl.arange(0, BLOCK_M)
    qpos = p0 + m
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    qrows = (q0 + m).to(tl.int64) * H + h
    io_mask = (m < n)[:, None] & dm[None, :]
    q = tl.load(q_ptr + qrows[:, None] * D + d[None, :], mask=io_mask, other=0)
    # Keys below ``full`` precede every query of the tile: no mask. From ``full`` to ``hi`` (the
    # tile's last query): the causal mask. A sub-tile past the run walks nothing. Every row sees
    # a key in the first step it takes (key ``full`` <= its position; rows past the run see every
    # key below ``hi``), so its running max is finite from then on: no -inf - -inf.
    live = m0 < n
    hi = tl.where(live, p0 + tl.minimum(m0 + BLOCK_M, n), 0)
    full = tl.where(live, (p0 + m0) // BLOCK_N * BLOCK_N, 0)
    trow = tables_ptr + b.to(tl.int64) * max_blocks
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    acc, m_i, l_i = _prefill_steps(
        acc,
        m_i,
        l_i,
        q,
        qpos,
        k_ptr,
        v_ptr,
        trow,
        kvh,
        qk_scale,
        0,
        full,
        d,
        dm,
        KVH=KVH,
        D=D,
        BS=BS,
        BLOCK_N=BLOCK_N,
        DIAG=False,
        EVEN_D=EVEN_D,
        F32=F32,
    )
    acc, m_i, l_i = _prefill_steps(
        acc,
        m_i,
        l_i,
        q,
        qpos,
        k_ptr,
        v_ptr,
        trow,
        kvh,
        qk_scale,
        full,
        hi,
        d,
        dm,
        KVH=KVH,
        D=D,
        BS=BS,
        BLOCK_N=BLOCK_N,
        DIAG=True,
        EVEN_D=EVEN_D,
        F32=F32,
    )
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(
        out_ptr + qrows[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask
    )


MAX_SPLITS = 64  # splits of a request's keys, at most
INTERPRETER_SPLITS = 4  # off CUDA (Triton's interpreter): several splits, so tests cover merging


def decode_keys_per_step(dim: int) -> int:
    """Keys per decode iteration: a K and a V tile of about 8K elements each (16 KB in bf16)."""
    return 64 if dim <= 128 else 32


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def decode_splits(batch: int, kv_heads: int, device: torch.device | str) -> int:
    """How many slices (splits) of each request's keys the decode kernel runs in parallel.

    One program per (request, KV head) leaves an H200 idle at small batches (8 programs for 132
    SMs at batch 1) while each walks its whole context in sequence: the kernel is latency-bound.
    Splitting the keys gives ``batch * kv_heads * splits`` programs; aim for about two per SM
    (``2 * SMs``), rounded up to a power of two and capped at ``MAX_SPLITS``, and 1 once the batch
    alone fills the GPU (then the kernel writes its output directly, with no merge). A function
    of the batch size and the KV heads only, never of the context lengths: a CUDA graph captured
    for a batch size replays one launch shape for every context (the kernel sizes each split
    from the request's length, so short contexts leave the last splits empty, which cost only
    their launch). Off CUDA (Triton's interpreter): ``INTERPRETER_SPLITS``."""
    device = torch.device(device)
    if device.type != "cuda":
        return INTERPRETER_SPLITS
    index = torch.cuda.current_device() if device.index is None else device.index
    return splits_for(batch, kv_heads, _sm_count(index))


def splits_for(batch: int, kv_heads: int, sms: int) -> int:
    """``decode_splits`` on a GPU of ``sms`` SMs."""
    want = -(-2 * sms // max(1, batch * kv_heads))
    return max(1, min(MAX_SPLITS, triton.next_power_of_2(want)))


def _group(heads: int, kv_heads: int) -> int:
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads do not group over {kv_heads} KV heads")
    return heads // kv_heads


def _workspace(bsz: int, heads: int, splits: int, dim: int, device) -> tuple:
    """Per-split partial outputs ``[B, H, S, D]`` and log-sum-exps ``[B, H, S]``, in fp32 (under
    graph capture they come from the graph's private pool)."""
    part = torch.empty(bsz, heads, splits, dim, dtype=torch.float32, device=device)
    return part, torch.empty(bsz, heads, splits, dtype=torch.float32, device=device)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    table_width: torch.Tensor | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """``q [B, H, D]`` against each request's first ``context_lens[b]`` cached positions;
    ``block_tables`` row-major with ``table_width`` (a device scalar; default: its columns)
    ids per request, caches ``[blocks * block_size, KVH, D]``. ``splits``: slices of each
    request's keys (default ``decode_splits``); a row of context length 0 is zeros."""
    bsz, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    group = _group(heads, kv_heads)
    q = q.contiguous()
    out = torch.empty_like(q)
    if bsz == 0:
        return out
    if table_width is None:
        table_width = torch.tensor([block_tables.shape[1]], device=q.device)
    if splits is None:
        splits = decode_splits(bsz, kv_heads, q.device)
    if splits < 1:
        raise ValueError(f"splits must be >= 1, got {splits}")
    part, lse = (out, out) if splits == 1 else _workspace(bsz, heads, splits, dim, q.device)
    block_d = max(16, triton.next_power_of_2(dim))
    _decode_split_kernel[(bsz, kv_heads, splits)](
        q,
        k_cache,
        v_cache,
        block_tables.contiguous(),
        table_width,
        context_lens.contiguous(),
        part,
        lse,
        out,
        dim**-0.5,
        splits,
        H=heads,
        KVH=kv_heads,
        G=group,
        BLOCK_G=max(16, triton.next_power_of_2(group)),
        D=dim,
        BLOCK_D=block_d,
        BS=block_size,
        BLOCK_N=decode_keys_per_step(block_d),
        DIRECT=splits == 1,
        F32=k_cache.dtype == torch.float32 or interpreted(),
        num_warps=4,
        num_stages=2,  # H200, 4B shapes: 3 stages ran 10-35% slower
    )
    if splits > 1:
        _decode_merge_kernel[(bsz, heads)](
            part,
            lse,
            out,
            splits,
            H=heads,
            D=dim,
            BLOCK_D=block_d,
            BLOCK_S=triton.next_power_of_2(splits),
        )
    return out


def prefill_config(dim: int, dtype: torch.dtype) -> dict:
    """The prefill kernel's launch: ``BLOCK_M`` queries (``PREFILL_TILE``, the host tile) by
    ``BLOCK_N`` keys per step, ``num_warps``, ``num_stages``. For head dim 128 in bf16 (the 4B
    preset): a 128 x 128 Q tile (32 KB) stays in shared memory and each pipeline stage holds a K
    and a V tile of 64 x 128 (16 KB each): 96 KB in all with 2 stages (P stays in registers as
    the second product's left operand), well inside an H100/H200's 227 KB; the fp32 accumulator
    (128 x 128). K/V tiles of about 16 KB each at any head dim and element size. 4 warps and 3
    stages: on an H200 (2026-11-30, 4B shapes, one 8,192-token request, benchmarks/HISTORY.md)
    they took 1.08 ms against 1.20 (4 warps, 2 stages), 1.26 (8, 2) and 1.38 (8, 3), although
    ptxas warns that 3 stages serialise the wgmma (C7515)."""
    block_d = max(16, triton.next_power_of_2(dim))
    size = torch.finfo(dtype).bits // 8
    block_n = max(16, min(64, 16384 // (block_d * size)))
    return {"BLOCK_M": PREFILL_TILE, "BLOCK_N": block_n, "num_warps": 4, "num_stages": 3}


def _check_config(cfg: dict) -> None:
    bm, bn = cfg["BLOCK_M"], cfg["BLOCK_N"]
    if bm < 16 or bm & (bm - 1) or PREFILL_TILE % bm:
        raise ValueError(f"BLOCK_M={bm}: a power of two >= 16 dividing {PREFILL_TILE}")
    if bn < 16 or bn & (bn - 1):
        raise ValueError(f"BLOCK_N={bn}: a power of two >= 16")


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
    config: dict | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``q [T, H, D]``: request b's queries are rows ``query_start[b]:query_start[b + 1]`` at
    absolute positions from ``start_pos[b]``; each attends causally over its cached positions
    (its K/V already written). Tiles: ``engramrt.kernels.tiles.prefill_tiles``; only the
    queries in a tile are written (into ``out``, ``[>= T, H, D]``, when given). ``config``:
    keys of ``prefill_config`` to override (benchmarks and tests)."""
    tokens, heads, dim = q.shape
    kv_heads = k_cache.shape[1]
    _group(heads, kv_heads)
    q = q.contiguous()
    out = torch.empty_like(q) if out is None else out
    if tile_req.numel() == 0:
        return out
    cfg = {**prefill_config(dim, k_cache.dtype), **(config or {})}
    _check_config(cfg)
    block_d = max(16, triton.next_power_of_2(dim))
    sub = PREFILL_TILE // cfg["BLOCK_M"]
    _prefill_kernel[(tile_req.numel() * sub * heads,)](
        q,
        k_cache,
        v_cache,
        out,
        block_tables.contiguous(),
        query_start,
        start_pos,
        tile_req,
        tile_m0,
        dim**-0.5 * 1.4426950408889634,
        block_tables.shape[1],
        H=heads,
        KVH=kv_heads,
        D=dim,
        BLOCK_D=block_d,
        BS=block_size,
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        SUB=sub,
        EVEN_D=block_d == dim,
        F32=k_cache.dtype == torch.float32 or interpreted(),
        num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"],
    )
    return out
