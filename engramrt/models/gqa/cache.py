"""The GQA family's paged K/V: ``[num_blocks * block_size, kv_heads, head_dim]`` per layer."""

from __future__ import annotations

import torch

from engramrt.model.context import PagedCache


class GQACache(PagedCache):
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
        super().__init__(num_blocks, block_size, max_len, num_slots)
        shape = (num_blocks * block_size, num_kv_heads, head_dim)
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))
