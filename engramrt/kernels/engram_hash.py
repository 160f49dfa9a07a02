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
BLOCK_T = 32


@triton.jit
def _mod(r, p, inv_p):
    """r mod p for 0 <= r < 2**63, 2 <= p < 2**31, without a 64-bit division (which GPUs emulate
    in software). A float64 quotient is off by at most q * 2**-51, i.e. a few units when p is
    small; the remainder it leaves is then small enough that a second float64 quotient is off by
    at most one, and one correction each way makes the result exact."""
    rem = r - (r.to(tl.float64) * inv_p).to(tl.int64) * p
    rem = rem - tl.floor(rem.to(tl.float64) * inv_p).to(tl.int64) * p
    rem = tl.where(rem < 0, rem + p, rem)
    return tl.where(rem >= p, rem - p, rem)


@triton.jit(do_not_specialize=["num_tokens", "num_req", "mm_start", "verify_block", "num_real_int"])
def _engram_hash_kernel(
    tokens_ptr, slots_ptr, pos_ptr, lens_ptr, ends_ptr, num_real_ptr,
    history_ptr, token_map_ptr, mult_ptr, primes_ptr, inv_ptr, offsets_ptr, out_ptr,
    num_tokens, num_req, pad_row, pad_id, image_id, mm_start, verify_block, num_real_int,
    REAL_PTR: tl.constexpr, MODE: tl.constexpr, N: tl.constexpr, H: tl.constexpr,
    H_PAD: tl.constexpr,
    L: tl.constexpr, L_PAD: tl.constexpr, W_PAD: tl.constexpr, REQ_PAD: tl.constexpr,
    BLOCK: tl.constexpr, HAS_IMAGE: tl.constexpr, HAS_MM: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = t < num_tokens
    # --- which request, offset in its run, absolute position, history slot ---------------
    if MODE == 1:
        r = tl.arange(0, REQ_PAD)
        ends = tl.load(ends_ptr + r, mask=r < num_req, other=2**62)
        req = tl.sum((ends[None, :] <= t[:, None]).to(tl.int64), axis=1)
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
        end = tl.load(ends_ptr + req, mask=real, other=0)
        off = (t - (end - tl.load(lens_ptr + req, mask=real, other=0))).to(tl.int64)
    pos = base + off
    slot = tl.where(real, tl.load(slots_ptr + req, mask=real, other=0), pad_row).to(tl.int64)

    lay = tl.arange(0, L_PAD)
    hh = tl.arange(0, H_PAD)
    w = tl.arange(0, W_PAD)
    lay_ok = lay < L
    cols = (N - 1) * H
    blocked = ~real
    acc = tl.zeros((BLOCK, L_PAD), dtype=tl.int64)
    new_row = tl.zeros((BLOCK, W_PAD), dtype=tl.int64)
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
        comp = tl.load(token_map_ptr + tl.where(blocked, pad_id, src))
        mult = tl.load(mult_ptr + lay * N + s, mask=lay_ok, other=0)
        prod = comp[:, None] * mult[None, :]
        acc = prod if s == 0 else acc ^ prod
        if s > 0:
            g = (s - 1) * H + hh
            p = tl.load(
                primes_ptr + lay[:, None] * cols + g[None, :],
                mask=lay_ok[:, None] & (hh < H)[None, :],
                other=1,
            )
            o = tl.load(
                offsets_ptr + lay[:, None] * cols + g[None, :],
                mask=lay_ok[:, None] & (hh < H)[None, :],
                other=0,
            )
            inv = tl.load(
                inv_ptr + lay[:, None] * cols + g[None, :],
                mask=lay_ok[:, None] & (hh < H)[None, :],
                other=1.0,
            )
            ids = _mod(acc[:, :, None], p[None, :, :], inv[None, :, :]) + o[None, :, :]
            dst = (
                out_ptr
                + t[:, None, None] * (L * cols)
                + lay[None, :, None] * cols
                + g[None, None, :]
            )
            ok = in_range[:, None, None] & lay_ok[None, :, None] & (hh < H)[None, None, :]
            tl.store(dst, ids, mask=ok)
        if MODE == 0 and s < N - 1:  # shift s is entry N-2-s of the new row (0 before start)
            new_row = tl.where(w[None, :] == N - 2 - s, tl.where(pos < s, 0, src)[:, None], new_row)
    if MODE == 0:
        tl.store(
            history_ptr + slot[:, None] * (N - 1) + w[None, :],
            new_row.to(tl.int32),
            mask=real[:, None] & (w < N - 1)[None, :],
        )


@triton.jit(do_not_specialize=["num_req", "num_real_int"])
def _commit_rows_kernel(
    history_ptr, tokens_ptr, slots_ptr, starts_ptr, lens_ptr, pos_ptr, num_real_ptr, num_req,
    num_real_int, N: tl.constexpr, W_PAD: tl.constexpr, REAL_PTR: tl.constexpr,
):  # fmt: skip
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
        self.inv_primes = 1.0 / self.primes.double()
        self.offsets = hasher.offsets.reshape(layers, -1).contiguous()
        cfg = hasher.layout.config
        self.image = -1 if cfg.image_token_id is None else cfg.image_token_id
        self.mm = -1 if hasher.mm_pad_start is None else hasher.mm_pad_start

    def hash(self, mode: int, tokens, slots, positions, lens=None, ends=None, num_real=None,
             verify_block: int = 1) -> torch.Tensor:  # fmt: skip
        h, dev = self.h, tokens.device
        tokens, slots, positions = (x.contiguous() for x in (tokens, slots, positions))
        lens = None if lens is None else lens.contiguous()
        ends = None if ends is None else ends.contiguous()
        t = tokens.numel()
        out = torch.empty(t, self.layers, (self.n - 1) * self.heads, dtype=torch.int64, device=dev)
        if t == 0:
            return out
        nreq = slots.numel()
        real_ptr = isinstance(num_real, torch.Tensor)  # a device tensor keeps graphs replayable
        dummy = slots
        _engram_hash_kernel[(triton.cdiv(t, BLOCK_T),)](
            tokens, slots, positions, lens if lens is not None else dummy,
            ends if ends is not None else dummy, num_real if real_ptr else dummy,
            h.history.table, h.token_map, self.mults, self.primes, self.inv_primes, self.offsets,
            out,
            t, nreq, h.history.pad_row, h.layout.config.pad_token_id, self.image, self.mm,
            verify_block, nreq if num_real is None or real_ptr else int(num_real),
            REAL_PTR=real_ptr, MODE=mode, N=self.n, H=self.heads, H_PAD=_pow2(self.heads),
            L=self.layers,
            L_PAD=_pow2(self.layers), W_PAD=_pow2(self.n - 1),
            REQ_PAD=_pow2(nreq) if mode == EXTEND else 1,
            BLOCK=BLOCK_T, HAS_IMAGE=self.image >= 0, HAS_MM=self.mm >= 0,
        )  # fmt: skip
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
            self.h.history.table, tokens, slots, starts, lens, first_pos,
            num_real if real_ptr else slots, nreq,
            nreq if num_real is None or real_ptr else int(num_real),
            N=self.n, W_PAD=_pow2(self.n - 1), REAL_PTR=real_ptr,
        )  # fmt: skip
