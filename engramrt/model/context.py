"""Per-forward state shared by every layer: where each request's tokens sit, its KV cache, the
Engram inputs, and which Engram layers ran (so a skipped one is an error, not silence)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engramrt.model.trace import Tracer


class KVCache:
    """Contiguous per-slot K/V for the layers one process owns: ``[slots, max_len, kv, hd]``."""

    def __init__(
        self,
        layer_ids: list[int],
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ):
        shape = (num_slots, max_len, num_kv_heads, head_dim)
        self.max_len = max_len
        self.k = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}
        self.v = {i: torch.zeros(shape, dtype=dtype, device=device) for i in layer_ids}


@dataclass
class ForwardContext:
    """Request ``b`` owns the next ``run_lens[b]`` tokens of the flat batch, at absolute positions
    from ``start_pos[b]``, in KV/history slot ``slots[b]``."""

    slots: list[int]
    run_lens: list[int]
    start_pos: list[int]
    positions: torch.Tensor
    kv: KVCache
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
        **kw,
    ) -> ForwardContext:
        spans = []
        for p, n in zip(start_pos, run_lens, strict=True):
            if p + n > kv.max_len:
                raise ValueError(f"positions up to {p + n} exceed the KV cache length {kv.max_len}")
            spans.append(torch.arange(p, p + n, dtype=torch.int64))
        positions = torch.cat([*spans, torch.zeros(0, dtype=torch.int64)]).to(device)
        return cls(list(slots), list(run_lens), list(start_pos), positions, kv, **kw)

    def engram_inputs(self, layer_id: int, index: int) -> torch.Tensor:
        if self.hash_ids is None:
            raise RuntimeError(f"layer {layer_id} owns an Engram but the forward got no hash ids")
        return self.hash_ids[:, index]

    def trace(self, event: str, layer_id: int, tensor: torch.Tensor) -> None:
        if self.tracer is not None:
            self.tracer(event, layer_id, tensor)
