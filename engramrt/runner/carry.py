"""What crosses a stage boundary."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engramrt.model.decoder import EngramMHCModel


@dataclass
class Carry:
    """The hc stream, the lagged pre-mix (fp32), the hash ids computed once on the first stage,
    and the image-token mask: everything a later stage needs and cannot compute itself."""

    x: torch.Tensor  # [T, hc, D]
    pre: torch.Tensor  # [T, hc] fp32
    hash_ids: torch.Tensor  # [T, L, (N-1)*H] int64
    dead: torch.Tensor  # [T] bool

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.x, self.pre, self.hash_ids, self.dead

    def head(self, n: int) -> Carry:
        """The first ``n`` rows (the real rows of a padded graph batch)."""
        return Carry(*(t[:n] for t in self.tensors()))

    @classmethod
    def empty(cls, model: EngramMHCModel, tokens: int, fill=torch.empty) -> Carry:
        """A carry of the right shapes and dtypes for ``model``'s stage (to receive into, or
        zeros for graph inputs and memory profiling with ``fill=torch.zeros``)."""
        cfg, e, dev = model.cfg, model.cfg.engram, next(model.parameters()).device
        return cls(
            fill(tokens, cfg.hc_mult, cfg.hidden_size, dtype=model.dtype, device=dev),
            fill(tokens, cfg.hc_mult, dtype=torch.float32, device=dev),
            fill(tokens, e.num_layers, e.n_hash_cols, dtype=torch.int64, device=dev),
            fill(tokens, dtype=torch.bool, device=dev),
        )
