"""Which cache blocks hold each slot's positions: a stage's copy of the block manager's tables.

They are kept on the host from step to step, so a step sends only the blocks a request gained
(``set``); the stage's ``SlotTable`` owns them, ``ForwardContext.for_runs`` reads them. Until
told otherwise slot ``s`` owns blocks ``[s * per_seq, (s + 1) * per_seq)`` where the cache has
them (``fixed``): what a runner driven without an engine (tests, benchmarks, training) uses.
"""

from __future__ import annotations

import numpy as np
import torch


class BlockTables:
    def __init__(self, num_slots: int, num_blocks: int, block_size: int, max_len: int):
        self.num_blocks, self.block_size, self.max_len = num_blocks, block_size, max_len
        per = self.per_seq
        self.tables = np.zeros((num_slots, per), dtype=np.int64)
        self.lens = np.zeros(num_slots, dtype=np.int64)
        have = min(num_slots, num_blocks // per)  # the slots whose fixed blocks exist
        self.tables[:have] = np.arange(have * per).reshape(have, per)
        self.lens[:have] = per

    @property
    def per_seq(self) -> int:
        """Blocks of a sequence of ``max_len`` tokens: the tables' width."""
        return -(-self.max_len // self.block_size)

    @property
    def num_slots(self) -> int:
        return len(self.tables)

    def set(self, slots: list[int], starts: list[int] | None, blocks: list[list[int]]) -> None:
        """Slot ``slots[b]``'s table becomes its first ``starts[b]`` blocks (default 0) followed
        by ``blocks[b]``. Only the given blocks are checked and copied: O(new blocks)."""
        lens = self.lens
        for b, (slot, new) in enumerate(zip(slots, blocks, strict=True)):
            start = 0 if starts is None else starts[b]
            if not new and 0 <= slot < len(lens) and start == lens[slot]:
                continue  # most runs of a step: nothing changed
            if not 0 <= slot < self.num_slots:
                raise ValueError(f"slot {slot} outside the cache's {self.num_slots} tables")
            if not 0 <= start <= self.lens[slot] or start + len(new) > self.per_seq:
                raise ValueError(
                    f"request {b}: {len(new)} blocks at {start} do not extend its table of "
                    f"{self.lens[slot]} (at most {self.per_seq})"
                )
            if new and not 0 <= min(new) <= max(new) < self.num_blocks:
                raise ValueError(
                    f"request {b}: block table {new} has ids outside [0, {self.num_blocks})"
                )
            self.tables[slot, start : start + len(new)] = new
            self.lens[slot] = start + len(new)

    def fixed(self, slot: int) -> list[int]:
        """Slot ``slot``'s blocks before any ``set``."""
        per = self.per_seq
        if (slot + 1) * per > self.num_blocks:
            raise ValueError(f"slot {slot} has no blocks in a cache of {self.num_blocks} blocks")
        return list(range(slot * per, (slot + 1) * per))

    def rows(self, table: list[int], start: int, end: int, device) -> torch.Tensor:
        """Flat cache rows of positions ``[start, end)`` under block table ``table``."""
        pos = torch.arange(start, end, device=device)
        blocks = torch.tensor(table, dtype=torch.int64, device=device)
        return blocks[pos // self.block_size] * self.block_size + pos % self.block_size
