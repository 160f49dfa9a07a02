"""A stage's per-slot state, in one place: what a request leaves on a stage while it holds a slot.

A request crosses to the stages once, when it takes a slot (``NewRequest``); ``SlotTable.admit``
hands each piece to the part of the stage that keeps it:

- its block table (every stage: ``blocks``, which ``ForwardContext.for_runs`` reads);
- its token row (every rank of the first stage: ``tokens``, ``[slots + 1, max_len + 1 +
  slack]`` on the device; the last row is a spare that masked writes go to, the slack holds
  the drafts past the last position), which the step's token ids are gathered from;
- the n-gram history row (the first stage's hasher, its one owner): rebuilt from the tokens
  before the request's run;
- the sampling parameters (the last stage): a host row per slot, which decides what the sampler
  does, and a device row per slot (temperature, top-p, min-p, top-k) that the sampler gathers by
  slot in one copy;
- the logit controls (the last stage's ``LogitControls``: bias, penalties, min-tokens rows);
- any other kind of per-slot model state: an object with ``admit(new: NewRequest)`` in
  ``states``, called on every stage. A cache that has one joins when it is sized (V4.1's rings
  start from a prefix hit's window snapshot, ``V41Cache.admit``).

After that a step brings deltas (``advance``): the blocks a run gained and the tokens the row
lacks. A stage that samples where it embeds writes each sample into the row itself
(``keep_samples``), on the device, so the next step reads it there without the host having seen
it (overlap scheduling).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch

from engramrt.engram.hashing import EngramHasher
from engramrt.model.block_tables import BlockTables
from engramrt.model.context import PagedCache
from engramrt.runner.batch import NewRequest, SampleRow, StepBatch
from engramrt.runner.logit_controls import LogitControls
from engramrt.transfer import to_device

if TYPE_CHECKING:
    from engramrt.model.context import ForwardContext

GREEDY = SampleRow()


@runtime_checkable
class SlotState(Protocol):
    """Per-slot model state a stage keeps for the request in each slot."""

    def admit(self, new: NewRequest) -> None: ...


class SlotTable:
    def __init__(
        self, device: torch.device, hasher: EngramHasher | None, samples: bool, first: bool = False
    ):
        """``hasher``: the first stage leader's (it rebuilds history rows and checks token ids);
        ``samples``: the last stage's leader (it keeps sampling parameters and logit controls);
        ``first``: a rank of the first stage (it embeds, so it keeps the token rows)."""
        self.device, self.hasher, self.samples, self.first = device, hasher, samples, first
        self.blocks: BlockTables | None = None  # sized with the cache (``size_for``)
        self.tokens: torch.Tensor | None = None  # [slots + 1, width] int32, first stage
        self.sampling: dict[int, SampleRow] = {}  # slot -> parameters; absent: greedy
        self.params = torch.zeros(0, 4, device=device)  # [slots, (temperature, top_p, min_p, k)]
        self.controls = LogitControls(device)
        self.states: list[SlotState] = []

    def size_for(self, kv: PagedCache, slack: int = 0) -> None:
        """Block tables and token rows for a new cache (slots on their fixed blocks); the cache
        replaces every state kept for the old cache's slots in ``states`` if it keeps per-slot
        state. ``slack``: drafts a run may verify."""
        self.blocks = kv.fixed_tables()
        self.states = []
        if isinstance(kv, SlotState):
            self.states.append(kv)
        if self.first:
            self.tokens = None  # the old rows go before the new ones are allocated
            # + 1: the sample after the last position; + slack: the drafts after it
            shape = (kv.num_slots + 1, kv.max_len + 1 + slack)
            self.tokens = torch.zeros(shape, dtype=torch.int32, device=self.device)

    def admit(self, admitted: list[NewRequest], vocab: int) -> None:
        if not admitted:
            return
        given = [a for a in admitted if a.blocks is not None]
        if self.blocks is not None and given:
            self.blocks.set([a.slot for a in given], None, [a.blocks for a in given])
        if self.tokens is not None:
            self._write(
                [a.slot for a in admitted],
                [len(a.tokens) for a in admitted],
                [t for a in admitted for t in a.tokens],
            )
        for new in admitted:
            if self.hasher is not None:
                self.hasher.rebuild(new.slot, new.tokens[: new.num_computed])
            if self.samples:
                self._keep_sampling(new.slot, new.sampling)
                self.controls.register(
                    new.slot,
                    new.controls,
                    new.tokens[: new.num_prompt],
                    new.tokens[new.num_prompt :],
                    vocab,
                )
            for state in self.states:
                state.admit(new)

    def advance(self, batch: StepBatch) -> None:
        """The step's deltas: the blocks its runs gained; on the first stage the tokens its rows
        lack (``StepBatch.tokens``: the last ``token_counts[b]`` of run b)."""
        if batch.new_blocks is not None:
            self.blocks.set(batch.slots, batch.block_starts, batch.new_blocks)
        if self.tokens is None:
            return
        counts = batch.token_counts if batch.token_counts is not None else batch.run_lens
        given = batch.tokens
        if not given and given is not None and not any(counts):
            return  # a decode step where the stage kept its samples: nothing new
        lens = np.asarray(batch.run_lens, dtype=np.int64)
        c = np.asarray(counts, dtype=np.int64)
        for b in np.flatnonzero((c < 0) | (c > lens)).tolist():
            raise ValueError(f"run {b}: {counts[b]} new tokens for a run of {lens[b]}")
        if given is None or len(given) != int(c.sum()):
            want = "their tokens" if batch.token_counts is None else f"{int(c.sum())} tokens"
            raise ValueError(f"the runs need {want}; the step gave {len(given or [])}")
        self._write(batch.slots, np.asarray(batch.start_pos) + lens, given, c)

    def _write(self, slots, ends, tokens: list[int], counts=None) -> None:
        """Row ``slots[i]`` gets the next ``counts[i]`` of ``tokens`` (default: ``ends[i]``)
        at positions ending at ``ends[i]``: one copy to the device."""
        if self.hasher is not None:  # the one that hashes them checks them
            self.hasher.validate(tokens)
        counts = ends if counts is None else counts
        width = self.tokens.shape[1]
        s, e, c = (np.asarray(x, dtype=np.int64) for x in (slots, ends, counts))
        if len(s) and (s.min() < 0 or s.max() >= len(self.tokens) or e.max() > width):
            raise ValueError(
                f"slots {slots} / positions up to {e.max()} lie outside the token "
                f"rows [{len(self.tokens)}, {width - 1}]"
            )
        run = np.repeat(np.arange(len(s)), c)
        pos = np.repeat(e - c, c) + np.arange(len(run)) - np.repeat(np.cumsum(c) - c, c)
        both = np.stack([s[run] * width + pos, np.asarray(tokens, dtype=np.int64)])
        at, values = to_device(torch.from_numpy(both), self.device)
        self.tokens.view(-1).index_copy_(0, at, values.to(torch.int32))

    def keep_samples(self, batch: StepBatch, sampled: torch.Tensor) -> None:
        """Each run's sample (``sampled[b]``, on the device) into its row at the position it
        fills, where the engine keeps it (a final run): the next step reads it there."""
        lens = np.asarray(batch.run_lens, dtype=np.int64)
        keep = lens > 0 if batch.final is None else (lens > 0) & np.asarray(batch.final)
        host = torch.from_numpy(
            np.stack([np.asarray(batch.slots), np.asarray(batch.start_pos) + lens, keep]).astype(
                np.int64
            )
        )
        slots, pos, live = to_device(host, self.device)
        self.write(slots, pos, sampled, live.bool())

    def write(
        self, slots: torch.Tensor, pos: torch.Tensor, values: torch.Tensor, live: torch.Tensor
    ) -> None:
        """``tokens[slots, pos] = values`` on the device where ``live``; the rest go to the spare
        row (a masked index would wait for the device)."""
        width = self.tokens.shape[1]
        spare = (len(self.tokens) - 1) * width
        flat = torch.where(live, slots * width + pos.clamp(0, width - 1), spare)
        self.tokens.view(-1)[flat.flatten()] = values.flatten().to(self.tokens.dtype)

    def token_ids(self, ctx: ForwardContext) -> torch.Tensor:
        """The step's token ids ``[T]``, gathered from the rows by slot and position on the
        device (what a CUDA graph replays; padded tokens read position 0 of slot 0's row)."""
        slot_of = ctx.slot_ids if ctx.decode else ctx.token_slots
        return self.tokens[slot_of, ctx.positions].long()

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
                row = SampleRow(
                    row.temperature, row.top_p, row.top_k, row.min_p, row.seed, i, row.logprobs, f
                )
            out.append(row)
        return out

    def gather(self, slots: list[int]) -> torch.Tensor:
        """``[len(slots), 4]`` device parameters (temperature, top_p, min_p, top_k) of rows
        that sample with parameters: one index copy."""
        at = to_device(torch.tensor(slots, dtype=torch.int64), self.device)
        return self.params[at]
