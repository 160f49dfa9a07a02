"""The first stage's image spans: each slot's images encoded once when its request takes the slot
(``NewRequest.images``), through an encoder cache keyed by the image's content hash, so that a
resumed or prefix-hit request and a second request with the same image reuse the rows; each
step then takes the rows its runs cover (``ForwardContext.images``), a chunk that ends inside a
span included.

A step with image rows runs eagerly: its rows are not among what a captured graph reads.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from engramrt.runner.batch import ImageRef, NewRequest, StepBatch


class ImageSpans:
    def __init__(self, model, device: torch.device, cache_bytes: int = 1 << 30):
        """``cache_bytes``: the encoded spans kept for reuse once no slot holds them."""
        self.model, self.device, self.cache_bytes = model, device, cache_bytes
        self.by_slot: dict[int, list[tuple[int, torch.Tensor]]] = {}  # (start, rows [n, D])
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.encoded = 0  # images the tower ran on (the rest came from the cache)

    def admit(self, admitted: list[NewRequest]) -> None:
        for new in admitted:
            spans = [(ref.start, self._rows(ref)) for ref in new.images]
            if spans:
                self.by_slot[new.slot] = spans
            else:
                self.by_slot.pop(new.slot, None)

    def _rows(self, ref: ImageRef) -> torch.Tensor:
        rows = self.cache.get(ref.key)
        if rows is None:
            rows = self.model.cfg.family.encode_image(self.model, ref)
            self.encoded += 1
            self.cache[ref.key] = rows
            self._evict()
        if rows.shape[0] != ref.length:
            raise ValueError(
                f"image {ref.key[:12]}: its span has {ref.length} positions, its rows "
                f"{rows.shape[0]}"
            )
        self.cache.move_to_end(ref.key)
        return rows

    def _evict(self) -> None:
        size = sum(r.nbytes for r in self.cache.values())
        while len(self.cache) > 1 and size > self.cache_bytes:
            size -= self.cache.popitem(last=False)[1].nbytes

    def step(self, batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(``[T]`` each token's row of the step's image rows or -1, the rows ``[N, D]``), or
        None where no run covers an image position."""
        if not self.by_slot:
            return None
        at, parts, offset, n = None, [], 0, 0
        for slot, start, length in zip(batch.slots, batch.start_pos, batch.run_lens, strict=True):
            for first, rows in self.by_slot.get(slot, ()):
                lo, hi = max(start, first), min(start + length, first + len(rows))
                if lo >= hi:
                    continue
                if at is None:
                    at = torch.full((batch.num_tokens,), -1, dtype=torch.int64)
                at[offset + lo - start : offset + hi - start] = torch.arange(n, n + hi - lo)
                parts.append(rows[lo - first : hi - first])
                n += hi - lo
            offset += length
        if at is None:
            return None
        return at.to(self.device), torch.cat(parts)
