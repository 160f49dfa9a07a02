"""DeepSeek-V4.1's caches for the layers one stage owns.

- **Compressed KV and index keys** (KV sources only): paged like the GQA cache, through the
  same block tables. Entry ``j`` stands for positions ``j*r .. j*r + r - 1`` and lives in the
  block that holds position ``j*r``; a block of ``block_size`` positions holds
  ``block_size / r`` entries. Freeing a request's blocks frees its entries; preemption
  recomputes them.
- **Window ring** (every layer): the last ``window_size`` (+ ``slack``) latents of each slot,
  at ``position % ring_len``. Per slot, not per token: a request needs it whatever its length.
- **Compressor tail** (ratio-2 sources): the projection and gate score of a group's first token
  while its second has not come yet (a prompt chunk or a step that ends on an even position):
  ``tail_rows`` rows a slot, even position ``p`` at row ``(p / 2) % tail_rows``.

Ring and tail are read only at positions the request itself wrote before (a run starting at
``p`` reads the ring for positions ``p - window + 1 .. p - 1`` and the tail only when ``p`` is
odd), so a slot's new owner needs no reset.

- **Window snapshots** (prefix caching): the rings of every layer of a slot, copied after a step
  whose run ended on a block boundary (``save_windows``). Blocks hold the compressed entries
  and index keys; only the ring cannot be rebuilt from them, so a prefix-cache hit ends at a
  block boundary whose snapshot is kept and copies it into the new owner's ring (``admit``).
  The block size is even, so a hit never starts inside a ratio-2 group: the tail is not needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from engramrt.kernels import use_triton
from engramrt.model.context import PagedCache
from engramrt.models.deepseek_v41.config import REINDEX, SOURCE, V41Config

if TYPE_CHECKING:
    from engramrt.runner.batch import NewRequest


def entry_bytes(cfg: V41Config, layer_ids: list[int], itemsize: int) -> float:
    """Bytes of compressed KV and index keys a token adds in ``layer_ids`` (per-token sizing)."""
    return sum(
        (cfg.head_dim + cfg.index_head_dim) * itemsize / r.ratio
        for r in cfg.roles
        if r.layer in layer_ids and r.kind == SOURCE
    )


def rings_bytes(cfg: V41Config, layer_ids: list[int], itemsize: int, slack: int = 0) -> int:
    """Bytes of a slot's window rings in ``layer_ids`` (and of one window snapshot)."""
    return (cfg.window_size + slack) * cfg.head_dim * itemsize * len(layer_ids)


def tail_rows(slack: int) -> int:
    """Compressor-tail rows a slot keeps: one, and one more for every two drafts a verify run
    may write past the accepted position."""
    return slack // 2 + 1


def slot_bytes(cfg: V41Config, layer_ids: list[int], itemsize: int, slack: int = 0) -> int:
    """Bytes of window rings and compressor tails a slot holds in ``layer_ids``."""
    ring = rings_bytes(cfg, layer_ids, itemsize, slack)
    tails = sum(
        2 * cfg.head_dim * 4 * tail_rows(slack)
        for r in cfg.roles
        if r.layer in layer_ids and r.kind == SOURCE and r.ratio == 2
    )
    return ring + tails


def read_bytes(cfg: V41Config, layer_ids: list[int], context: int, itemsize: int) -> int:
    """Cache bytes one decode token at ``context`` reads in ``layer_ids``: its window's latents
    in every layer, its picked compressed rows in the compressed layers, and the index keys an
    indexer scans (sources and re-indexers)."""
    total = 0
    for r in (cfg.roles[i] for i in layer_ids):
        total += min(cfg.window_size, context) * cfg.head_dim
        if r.ratio:
            total += min(cfg.index_topk, context // r.ratio) * cfg.head_dim
            if r.kind in (SOURCE, REINDEX):
                total += context // r.ratio * cfg.index_head_dim
    return total * itemsize


def default_snapshots(slots: int) -> int:
    """Window snapshots a cache keeps for prefix caching: two per slot (each running request's
    latest block boundary, and as many finished or preempted prefixes)."""
    return 2 * slots


def fixed_bytes(
    cfg: V41Config,
    layer_ids: list[int],
    itemsize: int,
    slots: int,
    snapshots: int = 0,
    slack: int = 0,
) -> int:
    """Bytes a cache for ``slots`` sequences holds whatever its blocks: their rings and tails,
    the spare slot's, each source's spare entry row and the window snapshots."""
    spare = sum(
        (cfg.head_dim + cfg.index_head_dim) * itemsize
        for r in cfg.roles
        if r.layer in layer_ids and r.kind == SOURCE
    )
    return (
        (slots + 1) * slot_bytes(cfg, layer_ids, itemsize, slack)
        + spare
        + snapshots * rings_bytes(cfg, layer_ids, itemsize, slack)
    )


class V41Cache(PagedCache):
    """A stage's V4.1 caches: window rings (and their snapshots), compressed rows, index keys
    and compressor tails."""

    def __init__(
        self,
        cfg: V41Config,
        layer_ids: list[int],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
        max_len: int,
        num_slots: int,
        num_snapshots: int = 0,
        slack: int = 0,
    ):
        """``slack``: the drafts a verify run may write past the accepted position (speculative
        decoding): each ring holds ``window + slack`` rows and each tail ``tail_rows(slack)``,
        so a rejected draft's writes land where no later query reads (rollback without a
        copy)."""
        if block_size % 2:
            raise ValueError(
                f"--block-size must be even for V4.1 (ratio-2 groups), got {block_size}"
            )
        super().__init__(num_blocks, block_size, max_len, num_slots)
        roles = [cfg.role(i) for i in layer_ids]  # DSpark stages: rings only
        slots, w, d = self.num_slots, cfg.window_size + slack, cfg.head_dim
        self.ring_len, self.tail_rows = w, tail_rows(slack)
        # each tensor has a spare slot or row past the real ones: a batched write points the
        # tokens that write nothing there (no host-side selection, no graph break)
        # every layer's rings in one tensor: a snapshot is one copy
        self.rings = torch.zeros(len(roles), slots + 1, w, d, dtype=dtype, device=device)
        self.window = {r.layer: self.rings[i] for i, r in enumerate(roles)}
        self.snapshots = torch.zeros(len(roles), num_snapshots, w, d, dtype=dtype, device=device)
        sources = [r for r in roles if r.kind == SOURCE]
        rows = {r.layer: self.spare_row(r.ratio) + 1 for r in sources}
        self.compressed = {
            i: torch.zeros(n, d, dtype=dtype, device=device) for i, n in rows.items()
        }
        self.index_keys = {
            i: torch.zeros(n, cfg.index_head_dim, dtype=dtype, device=device)
            for i, n in rows.items()
        }
        # (projection, gate score) of a ratio-2 group's first token, fp32 as the compressor
        self.tail = {
            r.layer: torch.zeros((slots + 1) * self.tail_rows, 2, d, device=device)
            for r in sources
            if r.ratio == 2
        }

    @property
    def nbytes(self) -> int:
        parts = (self.compressed, self.index_keys, self.tail)
        tensors = [self.rings, self.snapshots, *(t for part in parts for t in part.values())]
        return sum(t.numel() * t.element_size() for t in tensors)

    @property
    def num_snapshots(self) -> int:
        return self.snapshots.shape[1]

    def save_windows(self, saves: list[tuple[int, int]]) -> None:
        """(slot, snapshot) pairs: each slot's rings, as a step left them, into the snapshot."""
        if saves:
            pairs = torch.tensor(saves, device=self.rings.device)
            self.snapshots[:, pairs[:, 1]] = self.rings[:, pairs[:, 0]]

    def admit(self, new: NewRequest) -> None:
        """A prefix-cache hit's rings come from the snapshot of the block boundary it ends at
        (``SlotTable.states``)."""
        if new.snapshot is not None:
            self.rings[:, new.slot] = self.snapshots[:, new.snapshot]

    def spare_row(self, ratio: int) -> int:
        """The row of a ratio's compressed cache (and index keys) that takes the writes of the
        tokens that close no group: the last, past every block's entries."""
        return self.num_blocks * self.block_size // ratio

    def entry_rows(
        self,
        tables: torch.Tensor,
        req: torch.Tensor,
        entries: torch.Tensor,
        ratio: int,
        none: int | None = None,
    ) -> torch.Tensor:
        """Rows of the compressed cache (and index keys) holding ``entries``, each of the
        request ``req`` gives (an index into the block tables ``tables`` [B, W]; ``req`` has
        ``entries``' shape or its leading dims); an entry past a table reads its last block
        (the caller masks what a query cannot see). ``none``: the row of a negative entry
        (one launch on CUDA, ``kernels.entry_rows``)."""
        if use_triton(entries.device) and req.dim() == 1 and self.block_size % ratio == 0:
            from engramrt.kernels.entry_rows import entry_rows

            per = self.block_size // ratio
            return entry_rows(tables, req, entries, per, -1 if none is None else none)
        if none is not None:
            return torch.where(
                entries >= 0, self.entry_rows(tables, req, entries.clamp_min(0), ratio), none
            )
        pos = entries * ratio
        at = (pos // self.block_size).clamp_max(tables.shape[-1] - 1)
        while req.dim() < at.dim():
            req = req.unsqueeze(-1)
        block = tables[req, at]
        return block * (self.block_size // ratio) + (pos % self.block_size) // ratio
