"""Per-forward state shared by every layer: where each request's tokens sit, its KV cache, the
Engram inputs, and which Engram layers ran (so a skipped one is an error, not silence)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from engramrt.kernels.tiles import PREFILL_TILE, prefill_tiles
from engramrt.model.layers import rope_tables
from engramrt.model.trace import Tracer
from engramrt.transfer import to_device

NO_TILE = 1 << 30  # a padded prefill tile's first query: past every run, so it walks nothing


@dataclass(frozen=True)
class GraphShape:
    """The static shape a captured CUDA graph replays: a decode step of ``requests`` one-token
    runs, or a mixed step (prefill chunks and decode rows) of up to ``tokens`` tokens in up to
    ``requests`` runs, whose prefill kernel launches ``tiles`` tiles (every run's tiles fit:
    a run of ``n`` tokens has ``ceil(n / PREFILL_TILE)``, so ``tokens // PREFILL_TILE +
    requests`` bounds them all)."""

    decode: bool
    tokens: int
    requests: int
    verify: int = 0  # a verify graph: every run is an anchor and this many drafts

    @property
    def tiles(self) -> int:
        return 0 if self.decode else self.tokens // PREFILL_TILE + self.requests

    def fits(self, run_lens: list[int]) -> bool:
        if self.verify:
            return len(run_lens) <= self.requests and all(n == 1 + self.verify for n in run_lens)
        if self.decode:
            return len(run_lens) <= self.requests and all(n == 1 for n in run_lens)
        return len(run_lens) <= self.requests and sum(run_lens) <= self.tokens

    def check(self, run_lens: list[int]) -> None:
        if not self.fits(run_lens):
            kind = "one-token runs" if self.decode else f"at most {self.tokens} tokens"
            raise ValueError(
                f"runs {run_lens[:8]}... do not fit a graph of {self.requests} requests ({kind})"
            )


class KVCache:
    """Paged K/V for the layers one process owns: ``[num_blocks * block_size, kv, hd]`` per layer,
    and the block table of each slot, kept on the host from step to step so a step sends only
    the blocks a request gained (``set_tables``). Until told otherwise, slot ``s`` owns blocks
    ``[s * per_slot, (s + 1) * per_slot)`` (``slot_table``), where the cache has them."""

    def __init__(
        self,
        layer_ids: list[int],
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_len: int,
        num_slots: int | None = None,
    ):
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.num_blocks, self.block_size, self.max_len = num_blocks, block_size, max_len
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        per = self.blocks_per_seq
        rows = max(1, num_blocks // per if num_slots is None else num_slots)
        self.tables = np.zeros((rows, per), dtype=np.int64)
        self.table_lens = np.zeros(rows, dtype=np.int64)
        fixed = min(rows, num_blocks // per)  # the slots whose fixed blocks exist
        self.tables[:fixed] = np.arange(fixed * per).reshape(fixed, per)
        self.table_lens[:fixed] = per

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))

    def set_tables(
        self, slots: list[int], starts: list[int] | None, blocks: list[list[int]]
    ) -> None:
        """Slot ``slots[b]``'s table becomes its first ``starts[b]`` blocks (default 0) followed
        by ``blocks[b]``. Only the given blocks are checked and copied: O(new blocks)."""
        for b, (slot, new) in enumerate(zip(slots, blocks, strict=True)):
            start = 0 if starts is None else starts[b]
            if not 0 <= slot < len(self.tables):
                raise ValueError(f"slot {slot} outside the cache's {len(self.tables)} tables")
            if not 0 <= start <= self.table_lens[slot] or start + len(new) > self.blocks_per_seq:
                raise ValueError(
                    f"request {b}: {len(new)} blocks at {start} do not extend its table of "
                    f"{self.table_lens[slot]} (at most {self.blocks_per_seq})"
                )
            if new and not 0 <= min(new) <= max(new) < self.num_blocks:
                raise ValueError(
                    f"request {b}: block table {new} has ids outside [0, {self.num_blocks})"
                )
            self.tables[slot, start : start + len(new)] = new
            self.table_lens[slot] = start + len(new)

    @property
    def blocks_per_seq(self) -> int:
        return -(-self.max_len // self.block_size)

    def slot_table(self, slot: int) -> list[int]:
        per = self.blocks_per_seq
        if (slot + 1) * per > self.num_blocks:
            raise ValueError(f"slot {slot} has no blocks in a cache of {self.num_blocks} blocks")
        return list(range(slot * per, (slot + 1) * per))

    def token_slots(self, table: list[int], start: int, end: int, device) -> torch.Tensor:
        """Flat cache rows of positions ``[start, end)`` under block table ``table``."""
        pos = torch.arange(start, end, device=device)
        blocks = torch.tensor(table, dtype=torch.int64, device=device)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size


@dataclass
class ForwardContext:
    """Request ``b`` owns the next ``run_lens[b]`` tokens of the flat batch, at absolute positions
    from ``start_pos[b]``, in KV/history slot ``slots[b]``. The host lists drive validation and
    the torch path; the tensors, views of one buffer ``flat`` on the model's device (one copy per
    step), drive the kernels and are what a captured CUDA graph reads."""

    slots: list[int]
    run_lens: list[int]
    start_pos: list[int]
    kv: KVCache
    flat: torch.Tensor  # every tensor below, int64, back to back
    tokens: torch.Tensor  # [T] (zeros on later pipeline stages)
    slot_ids: torch.Tensor  # [B] history slots
    positions: torch.Tensor  # [T]
    slot_mapping: torch.Tensor  # [T] cache row of each token; -1: a padded row, written nowhere
    block_table: torch.Tensor  # [B, W] block ids, zero-padded
    context_lens: torch.Tensor  # [B] start_pos + run_len; 0 for a padded row
    query_start: torch.Tensor  # [B + 1] where each run begins in the flat batch
    start_pos_t: torch.Tensor  # [B]
    num_real: torch.Tensor  # [1] rows at or past it are CUDA-graph padding
    table_width: torch.Tensor  # [1] W, the block table's row stride
    decode: bool = False  # one token per request: the decode kernels, the hasher's decode mode
    tiles: tuple[torch.Tensor, torch.Tensor] | None = None  # prefill kernel tiles (req, m0)
    token_slots: torch.Tensor | None = None  # [T] history slot of each token (not decode)
    # a mixed step's one-token runs, for the decode kernel: their token rows (T: padding),
    # requests and context lengths
    dec_tok: torch.Tensor | None = None
    dec_req: torch.Tensor | None = None
    dec_lens: torch.Tensor | None = None
    logits_rows: torch.Tensor | None = None  # [B] each run's last token: the rows to sample
    # [B] 0 for a verify run (anchor + drafts), which commits no history when hashed
    commit_runs: torch.Tensor | None = None
    hash_ids: torch.Tensor | None = None  # [T, L, (N-1)*H]
    dead: torch.Tensor | None = None  # [T] image tokens
    tracer: Tracer | None = None
    engram_ran: list[int] = field(default_factory=list)
    # layer id -> (Engram rows, the event that marks them ready): ``engramrt.engram.prefetch``
    prefetched: dict = field(default_factory=dict)
    # per-step tensors the first layer that asks computes (in a CUDA graph: once per replay)
    step_cache: dict = field(default_factory=dict)

    @classmethod
    def for_runs(
        cls,
        slots: list[int],
        run_lens: list[int],
        start_pos: list[int],
        kv: KVCache,
        device: torch.device | str,
        tokens: list[int] | None = None,
        width: int | None = None,
        pad: GraphShape | None = None,
        last_rows: bool = False,
        drafts: list[int] | None = None,
        **kw,
    ) -> ForwardContext:
        """Validate on the host, build every tensor there and move them in one copy. Block
        tables are the slots' tables in ``kv`` (``KVCache.set_tables``). ``width`` fixes the
        block-table columns (default: the widest table); ``pad`` pads the step to a captured
        graph's shape (``GraphShape``); ``last_rows``: the logits are wanted at each run's last
        token only (``logits_rows``), not at every token; ``drafts``: the last ``1 + drafts[b]``
        tokens of run b are sampled (speculative decoding; eager steps only)."""
        bsz, n_tok = len(slots), sum(run_lens)
        if not len(run_lens) == len(start_pos) == bsz:
            raise ValueError("slots, run_lens and start_pos differ in length")
        i64 = np.int64
        ids = np.asarray(slots, dtype=i64).reshape(-1)
        if bsz and not 0 <= ids.min() <= ids.max() < len(kv.tables):
            raise ValueError(f"slots {slots} lie outside the cache's {len(kv.tables)} tables")
        sizes = kv.table_lens[ids]
        width = max(1, int(sizes.max()) if bsz else 1) if width is None else width
        table = kv.tables[ids, :width]  # a copy: later steps may change kv's
        lens = np.asarray(run_lens, dtype=i64).reshape(-1)
        pos0 = np.asarray(start_pos, dtype=i64).reshape(-1)
        over = pos0 + lens > np.minimum(sizes * kv.block_size, kv.max_len)
        for b in np.flatnonzero(over | (lens < 0) | (pos0 < 0)).tolist():
            if lens[b] < 0 or pos0[b] < 0:
                raise ValueError(f"request {b}: negative run length or start position")
            cap = min(kv.max_len, int(sizes[b]) * kv.block_size)
            raise ValueError(
                f"positions up to {start_pos[b] + run_lens[b]} exceed the request's KV capacity "
                f"({cap} tokens)"
            )
        req = np.repeat(np.arange(bsz, dtype=i64), lens)
        qstart = np.concatenate([np.zeros(1, i64), np.cumsum(lens)])
        positions = pos0[req] + np.arange(len(req), dtype=i64) - qstart[req]
        rows = table[req, positions // kv.block_size] * kv.block_size + positions % kv.block_size
        toks = np.asarray(tokens if tokens is not None else np.zeros(len(req)), dtype=i64)
        ctx_lens = pos0 + lens
        decode = all(n == 1 for n in run_lens) if pad is None else pad.decode
        if pad is not None:
            pad.check(run_lens)
            extra_t, extra_r = pad.tokens - n_tok, pad.requests - bsz

            def grow(a: np.ndarray, by: int, value: int) -> np.ndarray:
                return np.concatenate([a, np.full((by, *a.shape[1:]), value, dtype=i64)])

            # a padded token is written nowhere (cache row -1), hashes as padding and commits
            # nothing; a padded request has no keys (context 0) and, in a decode graph, owns
            # one padded token at slot 0, in a mixed graph none (a run of 0 tokens)
            toks, positions = grow(toks, extra_t, 0), grow(positions, extra_t, 0)
            rows, req = grow(rows, extra_t, -1), grow(req, extra_t, 0)
            ids, pos0, ctx_lens = (grow(a, extra_r, 0) for a in (ids, pos0, ctx_lens))
            table = grow(table, extra_r, 0)
            step = 1 if decode else pad.verify + 1 if pad.verify else 0
            qstart = np.concatenate([qstart, qstart[-1] + step * np.arange(1, extra_r + 1)])
            bsz = pad.requests
        # the block table goes last, so a graph's static buffer (sized for the widest table)
        # takes any narrower step as a prefix copy; kernels read the width from ``table_width``
        parts = [toks, ids, positions, rows, ctx_lens, qstart, pos0, np.array([len(slots)]),
                 np.array([width])]  # fmt: skip
        if not decode:  # prompt chunks in tiles, one-token runs for the decode kernel
            long = [n if n > 1 else 0 for n in run_lens]
            tiles = [np.asarray(v, dtype=i64) for v in prefill_tiles(long, start_pos)]
            one = np.flatnonzero(lens == 1)
            dec = [qstart[one], one, ctx_lens[one]]
            if pad is not None:  # tiles past every run walk nothing; entries past the real
                tiles = [grow(tiles[0], pad.tiles - len(tiles[0]), 0),  # ones have no keys
                         grow(tiles[1], pad.tiles - len(tiles[1]), NO_TILE)]  # fmt: skip
                extra = pad.requests - len(one)
                dec = [grow(dec[0], extra, len(toks)), grow(dec[1], extra, 0),
                       grow(dec[2], extra, 0)]  # fmt: skip
            parts += [*tiles, ids[req], *dec]
        sample_rows = last_rows and not decode
        verifying = drafts is not None or (pad is not None and pad.verify > 0)
        if pad is not None and pad.verify:  # every run verifies (padded ones too: no commit)
            parts.append(np.zeros(bsz, dtype=i64))
            parts.append(np.arange(len(toks), dtype=i64))  # a sample after every token
            sample_rows = True
        elif drafts is not None:
            if pad is not None:
                raise ValueError("a step with drafts replays a verify graph or none")
            tails = np.asarray(drafts, dtype=i64) + 1
            parts.append((tails == 1).astype(i64))
            if sample_rows:  # run b's last tails[b] tokens
                first = np.repeat(qstart[1:] - tails, tails)
                j = np.arange(tails.sum()) - np.repeat(np.cumsum(tails) - tails, tails)
                parts.append(np.maximum(first + j, 0))
        elif sample_rows:
            parts.append(np.maximum(qstart[1:] - 1, 0))
        parts.append(table.reshape(-1))
        # every view starts 16-byte aligned: Triton specialises pointer arguments on it, so a
        # view at an odd int64 offset (odd token or request counts) would compile another
        # variant of each kernel that reads it, in the middle of serving
        sizes = [len(a) for a in parts]
        offsets = np.cumsum([0] + [n + n % 2 for n in sizes])
        host = np.zeros(int(offsets[-1]), dtype=i64)
        for a, o in zip(parts, offsets, strict=False):
            host[o : o + len(a)] = a
        flat = to_device(torch.from_numpy(host), device)  # asynchronous: see engramrt.transfer
        views = [flat[o : o + n] for o, n in zip(offsets, sizes, strict=False)]
        ctx = cls(
            list(slots), list(run_lens), list(start_pos), kv, flat, *views[:4],
            views[-1].view(bsz, width), *views[4:9], decode=decode, **kw,
        )  # fmt: skip
        if not decode:
            ctx.tiles, ctx.token_slots = (views[9], views[10]), views[11]
            ctx.dec_tok, ctx.dec_req, ctx.dec_lens = views[12:15]
        if sample_rows:
            ctx.logits_rows = views[-2]
        if verifying:
            ctx.commit_runs = views[-3 if sample_rows else -2]
        return ctx

    def rope(self, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's rotary cos/sin rows, computed by the first layer that asks (in a CUDA
        graph: once per replay, not once per layer)."""
        key = (head_dim, theta)
        if key not in self.step_cache:
            self.step_cache[key] = rope_tables(self.positions, head_dim, theta)
        return self.step_cache[key]

    def decode_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A mixed step's one-token runs: token rows, block tables, context lengths."""
        if "decode_rows" not in self.step_cache:
            table = self.block_table[self.dec_req]
            self.step_cache["decode_rows"] = (self.dec_tok, table, self.dec_lens)
        return self.step_cache["decode_rows"]

    def engram_inputs(self, layer_id: int, index: int) -> torch.Tensor:
        if self.hash_ids is None:
            raise RuntimeError(f"layer {layer_id} owns an Engram but the forward got no hash ids")
        return self.hash_ids[:, index]

    def trace(self, event: str, layer_id: int, tensor: torch.Tensor) -> None:
        if self.tracer is not None:
            self.tracer(event, layer_id, tensor)
