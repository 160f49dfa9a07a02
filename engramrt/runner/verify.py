"""Speculative decoding's device half, on the last stage after its sampler: how many drafts each
verify run accepted, each sample kept in its token row at the position it fills, the Engram
history commit of the anchor and the accepted drafts, and the next step's drafts (DSpark's pass,
or the n-gram lookup over the token rows) written where the next step reads them. None of it
waits for the host, so the engine may launch step N+1 before it has read step N (overlap
scheduling with speculation).

A run launched behind a verify run still in flight cannot know where it starts: the host counts
every draft of that run as accepted (``StepBatch.lag``: an upper bound, so its blocks cover the
run) and the stage moves the run back by the drafts that run rejected (``rejected``, per slot),
on the device in a CUDA graph (``shift``, the first thing the forward does), or on the host
after reading them back for an eager step (``settle``: that step waits for the one before).
Where the stage does not hold the token rows (pipeline parallelism) the host sends the drafts
and the commits itself and nothing lags; only the acceptance count and DSpark's drafts are
computed here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import numpy as np
import torch

from engramrt.engram.hashing import EngramHasher
from engramrt.kernels import use_triton
from engramrt.model.context import ForwardContext
from engramrt.runner.batch import NewRequest, StepBatch
from engramrt.runner.slots import SlotTable
from engramrt.transfer import pinned, to_device

# (last accepted position [B], slot [B], the token sampled after it [B]) -> drafts [B, >= k]
Propose = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def ngram_drafts(
    rows: torch.Tensor, slots: torch.Tensor, last: torch.Tensor, k: int, longest: int, shortest: int
) -> torch.Tensor:
    """``[B, k]`` n-gram (prompt-lookup) drafts from the token rows: what followed the latest
    earlier occurrence of the longest suffix (``longest`` .. ``shortest`` tokens) of row
    ``slots[b]`` up to position ``last[b]``, padded with the last token found, or all the
    row's last token where no suffix recurs (``SpecConfig.propose`` with the engine's uniform
    padding). Static shapes (a CUDA graph captures it): it compares every window of the row,
    ``B x width x longest`` elements."""
    r = rows[slots.clamp_max(len(rows) - 1)].long()  # a padded graph row's spare slot: any row
    width, dev = r.shape[1], r.device
    p = last[:, None]
    found = torch.full_like(last, -1)  # where the drafts start (the occurrence's end)
    for n in range(shortest, min(longest, width - 1) + 1):  # a longer suffix wins
        suffix = r.gather(1, (p - n + 1 + torch.arange(n, device=dev)).clamp(min=0))
        hit = (r.unfold(1, n, 1) == suffix[:, None]).all(-1)  # [B, width - n + 1]
        j = torch.arange(hit.shape[1], device=dev)
        ok = hit & (j + n <= p) & (p >= n)  # earlier: it ends before the suffix's last token
        latest = torch.where(ok, j, -1).amax(1)
        found = torch.where(latest >= 0, latest + n, found)
    at = torch.where(found[:, None] >= 0, found[:, None] + torch.arange(k, device=dev), p)
    return r.gather(1, torch.minimum(at, p))


class Verifier:
    def __init__(
        self,
        num_slots: int,
        k: int,
        propose: Propose,
        slots: SlotTable | None,
        hasher: EngramHasher | None,
        device: torch.device,
    ):
        """``k`` drafts a run at most; ``propose``: the draft pass; ``slots``: the stage's slot
        table where it keeps samples and drafts in the token rows (None: the host sends them);
        ``hasher``: the history's owner where it is on this stage."""
        self.k, self.propose, self.slots, self.hasher = k, propose, slots, hasher
        self.rows = slots.tokens if slots is not None else None
        self.rejected = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
        # (padded batch, drafts a run) -> (graph, inputs, samples, the host's drafts or None,
        # drafts out): ``capture``
        self.graphs: dict[tuple[int, int], tuple] = {}

    def admit(self, new: NewRequest) -> None:
        """A new owner's run starts where the host says."""
        self.rejected[new.slot] = 0

    def shift(self, ctx: ForwardContext) -> None:
        """Move each lagging run back by the drafts its slot's last verify run rejected: its
        start, context length, token positions and cache rows (padding stays where it is)."""
        if ctx.lag is None:
            return
        if use_triton(ctx.positions.device):
            from engramrt.kernels import verify_rows

            verify_rows.shift(ctx, self.rejected)
            return
        back = ctx.lag * self.rejected[ctx.slot_ids]
        ctx.start_pos_t.sub_(back)
        ctx.context_lens.sub_(back)
        real = ctx.slot_mapping >= 0
        ctx.positions.sub_(torch.where(real, back[ctx.token_req], 0))
        bs, pos = ctx.kv.block_size, ctx.positions
        rows = ctx.full_table()[ctx.token_req, pos // bs] * bs + pos % bs
        ctx.slot_mapping.copy_(torch.where(real, rows, -1))
        if ctx.dec_lens is not None:  # decode rows of a mixed or verify graph
            ctx.dec_lens.sub_(torch.where(ctx.dec_lens > 0, back[ctx.dec_req], 0))

    def settle(self, batch: StepBatch) -> StepBatch:
        """The batch with each lagging run's true start, read back from the device (an eager
        step: it waits for the step in flight)."""
        if batch.lag is None:
            return batch
        dev = self.rejected.device
        got = self.rejected[to_device(torch.tensor(batch.slots), dev)].tolist()
        starts = [s - lag * r for s, lag, r in zip(batch.start_pos, batch.lag, got, strict=True)]
        return replace(batch, start_pos=starts, lag=None)

    def after(self, batch: StepBatch, samples: torch.Tensor) -> torch.Tensor:
        """The step's outcome on the device from its ``samples`` (``StepBatch.tails`` a run):
        acceptance counted, samples and next drafts kept in the rows, verify runs' history
        committed; the next step's drafts ``[B, k]``, from each run's last accepted position.
        Nothing waits for the device. A step whose runs are all one-token runs or all verify
        runs of ``k`` drafts replays a captured graph of this (``capture``); over a pipeline
        the host's drafts are one of its inputs."""
        n, drafts = len(batch.slots), batch.drafts or [0] * len(batch.slots)
        width = max(drafts)
        guess = None
        if self.rows is None and width:  # the host's drafts, run after run
            has = torch.arange(width) < torch.tensor(drafts)[:, None]
            guess = torch.full(has.shape, -2, dtype=torch.int64)  # never a sample (>= -1)
            guess[has] = torch.tensor(batch.draft_tokens, dtype=torch.int64)
        uniform = all(d == width for d in drafts) and all(r == 1 + width for r in batch.run_lens)
        size = min((b for b, k in self.graphs if k == width and b >= n), default=None)
        if uniform and size is not None:
            graph, x, static, host, out = self.graphs[size, width]
            x.copy_(pinned(self._inputs(batch, size, width)), non_blocking=True)
            static[: len(samples)].copy_(samples)
            if host is not None:
                host[:n].copy_(pinned(guess), non_blocking=True)
            graph.replay()
            return out[:n]
        if guess is not None:
            guess = to_device(guess, samples.device)
        x = to_device(self._inputs(batch, n, width), samples.device)
        return self._run(x, samples, width, guess)

    def _inputs(self, batch: StepBatch, size: int, width: int) -> torch.Tensor:
        """``[8, size]`` of each run: its first sample, length, slot, drafts, whether its sample
        is kept, samples, start as sent, lag; rows past the batch's are padding (no samples kept,
        the spare slot, ``1 + width`` samples each)."""
        n = len(batch.slots)
        x = np.zeros((8, size), dtype=np.int64)
        x[5] = 1 + width
        x[5, :n] = batch.tails
        x[0] = np.cumsum(x[5]) - x[5]
        x[1, :n] = batch.run_lens
        x[2] = len(self.rejected) - 1
        x[2, :n] = batch.slots
        x[3, :n] = batch.drafts if batch.drafts is not None else 0
        x[4, :n] = batch.final if batch.final is not None else 1
        x[6, :n] = batch.start_pos
        x[7, :n] = batch.lag if batch.lag is not None else 0
        return torch.from_numpy(x)

    def _run(
        self, x: torch.Tensor, samples: torch.Tensor, width: int, guess: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``after`` on device inputs (``_inputs``) and at most ``width`` drafts a run: what a
        graph captures. With the Triton kernels, the bookkeeping is two launches
        (``kernels.verify_rows``), else the torch statement below."""
        if self.rows is not None and guess is None and use_triton(x.device):
            return self._run_kernels(x, samples, width)
        first, lens, slots, drafts, final, tails, start, lag = x
        starts = start - lag * self.rejected[slots]  # (before this step replaces them)
        keep = final.bool() & (lens > 0)
        accepted = torch.zeros_like(lens)
        if width:
            at = torch.arange(width, device=x.device)
            has = at < drafts[:, None]
            if guess is None:  # the drafts the run computed, from its row
                pos = (starts[:, None] + 1 + at).clamp(0, self.rows.shape[1] - 1)
                guess = self.rows[slots[:, None], pos].long()
            got = samples[(first[:, None] + at).clamp_max(len(samples) - 1)]
            accepted = ((guess == got) & has).long().cumprod(1).sum(1)
        last = (starts + lens - 1 - drafts + accepted).clamp_min(0)  # last accepted position
        bonus = samples[(first + accepted).clamp_max(len(samples) - 1)].clamp_min(0)
        if self.rows is not None:
            self._keep(samples, starts + lens - tails, slots, keep, first, tails)
            if width and self.hasher is not None:
                self._commit(starts, slots, accepted, keep & (drafts > 0), width)
            self.rejected[torch.where(keep, slots, len(self.rejected) - 1)] = drafts - accepted
        out = self.propose(last, slots, bonus)[:, : self.k]
        if self.rows is not None:  # after the bonus, where the next run reads them
            pos = last[:, None] + 2 + torch.arange(self.k, device=x.device)
            self.slots.write(slots[:, None], pos, out, keep[:, None].expand_as(out))
        return out

    def _run_kernels(self, x: torch.Tensor, samples: torch.Tensor, width: int) -> torch.Tensor:
        from engramrt.kernels import verify_rows

        pad = self.hasher.history.pad_row if self.hasher is not None else 0
        last, bonus, accepted, keep, block, target = verify_rows.accept(
            x, samples, self.rows, self.rejected, width, pad
        )
        if width and self.hasher is not None:
            self.hasher.commit_verify(block.flatten(), target, accepted, check=False)
        out = self.propose(last, x[2], bonus)[:, : self.k]
        verify_rows.write_drafts(self.rows, x[2], last, keep, out)
        return out

    def _keep(
        self,
        samples: torch.Tensor,
        before: torch.Tensor,
        slots: torch.Tensor,
        keep: torch.Tensor,
        first: torch.Tensor,
        tails: torch.Tensor,
    ) -> None:
        """Sample ``j`` of run ``b`` fills position ``before[b] + 1 + j`` of its row."""
        dev = samples.device
        owner = torch.repeat_interleave(
            torch.arange(len(tails), device=dev), tails, output_size=len(samples)
        )
        j = torch.arange(len(samples), device=dev) - first[owner]
        self.slots.write(slots[owner], before[owner] + 1 + j, samples, keep[owner])

    def _commit(
        self,
        starts: torch.Tensor,
        slots: torch.Tensor,
        accepted: torch.Tensor,
        verified: torch.Tensor,
        width: int,
    ) -> None:
        """The verify runs' anchors and accepted drafts into their history rows (their samples
        are kept by now: the drafts they accepted are the rows' tokens there); other runs
        committed when they were hashed, and commit into the pad row here."""
        pos = (starts[:, None] + torch.arange(1 + width, device=slots.device)).clamp(
            0, self.rows.shape[1] - 1
        )
        block = self.rows[slots[:, None], pos].long()
        target = torch.where(verified, slots, self.hasher.history.pad_row)
        self.hasher.commit_verify(block.flatten(), target, accepted, check=False)

    @torch.inference_mode()
    def capture(self, sizes: list[int]) -> None:
        """CUDA graphs of ``after`` for steps of one-token runs and of ``k``-draft verify runs,
        by padded batch size (the largest first: the others reuse its memory pool); where the
        host sends the drafts, they are an input of the verify graphs (padded rows: none)."""
        self.graphs, pool = {}, None
        dev = self.rejected.device
        for width in (self.k, 0):
            for b in sorted(sizes, reverse=True):
                x = to_device(self._inputs(StepBatch(None, [], [], []), b, width), dev)
                static = torch.zeros(b * (1 + width), dtype=torch.int64, device=dev)
                host = None
                if self.rows is None and width:
                    host = torch.full((b, width), -2, dtype=torch.int64, device=dev)
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    self._run(x, static, width, host)  # first use: Triton variants
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._run(x, static, width, host)
                pool = graph.pool()
                self.graphs[b, width] = (graph, x, static, host, out)
