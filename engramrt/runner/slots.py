"""A stage's per-slot state, in one place: what a request leaves on a stage while it holds a slot.

A request crosses to the stages once, when it takes a slot (``NewRequest``); ``SlotTable.admit``
hands each piece to the part of the stage that keeps it:

- the n-gram history row (the first stage's hasher, its one owner): rebuilt from the tokens
  before the request's run;
- the sampling parameters (the last stage): a host row per slot, which decides what the sampler
  does, and a device row per slot (temperature, top-p, min-p, top-k) that the sampler gathers by
  slot in one copy;
- the logit controls (the last stage's ``LogitControls``: bias, penalties, min-tokens rows);
- any other kind of per-slot model state (a sliding-window ring, a compressed cache, a recurrent
  tail): an object with ``admit(new: NewRequest)`` added to ``states``, called on every stage.

Block tables travel as deltas in every step and live with the paged cache (``KVCache``); the
token a slot sampled last lives with the runner (overlap scheduling) until the token row moves
here too.
"""

from __future__ import annotations

from typing import Protocol

import torch

from engramrt.engram.hashing import EngramHasher
from engramrt.runner.batch import NewRequest, SampleRow, StepBatch
from engramrt.runner.logit_controls import LogitControls
from engramrt.transfer import to_device

GREEDY = SampleRow()


class SlotState(Protocol):
    """Per-slot model state a stage keeps for the request in each slot."""

    def admit(self, new: NewRequest) -> None: ...


class SlotTable:
    def __init__(self, device: torch.device, hasher: EngramHasher | None, samples: bool):
        """``hasher``: the first stage leader's (it rebuilds history rows); ``samples``: the
        last stage's leader (it keeps sampling parameters and logit controls)."""
        self.device, self.hasher, self.samples = device, hasher, samples
        self.sampling: dict[int, SampleRow] = {}  # slot -> parameters; absent: greedy
        self.params = torch.zeros(0, 4, device=device)  # [slots, (temperature, top_p, min_p, k)]
        self.controls = LogitControls(device)
        self.states: list[SlotState] = []

    def admit(self, admitted: list[NewRequest], vocab: int) -> None:
        for new in admitted:
            if self.hasher is not None:
                self.hasher.rebuild(new.slot, new.tokens[: new.num_computed])
            if self.samples:
                self._keep_sampling(new.slot, new.sampling)
                self.controls.register(new.slot, new.controls, new.tokens[: new.num_prompt],
                                       new.tokens[new.num_prompt :], vocab)  # fmt: skip
            for state in self.states:
                state.admit(new)

    def _keep_sampling(self, slot: int, row: SampleRow) -> None:
        if row == GREEDY:
            self.sampling.pop(slot, None)
            return
        self.sampling[slot] = row
        if slot >= len(self.params):  # grown on demand, doubling
            grown = torch.zeros(max(slot + 1, 2 * len(self.params)), 4, device=self.device)
            grown[: len(self.params)] = self.params
            self.params = grown
        values = [row.temperature, row.top_p, row.min_p, float(row.top_k)]
        self.params[slot] = to_device(torch.tensor(values), self.device)

    def rows(self, batch: StepBatch) -> list[SampleRow]:
        """Each run's sampling row this step: its slot's parameters, its output index and
        whether the engine keeps the sample."""
        index, final = batch.sample_index, batch.final
        out = []
        for b, slot in enumerate(batch.slots):
            row = self.sampling.get(slot, GREEDY)
            i = 0 if index is None else index[b]
            f = True if final is None else final[b]
            if i or not f or row is not GREEDY:
                row = SampleRow(row.temperature, row.top_p, row.top_k, row.min_p, row.seed, i,
                                row.logprobs, f)  # fmt: skip
            out.append(row)
        return out

    def gather(self, slots: list[int]) -> torch.Tensor:
        """``[len(slots), 4]`` device parameters (temperature, top_p, min_p, top_k) of rows
        that sample with parameters: one index copy."""
        at = to_device(torch.tensor(slots, dtype=torch.int64), self.device)
        return self.params[at]
