"""Per-forward state shared by every layer: where each request's tokens sit, its KV cache, the
Engram inputs, and which Engram layers ran (so a skipped one is an error, not silence)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engramrt.model.trace import Tracer


class KVCache:
    """Paged K/V for the layers one process owns: ``[num_blocks * block_size, kv, hd]`` per layer.
    A request's block table maps its positions to blocks; without a block manager, slot ``s``
    owns blocks ``[s * per_slot, (s + 1) * per_slot)`` (``slot_table``)."""

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
    ):
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.num_blocks, self.block_size, self.max_len = num_blocks, block_size, max_len
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}

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
    from ``start_pos[b]``, in KV/history slot ``slots[b]``."""

    slots: list[int]
    run_lens: list[int]
    start_pos: list[int]
    positions: torch.Tensor
    kv: KVCache
    block_tables: list[list[int]] = field(default_factory=list)
    hash_ids: torch.Tensor | None = None  # [T, L, (N-1)*H]
    dead: torch.Tensor | None = None  # [T] image tokens
    tracer: Tracer | None = None
    engram_ran: list[int] = field(default_factory=list)

    @classmethod
    def for_runs(
        cls,
        slots: list[int],
        run_lens: list[int],
        start_pos: list[int],
        kv: KVCache,
        device: torch.device | str,
        block_tables: list[list[int]] | None = None,
        **kw,
    ) -> ForwardContext:
        if block_tables is None:
            block_tables = [kv.slot_table(s) for s in slots]
        spans = []
        for b, (p, n, table) in enumerate(zip(start_pos, run_lens, block_tables, strict=True)):
            if any(not 0 <= blk < kv.num_blocks for blk in table):
                raise ValueError(
                    f"request {b}: block table {table} has ids outside [0, {kv.num_blocks})"
                )
            if p + n > min(kv.max_len, len(table) * kv.block_size):
                raise ValueError(
                    f"positions up to {p + n} exceed the request's KV capacity "
                    f"({min(kv.max_len, len(table) * kv.block_size)} tokens)"
                )
            spans.append(torch.arange(p, p + n, dtype=torch.int64))
        positions = torch.cat([*spans, torch.zeros(0, dtype=torch.int64)]).to(device)
        return cls(list(slots), list(run_lens), list(start_pos), positions, kv, block_tables, **kw)

    def engram_inputs(self, layer_id: int, index: int) -> torch.Tensor:
        if self.hash_ids is None:
            raise RuntimeError(f"layer {layer_id} owns an Engram but the forward got no hash ids")
        return self.hash_ids[:, index]

    def trace(self, event: str, layer_id: int, tensor: torch.Tensor) -> None:
        if self.tracer is not None:
            self.tracer(event, layer_id, tensor)
