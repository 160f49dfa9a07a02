"""Per-forward state shared by every layer: where each request's tokens sit, its KV cache, the
Engram inputs, and which Engram layers ran (so a skipped one is an error, not silence)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from engramrt.kernels.tiles import PREFILL_TILE, prefill_tiles
from engramrt.model.block_tables import BlockTables
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


class PagedCache:
    """What every family's cache shares: paged blocks of ``block_size`` tokens for ``num_slots``
    sequences of up to ``max_len`` tokens (which blocks each holds is the ``SlotTable``'s:
    ``engramrt.model.block_tables``). A family's cache adds its tensors and ``nbytes``."""

    num_snapshots = 0  # per-request state kept apart from the blocks (V4.1's window snapshots)

    def __init__(
        self, num_blocks: int, block_size: int, max_len: int, num_slots: int | None = None
    ):
        self.num_blocks, self.block_size, self.max_len = num_blocks, block_size, max_len
        per = -(-max_len // block_size)
        self.num_slots = max(1, num_blocks // per if num_slots is None else num_slots)

    @property
    def nbytes(self) -> int:
        return 0

    def fixed_tables(self) -> BlockTables:
        """Block tables for this cache with each slot on its fixed blocks (``BlockTables``)."""
        return BlockTables(self.num_slots, self.num_blocks, self.block_size, self.max_len)

    def save_windows(self, saves: list[tuple[int, int]]) -> None:
        """(slot, snapshot) pairs: per-request state a prefix hit restores (none here)."""
        if saves:
            raise ValueError("this cache keeps no snapshots")


@dataclass
class ForwardContext:
    """Request ``b`` owns the next ``run_lens[b]`` tokens of the flat batch, at absolute positions
    from ``start_pos[b]``, in KV/history slot ``slots[b]``. The host lists drive validation and
    the torch path; the tensors, views of one buffer ``flat`` on the model's device (one copy per
    step), drive the kernels and are what a captured CUDA graph reads."""

    slots: list[int]
    run_lens: list[int]
    start_pos: list[int]
    kv: PagedCache
    flat: torch.Tensor  # every tensor below, int64, back to back
    slot_ids: torch.Tensor  # [B] history slots
    positions: torch.Tensor  # [T]
    token_req: torch.Tensor  # [T] each token's run (a padded token: run 0, written nowhere)
    slot_mapping: torch.Tensor  # [T] cache row of each token; -1: a padded row, written nowhere
    block_table: torch.Tensor  # [B, W] block ids, zero-padded
    context_lens: torch.Tensor  # [B] start_pos + run_len; 0 for a padded row
    query_start: torch.Tensor  # [B + 1] where each run begins in the flat batch
    start_pos_t: torch.Tensor  # [B]
    num_real: torch.Tensor  # [1] rows at or past it are CUDA-graph padding
    table_width: torch.Tensor  # [1] W, the block table's row stride
    decode: bool = False  # one token per request: the decode kernels, the hasher's decode mode
    padded: bool = False  # a CUDA graph's step: shapes may not depend on the runs (V4.1's scans)
    token_rows: bool = False  # a verify graph's: every token a decode row (``_Runs.mixed``)
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
    # [B] 1: the run starts behind a verify run in flight, counting its drafts as accepted
    # (``engramrt.runner.verify``: the stage moves it back); None: no run lags
    lag: torch.Tensor | None = None
    hash_ids: torch.Tensor | None = None  # [T, L, (N-1)*H]
    dead: torch.Tensor | None = None  # [T] image tokens
    # ([T] each token's row of the image-span rows or -1, the rows [N, D]): an image's span
    # embedded by the family's encoder (``EngramMHCModel.embed_tokens``); None: text only
    images: tuple[torch.Tensor, torch.Tensor] | None = None
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
        kv: PagedCache,
        tables: BlockTables,
        device: torch.device | str,
        width: int | None = None,
        pad: GraphShape | None = None,
        last_rows: bool = False,
        drafts: list[int] | None = None,
        lag: list[int] | None = None,
        **kw,
    ) -> ForwardContext:
        """Validate on the host, build every tensor there and move them in one copy. Block tables
        are the slots' rows of ``tables`` (the stage's ``SlotTable.blocks``). ``width`` fixes the
        block-table columns (default: the widest table); ``pad`` pads the step to a captured graph's
        shape (``GraphShape``); ``last_rows``: the logits are wanted at each run's last token only
        (``logits_rows``), not at every token; ``drafts``: the last ``1 + drafts[b]`` tokens of run
        b are sampled (speculative decoding; eager steps only)."""
        runs = _Runs.of(slots, run_lens, start_pos, tables, width)
        decode = all(n == 1 for n in run_lens) if pad is None else pad.decode
        if pad is not None:
            runs = runs.padded(pad, decode)
        parts = runs.common()
        if not decode:  # prompt chunks in tiles, one-token runs for the decode kernel
            parts.update(runs.mixed(pad))
        sample_rows = last_rows and not decode
        if pad is not None and pad.verify:  # every run verifies (padded ones too: no commit)
            parts["commit_runs"] = np.zeros(runs.bsz, dtype=np.int64)
            parts["logits_rows"] = np.arange(len(runs.req), dtype=np.int64)  # a sample a token
        elif drafts is not None:
            if pad is not None:
                raise ValueError("a step with drafts replays a verify graph or none")
            parts.update(runs.verify(drafts, sample_rows))
        elif sample_rows:
            parts["logits_rows"] = np.maximum(runs.qstart[1:] - 1, 0)
        if lag is not None:
            parts["lag"] = np.zeros(runs.bsz, dtype=np.int64)
            parts["lag"][: len(lag)] = lag
        # the block table goes last, so a graph's static buffer (sized for the widest table)
        # takes any narrower step as a prefix copy; kernels read the width from ``table_width``
        parts["block_table"] = runs.table.reshape(-1)
        flat, views = _pack(parts, device)
        views["block_table"] = views["block_table"].view(runs.bsz, runs.width)
        tiles = views.pop("tile_req", None), views.pop("tile_m0", None)
        return cls(
            list(slots),
            list(run_lens),
            list(start_pos),
            kv,
            flat,
            decode=decode,
            padded=pad is not None,
            tiles=None if tiles[0] is None else tiles,
            token_rows=pad is not None and bool(pad.verify),
            **views,
            **kw,
        )

    def rope(self, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
        """This step's rotary cos/sin rows, computed by the first layer that asks (in a CUDA
        graph: once per replay, not once per layer)."""
        key = (head_dim, theta)
        if key not in self.step_cache:
            self.step_cache[key] = rope_tables(self.positions, head_dim, theta)
        return self.step_cache[key]

    def full_table(self) -> torch.Tensor:
        """``block_table`` ``[B, W]`` with its rows ``W`` apart, for code that indexes it by its
        columns. A graph's step copies the host's table into the prefix of the graph's buffer,
        rows ``table_width`` apart: narrower for a decode graph (the paged-attention kernels
        read that stride), so there the view's row ``b > 0`` is not run ``b``'s blocks. Once a
        step, spread to ``W`` columns on the device; the view itself elsewhere."""
        table = self.block_table
        if not self.padded:
            return table
        if "full_table" not in self.step_cache:
            b, w = table.shape
            cols = torch.arange(w, device=table.device)
            at = torch.arange(b, device=table.device).unsqueeze(1) * self.table_width + cols
            spread = torch.where(cols < self.table_width, table.reshape(-1)[at], 0)
            self.step_cache["full_table"] = spread
        return self.step_cache["full_table"]

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


def _grow(a: np.ndarray, by: int, value: int) -> np.ndarray:
    return np.concatenate([a, np.full((by, *a.shape[1:]), value, dtype=np.int64)])


@dataclass
class _Runs:
    """A step's runs as host arrays, checked against the cache: the pieces ``for_runs`` packs."""

    real: int  # runs before padding
    bsz: int
    width: int
    ids: np.ndarray  # [B] slots
    lens: np.ndarray  # [B] run lengths
    pos0: np.ndarray  # [B] start positions
    req: np.ndarray  # [T] each token's run
    qstart: np.ndarray  # [B + 1]
    positions: np.ndarray  # [T]
    rows: np.ndarray  # [T] cache rows (-1: padding, written nowhere)
    ctx_lens: np.ndarray  # [B]
    table: np.ndarray  # [B, W]
    run_lens: list[int]
    start_pos: list[int]

    @classmethod
    def of(cls, slots, run_lens, start_pos, tables: BlockTables, width) -> _Runs:
        bsz = len(slots)
        if not len(run_lens) == len(start_pos) == bsz:
            raise ValueError("slots, run_lens and start_pos differ in length")
        i64 = np.int64
        ids = np.asarray(slots, dtype=i64).reshape(-1)
        if bsz and not 0 <= ids.min() <= ids.max() < tables.num_slots:
            raise ValueError(f"slots {slots} lie outside the cache's {tables.num_slots} tables")
        sizes = tables.lens[ids]
        width = max(1, int(sizes.max()) if bsz else 1) if width is None else width
        table = tables.tables[ids, :width]  # a copy: later steps may change the tables
        lens = np.asarray(run_lens, dtype=i64).reshape(-1)
        pos0 = np.asarray(start_pos, dtype=i64).reshape(-1)
        block = tables.block_size
        over = pos0 + lens > np.minimum(sizes * block, tables.max_len)
        for b in np.flatnonzero(over | (lens < 0) | (pos0 < 0)).tolist():
            if lens[b] < 0 or pos0[b] < 0:
                raise ValueError(f"request {b}: negative run length or start position")
            cap = min(tables.max_len, int(sizes[b]) * block)
            raise ValueError(
                f"positions up to {start_pos[b] + run_lens[b]} exceed the request's KV capacity "
                f"({cap} tokens)"
            )
        live = ids[lens > 0]
        if np.unique(live).size != live.size:
            raise ValueError(f"two runs of one step share a slot: {live.tolist()}")
        req = np.repeat(np.arange(bsz, dtype=i64), lens)
        qstart = np.concatenate([np.zeros(1, i64), np.cumsum(lens)])
        positions = pos0[req] + np.arange(len(req), dtype=i64) - qstart[req]
        rows = table[req, positions // block] * block + positions % block
        return cls(
            bsz,
            bsz,
            width,
            ids,
            lens,
            pos0,
            req,
            qstart,
            positions,
            rows,
            pos0 + lens,
            table,
            list(run_lens),
            list(start_pos),
        )

    def padded(self, pad: GraphShape, decode: bool) -> _Runs:
        """The runs padded to a captured graph's shape: a padded token is written nowhere
        (cache row -1), hashes as padding and commits nothing; a padded request has no keys
        (context 0) and, in a decode graph, owns one padded token at slot 0, in a mixed graph
        none (a run of 0 tokens)."""
        pad.check(self.run_lens)
        extra_t, extra_r = pad.tokens - len(self.req), pad.requests - self.bsz
        step = 1 if decode else pad.verify + 1 if pad.verify else 0
        qstart = np.concatenate([self.qstart, self.qstart[-1] + step * np.arange(1, extra_r + 1)])
        return replace(
            self,
            bsz=pad.requests,
            qstart=qstart,
            positions=_grow(self.positions, extra_t, 0),
            rows=_grow(self.rows, extra_t, -1),
            req=_grow(self.req, extra_t, 0),
            ids=_grow(self.ids, extra_r, 0),
            pos0=_grow(self.pos0, extra_r, 0),
            ctx_lens=_grow(self.ctx_lens, extra_r, 0),
            table=_grow(self.table, extra_r, 0),
        )

    def common(self) -> dict[str, np.ndarray]:
        return {
            "slot_ids": self.ids,
            "positions": self.positions,
            "token_req": self.req,
            "slot_mapping": self.rows,
            "context_lens": self.ctx_lens,
            "query_start": self.qstart,
            "start_pos_t": self.pos0,
            "num_real": np.array([self.real]),
            "table_width": np.array([self.width]),
        }

    def mixed(self, pad: GraphShape | None) -> dict[str, np.ndarray]:
        """A mixed step's prefill tiles, each token's slot and its one-token runs (for the
        decode kernel). In a graph, tiles past every run walk nothing and entries past the
        real one-token runs have no keys. A verify graph's runs (an anchor and K drafts) have
        no tiles: each token is a decode row whose keys end at its own position (a 128-query
        tile for K + 1 queries would walk its keys for mostly empty rows)."""
        i64 = np.int64
        if pad is not None and pad.verify:  # every token a decode row of its own (causal)
            none = np.zeros(0, dtype=i64)
            return {
                "tile_req": none,
                "tile_m0": none,
                "token_slots": self.ids[self.req],
                "dec_tok": np.arange(len(self.req), dtype=i64),
                "dec_req": self.req,
                "dec_lens": np.where(self.rows >= 0, self.positions + 1, 0),
            }
        long = [n if n > 1 else 0 for n in self.run_lens]
        tile_req, tile_m0 = (np.asarray(v, dtype=i64) for v in prefill_tiles(long, self.start_pos))
        one = np.flatnonzero(self.lens == 1)
        dec_tok, dec_req, dec_lens = self.qstart[one], one, self.ctx_lens[one]
        if pad is not None:
            tile_req = _grow(tile_req, pad.tiles - len(tile_req), 0)
            tile_m0 = _grow(tile_m0, pad.tiles - len(tile_m0), NO_TILE)
            extra = pad.requests - len(one)
            dec_tok = _grow(dec_tok, extra, len(self.req))
            dec_req, dec_lens = _grow(dec_req, extra, 0), _grow(dec_lens, extra, 0)
        return {
            "tile_req": tile_req,
            "tile_m0": tile_m0,
            "token_slots": self.ids[self.req],
            "dec_tok": dec_tok,
            "dec_req": dec_req,
            "dec_lens": dec_lens,
        }

    def verify(self, drafts: list[int], sample_rows: bool) -> dict[str, np.ndarray]:
        """An eager step with drafts: which runs commit history when hashed (none with drafts)
        and, with ``sample_rows``, run b's last ``1 + drafts[b]`` tokens as logits rows."""
        tails = np.asarray(drafts, dtype=np.int64) + 1
        parts = {"commit_runs": (tails == 1).astype(np.int64)}
        if sample_rows:
            first = np.repeat(self.qstart[1:] - tails, tails)
            j = np.arange(tails.sum()) - np.repeat(np.cumsum(tails) - tails, tails)
            parts["logits_rows"] = np.maximum(first + j, 0)
        return parts


def _pack(parts: dict[str, np.ndarray], device) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Every part back to back in one int64 buffer, moved in one copy; a view of it by name.
    Every view starts 16-byte aligned: Triton specialises pointer arguments on it, so a view at
    an odd int64 offset (odd token or request counts) would compile another variant of each
    kernel that reads it, in the middle of serving."""
    sizes = [len(a) for a in parts.values()]
    offsets = np.cumsum([0] + [n + n % 2 for n in sizes])
    host = np.zeros(int(offsets[-1]), dtype=np.int64)
    for a, o in zip(parts.values(), offsets, strict=False):
        host[o : o + len(a)] = a
    flat = to_device(torch.from_numpy(host), device)  # asynchronous: see engramrt.transfer
    views = {name: flat[o : o + n] for name, o, n in zip(parts, offsets, sizes, strict=False)}
    return flat, views
