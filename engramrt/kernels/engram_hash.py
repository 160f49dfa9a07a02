"""One-launch Engram hashing for decode, extend and verify batches.

Each program hashes a block of tokens. Per token it finds its request (decode: the row itself;
verify: ``t // block``; extend: a vectorised search over the run ends), reads its N-1
predecessors from earlier tokens of the batch or from the request's history row, applies the
cumulative blocking, and writes all ``L x (N-1) x H`` ids. In decode mode the same program then
writes the request's new history row, after all its reads, so a decode step is one launch (one
CUDA-graph node); rows past ``num_real`` are graph padding and write nothing, even when they
alias a live slot. Extend and verify only read history: a chunk's tokens are spread over several
programs, and a program that committed early would hand a half-updated row to the others, so
their commits are separate launches, ordered after the hashing on the same stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

DECODE, EXTEND, VERIFY = 0, 1, 2
# (tokens per program, warps per program) by mode
LAUNCH = {DECODE: (32, 4), EXTEND: (32, 4), VERIFY: (32, 4)}


@triton.jit
def _mod(r, p, magic):
    """r mod p for 0 <= r < 2**63, 2 <= p < 2**31, without a division (GPUs emulate 64-bit ones
    in software): Barrett reduction with ``magic = (2**64 - 1) // p``. The quotient it gives,
    the high word of r * magic, is at most one short (r * magic / 2**64 > r / p - 1 for
    r < 2**63), so one correction makes the remainder exact."""
    q = tl.umulhi(r.to(tl.uint64), magic.to(tl.uint64)).to(tl.int64)
    rem = r - q * p
    return tl.where(rem >= p, rem - p, rem)


@triton.jit(do_not_specialize=["num_tokens", "num_req", "mm_start", "verify_block", "num_real_int"])
def _engram_hash_kernel(
    tokens_ptr,
    slots_ptr,
    pos_ptr,
    lens_ptr,
    starts_ptr,
    num_real_ptr,
    history_ptr,
    token_map_ptr,
    mult_ptr,
    primes_ptr,
    magic_ptr,
    offsets_ptr,
    out_ptr,
    num_tokens,
    num_req,
    pad_row,
    pad_id,
    image_id,
    mm_start,
    verify_block,
    num_real_int,
    REAL_PTR: tl.constexpr,
    MODE: tl.constexpr,
    N: tl.constexpr,
    H: tl.constexpr,
    H_PAD: tl.constexpr,
    L: tl.constexpr,
    L_PAD: tl.constexpr,
    N_PAD: tl.constexpr,
    REQ_PAD: tl.constexpr,
    BLOCK: tl.constexpr,
    HAS_IMAGE: tl.constexpr,
    HAS_MM: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = t < num_tokens
    # --- which request, offset in its run, absolute position, history slot ---------------
    if MODE == 1:  # run ends from the lengths; program 0 hands the run starts to the commit
        r = tl.arange(0, REQ_PAD)
        n = tl.load(lens_ptr + r, mask=r < num_req, other=0).to(tl.int64)
        ends = tl.where(r < num_req, tl.cumsum(n, 0), 2**62)
        if tl.program_id(0) == 0:
            tl.store(starts_ptr + r, ends - n, mask=r < num_req)
        before = ends[None, :] <= t[:, None]
        req = tl.sum(before.to(tl.int64), axis=1)
        run_start = tl.max(tl.where(before, ends[None, :], 0), axis=1)
        real = in_range & (req < num_req)
    else:
        req = t.to(tl.int64) if MODE == 0 else (t // verify_block).to(tl.int64)
        num_real = tl.load(num_real_ptr) if REAL_PTR else num_real_int
        real = in_range & (req < num_real)
    req = tl.where(real, req, 0)
    base = tl.load(pos_ptr + req, mask=real, other=0)
    if MODE == 0:
        off = tl.zeros((BLOCK,), dtype=tl.int64)
    elif MODE == 2:
        off = (t - req * verify_block).to(tl.int64)
    else:
        off = t - run_start
    pos = base + off
    slot = tl.where(real, tl.load(slots_ptr + req, mask=real, other=0), pad_row).to(tl.int64)

    # --- every load before the one store (a load after a store may alias it, so the compiler
    # keeps them in order) -------------------------------------------------------------------
    lay = tl.arange(0, L_PAD)
    nn = tl.arange(0, N_PAD)
    blocked = ~real
    acc = tl.zeros((BLOCK, L_PAD), dtype=tl.int64)
    grams = tl.zeros((BLOCK, L_PAD, N_PAD), dtype=tl.int64)  # [.., s]: XOR of shifts 0..s
    new_row = tl.zeros((BLOCK, N_PAD), dtype=tl.int64)
    for s in tl.static_range(N):
        if s == 0:
            src = tl.load(tokens_ptr + t, mask=in_range, other=0).to(tl.int64)
        else:
            from_batch = off >= s
            earlier = tl.load(tokens_ptr + t - s, mask=real & from_batch, other=0).to(tl.int64)
            col = N - 1 - s + off
            stored = tl.load(history_ptr + slot * (N - 1) + col, mask=real & ~from_batch, other=0)
            src = tl.where(from_batch, earlier, stored.to(tl.int64))
        dead = tl.zeros((BLOCK,), dtype=tl.int1)
        if HAS_IMAGE:
            dead = dead | (src == image_id)
        if HAS_MM:
            dead = dead | (src >= mm_start)
        blocked = blocked | (pos < s) | dead
        comp = tl.load(token_map_ptr + tl.where(blocked, pad_id, src), eviction_policy="evict_last")
        mult = tl.load(mult_ptr + lay * N + s, mask=lay < L, other=0)
        acc = acc ^ (comp[:, None] * mult[None, :])
        grams = tl.where(nn[None, None, :] == s, acc[:, :, None], grams)
        if MODE == 0 and s < N - 1:  # shift s is entry N-2-s of the new row (0 before start)
            kept = tl.where(pos < s, 0, src)
            new_row = tl.where(nn[None, :] == N - 2 - s, kept[:, None], new_row)
    # column (s - 1) * H + h of layer l holds n-gram s (s >= 1), head h: [L_PAD, N_PAD, H_PAD]
    sh = nn[None, :, None]
    hh = tl.arange(0, H_PAD)[None, None, :]
    cols = (N - 1) * H
    col_of = lay[:, None, None] * cols + (sh - 1) * H + hh
    col_ok = (lay < L)[:, None, None] & (sh >= 1) & (sh < N) & (hh < H)
    p = tl.load(primes_ptr + col_of, mask=col_ok, other=1)
    magic = tl.load(magic_ptr + col_of, mask=col_ok, other=0)
    o = tl.load(offsets_ptr + col_of, mask=col_ok, other=0)
    ids = _mod(grams[:, :, :, None], p[None], magic[None]) + o[None]
    # --- one store: a token's L x (N-1) x H ids are contiguous -------------------------------
    dst = out_ptr + t[:, None, None, None] * (L * cols) + col_of[None]
    # streamed past L2, which keeps the token map (a 131k-token prefill writes 50 MB of ids)
    tl.store(
        dst, ids, mask=in_range[:, None, None, None] & col_ok[None], eviction_policy="evict_first"
    )
    if MODE == 0:
        tl.store(
            history_ptr + slot[:, None] * (N - 1) + nn[None, :],
            new_row.to(tl.int32),
            mask=real[:, None] & (nn < N - 1)[None, :],
        )


@triton.jit(do_not_specialize=["num_req", "num_real_int"])
def _commit_rows_kernel(
    history_ptr,
    tokens_ptr,
    slots_ptr,
    starts_ptr,
    lens_ptr,
    pos_ptr,
    num_real_ptr,
    num_req,
    num_real_int,
    N: tl.constexpr,
    W_PAD: tl.constexpr,
    REAL_PTR: tl.constexpr,
):
    """One program per request: its new row is the ``N-1`` ids that end at token
    ``starts + lens - 1`` of the window (old row ++ batch tokens from ``starts``); ``lens == 0``
    keeps the row. Extend: starts = run start, lens = run length. Verify: lens = 1 + accepted."""
    b = tl.program_id(0)
    w = tl.arange(0, W_PAD)
    lane = w < N - 1
    bb = b + tl.zeros((W_PAD,), dtype=tl.int64)  # vectors throughout: masks must be tensors
    num_real = tl.load(num_real_ptr) if REAL_PTR else num_real_int
    live = lane & (bb < num_real) & (bb < num_req)
    n = tl.load(lens_ptr + bb, mask=live, other=0)
    live = live & (n > 0)
    slot = tl.load(slots_ptr + bb, mask=live, other=0).to(tl.int64)
    start = tl.load(starts_ptr + bb, mask=live, other=0)
    last_pos = tl.load(pos_ptr + bb, mask=live, other=0) + n - 1  # position of the last committed
    j = n + w  # index into the window: old row is [0, N-1), batch tokens follow
    from_batch = j >= N - 1
    tok = tl.load(tokens_ptr + start + j - (N - 1), mask=live & from_batch, other=0)
    old = tl.load(history_ptr + slot * (N - 1) + j, mask=live & ~from_batch, other=0)
    row = tl.where(from_batch, tok.to(tl.int64), old.to(tl.int64))
    row = tl.where(last_pos - (N - 2 - w) < 0, 0, row)  # before the request's first token
    tl.store(history_ptr + slot * (N - 1) + w, row.to(tl.int32), mask=live)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


class TritonHashOps:
    """The kernel launches behind ``EngramHasher`` on CUDA; same inputs, same results."""

    def __init__(self, hasher):
        self.h = hasher
        n, layers, heads = hasher.n, hasher.layout.config.num_layers, hasher.layout.config.n_heads
        self.n, self.layers, self.heads = n, layers, heads
        self.mults = hasher.mults.contiguous()
        self.primes = hasher.primes.reshape(layers, -1).contiguous()
        self.magic = torch.tensor(
            [[(2**64 - 1) // p for p in row] for row in self.primes.tolist()],
            dtype=torch.int64,
            device=self.primes.device,
        )
        self.offsets = hasher.offsets.reshape(layers, -1).contiguous()
        cfg = hasher.layout.config
        self.image = -1 if cfg.image_token_id is None else cfg.image_token_id
        self.mm = -1 if hasher.mm_pad_start is None else hasher.mm_pad_start

    def hash(
        self,
        mode: int,
        tokens,
        slots,
        positions,
        lens=None,
        starts_out=None,
        num_real=None,
        verify_block: int = 1,
    ) -> torch.Tensor:
        """Extend: ``lens`` per run; the run starts are written to ``starts_out`` (for the
        commit), unless no token is hashed."""
        h, dev = self.h, tokens.device
        tokens, slots, positions = (x.contiguous() for x in (tokens, slots, positions))
        lens = None if lens is None else lens.contiguous()
        t = tokens.numel()
        out = torch.empty(t, self.layers, (self.n - 1) * self.heads, dtype=torch.int64, device=dev)
        if t == 0:
            return out
        nreq = slots.numel()
        real_ptr = isinstance(num_real, torch.Tensor)  # a device tensor keeps graphs replayable
        dummy = slots
        block, warps = LAUNCH[mode]
        _engram_hash_kernel[(triton.cdiv(t, block),)](
            tokens,
            slots,
            positions,
            lens if lens is not None else dummy,
            starts_out if starts_out is not None else dummy,
            num_real if real_ptr else dummy,
            h.history.table,
            h.token_map,
            self.mults,
            self.primes,
            self.magic,
            self.offsets,
            out,
            t,
            nreq,
            h.history.pad_row,
            h.layout.config.pad_token_id,
            self.image,
            self.mm,
            verify_block,
            nreq if num_real is None or real_ptr else int(num_real),
            REAL_PTR=real_ptr,
            MODE=mode,
            N=self.n,
            H=self.heads,
            H_PAD=_pow2(self.heads),
            L=self.layers,
            L_PAD=_pow2(self.layers),
            N_PAD=_pow2(self.n),
            REQ_PAD=_pow2(nreq) if mode == EXTEND else 1,
            BLOCK=block,
            HAS_IMAGE=self.image >= 0,
            HAS_MM=self.mm >= 0,
            num_warps=warps,
        )
        return out

    def commit(self, tokens, slots, starts, lens, first_pos, num_real=None) -> None:
        nreq = slots.numel()
        if nreq == 0:
            return
        tokens, slots, starts, lens, first_pos = (
            x.contiguous() for x in (tokens, slots, starts, lens, first_pos)
        )
        real_ptr = isinstance(num_real, torch.Tensor)
        _commit_rows_kernel[(nreq,)](
            self.h.history.table,
            tokens,
            slots,
            starts,
            lens,
            first_pos,
            num_real if real_ptr else slots,
            nreq,
            nreq if num_real is None or real_ptr else int(num_real),
            N=self.n,
            W_PAD=_pow2(self.n - 1),
            REAL_PTR=real_ptr,
        )
