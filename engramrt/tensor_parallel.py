"""Tensor parallelism: which slice of each layer this process holds, and the collectives that
put the slices back together.

A TP group is the ranks of one pipeline stage (rank = stage * tp + tp_rank); its rank 0 is the
stage's leader, which talks to the other stages. Layers shard as Megatron and vLLM do: Q/K/V,
FFN gate/up and the vocabulary by rows (heads, features, tokens), the attention output and FFN
down projections by columns followed by an all-reduce, the Engram tables by hash head (column
of the gathered rows) followed by an all-gather. An all-gather only concatenates, so what it
rebuilds is bitwise what one process computes; an all-reduce changes the summation order.

Under gloo a CUDA tensor makes the round trip through host memory (gloo's own CUDA paths are
not in every build), which also lets two ranks share one GPU, where NCCL refuses.

The collectives run whenever there is a group, even of one rank: on one GPU a one-rank NCCL
group takes the capture path of two GPUs through torch's process group (NCCL itself has no
work for one rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None  # the stage's torch.distributed process group
    leader: int = 0  # the global rank of the group's rank 0

    def span(self, n: int, what: str) -> tuple[int, int]:
        """``[lo, hi)`` of ``n`` equal parts' ``rank``-th; ``what`` names ``n`` in the error."""
        if n % self.size:
            raise ValueError(f"--tensor-parallel-size {self.size} must divide {what} ({n})")
        per = n // self.size
        return self.rank * per, (self.rank + 1) * per

    def padded_span(self, n: int) -> tuple[int, int, int]:
        """``[lo, hi)`` and the part size ``ceil(n / size)``: the last parts may be short (or
        empty) and are padded for the all-gather (``gather``)."""
        per = -(-n // self.size)
        lo = min(n, self.rank * per)
        return lo, min(n, lo + per), per

    @property
    def solo(self) -> bool:
        """No group: nothing to exchange."""
        return self.group is None

    def _host(self, x: torch.Tensor) -> bool:
        return x.is_cuda and dist.get_backend(self.group) == "gloo"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group (in place where the backend allows)."""
        if self.solo:
            return x
        if self._host(x):
            y = x.cpu()
            dist.all_reduce(y, group=self.group)
            return y.to(x.device)
        dist.all_reduce(x, group=self.group)
        return x

    def gather(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """The ranks' ``padded_span`` parts of the last dimension, concatenated and cut to
        ``total`` (every rank gets the whole)."""
        if self.solo:
            return x
        per = -(-total // self.size)
        if x.shape[-1] < per:
            x = torch.cat([x, x.new_zeros(*x.shape[:-1], per - x.shape[-1])], dim=-1)
        if self._host(x) or not x.is_cuda:  # gloo: a list of parts
            parts = [torch.empty_like(x, device="cpu") for _ in range(self.size)]
            dist.all_gather(parts, x.cpu(), group=self.group)
            stacked = torch.stack(parts).to(x.device)
        else:  # NCCL: the parts stacked in one buffer (one launch, capturable)
            stacked = x.new_empty(self.size, *x.shape)
            dist.all_gather_into_tensor(stacked, x.contiguous(), group=self.group)
        return stacked.movedim(0, -2).flatten(-2)[..., :total]  # [..., size * per] -> total

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """The leader's ``x`` on every rank (``x``: a buffer of the right shape elsewhere)."""
        if self.solo:
            return x
        if self._host(x):
            y = x.cpu()
            dist.broadcast(y, self.leader, group=self.group)
            return y.to(x.device)
        dist.broadcast(x, self.leader, group=self.group)
        return x


SINGLE = TensorParallel()
_current = SINGLE


def current() -> TensorParallel:
    """This process's place in its stage's TP group (``SINGLE`` without TP)."""
    return _current


def join(rank: int, world: int, tp_size: int) -> TensorParallel:
    """Create every stage's group (each rank must create all of them, in the same order) and
    remember this rank's."""
    global _current
    if world % tp_size:
        raise ValueError(f"world size {world} is not a multiple of the TP size {tp_size}")
    mine = SINGLE
    for first in range(0, world, tp_size):
        ranks = list(range(first, first + tp_size))
        group = dist.new_group(ranks) if tp_size > 1 else None
        if rank in ranks:
            mine = TensorParallel(rank - first, tp_size, group, first)
    _current = mine
    return mine


def reset() -> None:
    global _current
    _current = SINGLE
