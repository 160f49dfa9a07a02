"""The engine: one ``step`` = schedule, launch the pipeline once, apply what it sampled.

It runs on rank 0 (the first pipeline stage, which owns the Engram history); the last stage
samples with each request's own parameters. A request is validated once, where it is built
(``new_request``); inside the engine only cheap invariants are checked.

Overlap scheduling (``async_scheduling``, a pipeline of one stage): a step's sampled tokens stay on
the device and feed the next step (the stage keeps them in its token rows); ``step`` schedules and
launches step N+1 and only then waits for step N's tokens and applies them, so the host's work
overlaps the GPU's. The host thus learns tokens one step late: a request that stops at step N (EOS,
a stop token or string) has already been scheduled in step N+1, whose row is discarded, while a
request that reaches max_tokens is known in advance and not scheduled again (behind a verify run,
which is sure of one token only, one more run may be discarded). Without overlap the
same loop waits for the step it just launched. With speculation the stage verifies and drafts on
the device (``engramrt.runner.verify``): a verify run in flight counts as if all its drafts are
accepted, and the run after it is moved back on the device (``StepBatch.lag``).
"""

from __future__ import annotations

import sys
import time
import weakref
from dataclasses import dataclass, field, replace
from typing import Protocol

from tokenizers import Tokenizer

from engramrt.engine.block_manager import BlockManager
from engramrt.engine.grammar import Grammars, one_line, token_mask
from engramrt.engine.request import (
    Logprob,
    Request,
    RequestLimits,
    SamplingParams,
    Status,
)
from engramrt.engine.scheduler import Scheduler
from engramrt.engine.speculative import SpecConfig, accepted
from engramrt.runner.batch import DeviceResult, NewRequest, StepBatch, StepResult


class Runs(Protocol):
    """What the engine drives: the pipeline on rank 0 (or a stub, in the host benchmark). A
    pipeline that can overlap also has ``launch(batch) -> DeviceResult`` and ``can_overlap``."""

    def step(self, batch: StepBatch) -> StepResult: ...


@dataclass
class Row:
    """One request's run in a launched step."""

    req: Request
    n: int  # tokens computed
    start: int  # from this position
    samples: bool  # the run ends at the request's last token: its sample is the next token
    epoch: int  # the request's preemption count at launch (a preempted run's K/V is gone)
    drafts: list[int] = field(default_factory=list)  # speculative tokens after the anchor


@dataclass
class Held:
    """How much of a running request the stages' copy holds (the step message's bookkeeping,
    not the block manager's): blocks of its table, tokens of its row."""

    blocks: int
    tokens: int


@dataclass
class InFlight:
    rows: list[Row]
    result: DeviceResult


@dataclass
class EngineConfig:
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True
    eos_token_id: int | None = None  # the model config's; None: a model without EOS
    model_vocab_size: int | None = None  # the embedding's rows; None: the tokenizer's size
    async_scheduling: bool = False  # overlap scheduling (on by default via EngineOptions.overlap)
    long_prefill_token_threshold: int = 0  # a prompt's tokens per step, at most (0: the budget)
    speculative: SpecConfig | None = None  # n-gram drafts (``engramrt.engine.speculative``)
    # every decoding row gets exactly K drafts where room allows (a lookup that finds fewer is
    # padded with its last token), so verify steps replay the runner's verify graphs
    uniform_drafts: bool = False
    text_only_image_token: int | None = None  # refused in prompts (``RequestLimits``)
    # per-request state kept apart from the blocks for prefix hits (V4.1's window snapshots;
    # ``BlockManager``); 0: the blocks hold it all
    window_snapshots: int = 0


@dataclass
class RequestOutput:
    """What one step gave a request. The engine sends token ids; ``new_text`` is filled where
    text is wanted (``engramrt.engine.detokenize.RequestText``, in the server's process), which
    also ends a request at a stop string."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob | None] | None = None  # with the first output, when asked
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None  # why the request failed (finish reason "error")
    # whose failure: the request's own (a grammar it cannot follow: the client's 400) or, True,
    # the model's (logits that are not finite: the server's 500)
    model_failed: bool = False

    def then(self, later: RequestOutput) -> RequestOutput:
        """This output followed by ``later`` (of the same request) as one output: a stream
        sends them as one chunk."""
        return replace(
            later,
            new_token_ids=self.new_token_ids + later.new_token_ids,
            new_text=self.new_text + later.new_text,
            new_logprobs=self.new_logprobs + later.new_logprobs,
            prompt_logprobs=self.prompt_logprobs or later.prompt_logprobs,
        )


# the engine's gauges and counters (a per-position counter is a list)
Stats = dict[str, float | list[int]]


class Engine:
    def __init__(self, pipeline: Runs, tokenizer: Tokenizer, cfg: EngineConfig):
        self.pipeline, self.tokenizer, self.cfg = pipeline, tokenizer, cfg
        self.tokenizer_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.limits = RequestLimits(
            self.tokenizer_size,
            cfg.model_vocab_size,
            cfg.max_model_len,
            cfg.num_blocks,
            cfg.block_size,
            cfg.eos_token_id,
            cfg.text_only_image_token,
        )
        self.blocks = BlockManager(
            cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching, cfg.window_snapshots
        )
        propose = self._propose if cfg.speculative is not None else None
        self.scheduler = Scheduler(
            self.blocks,
            cfg.max_num_seqs,
            cfg.max_num_batched_tokens,
            cfg.long_prefill_token_threshold,
            propose,
            cfg.max_model_len,
        )
        self.requests: dict[str, Request] = {}
        self.prompt_tokens_total = self.generation_tokens_total = 0
        can = bool(getattr(pipeline, "can_overlap", False))
        if cfg.async_scheduling and not can:
            raise ValueError(
                "async scheduling needs a pipeline of one stage that samples on the device "
                "(with pipeline parallelism the engine schedules synchronously)"
            )
        self.overlap = bool(cfg.async_scheduling)
        # history commits of the last step's verify runs, sent with the next step (where the
        # stage does not keep the samples; where it does, it drafts and commits itself)
        self.commits: list[tuple[int, list[int], int]] = []
        self.spec_drafts = self.spec_draft_tokens = self.spec_accepted_tokens = 0
        k = cfg.speculative.num_speculative_tokens if cfg.speculative is not None else 0
        self.spec_accepted_per_pos = [0] * k  # verify runs that accepted their draft j
        self.grammars = Grammars(tokenizer, self.tokenizer_size, cfg.eos_token_id)
        self.in_flight: InFlight | None = None  # the launched step not applied yet (overlap)
        # what the stages hold of each running request (gone with the request)
        self.held: weakref.WeakKeyDictionary[Request, Held] = weakref.WeakKeyDictionary()
        # the stage writes each final sample into its token row itself (one stage, one rank);
        # with speculation it also verifies, commits and drafts there (``runner.verify``)
        self.samples_kept = can

    @property
    def vocab_size(self) -> int:
        """The ids a prompt may hold (``RequestLimits.vocab_size``)."""
        return self.limits.vocab_size

    # --- requests ------------------------------------------------------------------------

    def new_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> Request:
        """A validated request (``RequestLimits.check``) with its grammar's matcher. Needs no
        engine state, so an in-process caller may call it on its own thread."""
        self.limits.check(prompt_ids, params)
        req = Request(request_id, prompt_ids, params)
        if params.grammar is not None:
            req.matcher = self.grammars.matcher(params.grammar)
        return req

    def add(self, req: Request) -> None:
        """Queue a request built by ``new_request``."""
        if req.id in self.requests:
            raise ValueError(f"request id {req.id!r} is already in use")
        self.requests[req.id] = req
        self.scheduler.add(req)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.add(self.new_request(request_id, prompt_ids, params))

    def abort(self, request_id: str) -> None:
        """Finish now, even with a step in flight: freeing its blocks and slot at once is safe
        because every GPU write of that step (K/V, the history commit, the samples and drafts
        kept in the token row, ``Verifier.rejected``) is ordered on the stream before any later
        step that could reuse them, and a later owner of a slot or block rebuilds its history
        row, its token row and its rejected count and writes every K/V row before reading it;
        the step's row for the request is discarded when it is applied."""
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req, "abort")

    def has_work(self) -> bool:
        """Requests to schedule, or a launched step with tokens to deliver (one whose requests
        have all finished or been aborted is left alone: the next step discards it)."""
        if self.scheduler.has_work():
            return True
        launched = self.in_flight
        return launched is not None and any(
            r.req.status is not Status.FINISHED for r in launched.rows
        )

    # --- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Launch the next step; then apply the previous one (with overlap) or this one. With
        overlap and nothing new to run, this only delivers the step in flight. While a guided
        request runs, a step's grammar masks need the previous tokens: the step in flight is
        applied first and the new one runs synchronously (so does every step while a seeded
        request speculates: its samples' indices must be known)."""
        if self.overlap and not self._needs_sync():
            launched = self._launch()
            previous, self.in_flight = self.in_flight, launched
            return self._apply(previous) if previous is not None else []
        outputs = self._apply(self.in_flight) if self.in_flight is not None else []
        self.in_flight = None
        launched = self._launch()
        return outputs + (self._apply(launched) if launched is not None else [])

    def _needs_sync(self) -> bool:
        s = self.scheduler
        speculating = self.cfg.speculative is not None
        return any(
            r.needs_host_tokens or (speculating and r.params.seed is not None)
            for r in (*s.running, *s.waiting)
        )

    def _launch(self) -> InFlight | None:
        """Schedule (a running request's pending token counts as present), build the batch and
        launch it; the positions, blocks and pending counts it implies are taken at once."""
        scheduled, admitted = self.scheduler.schedule()
        if not scheduled:
            return None
        new = [self._new_request(req) for req in admitted]
        asked = [
            r.params.prompt_logprobs for r, _ in scheduled if r.params.prompt_logprobs is not None
        ]
        target_k = max(asked) if asked else None  # prompt tokens are scored only when asked
        tokens, targets, starts, new_blocks, rows, index, final = [], [], [], [], [], [], []
        masks, drafts, counts, snapshots, lag = [], [], [], [], []
        kept = self.samples_kept
        # requests whose verify run is in flight: this run's start counts its drafts as
        # accepted, and the stage moves it back by those it rejected (``runner.verify``)
        behind = {r.req for r in self.in_flight.rows if r.drafts} if self.in_flight else set()
        for req, n in scheduled:
            held = self.held[req]
            # a verify step's rejected drafts may have given blocks back since the last send
            sent = min(held.blocks, len(req.blocks))
            starts.append(sent)
            new_blocks.append(req.blocks[sent:])  # usually none: O(new blocks)
            held.blocks = len(req.blocks)
            start = req.num_computed
            end = start + n
            # the run's tokens the row lacks (a verify run: the anchor and the drafts); none
            # where the stage kept the last sample and drafted (overlap: the host may not
            # know them yet)
            if held.tokens < end:
                fresh = req.token_ids[held.tokens : end] + ([] if kept else req.drafts)
                tokens += fresh
                counts.append(len(fresh))
            else:
                counts.append(0)
            if target_k is not None:
                scored = req.params.prompt_logprobs is not None
                for p in range(start + 1, start + n + 1):  # token p - 1 predicts token p
                    targets.append(req.token_ids[p] if scored and p < req.num_prompt_tokens else -1)
            samples = start + n == req.num_tokens + req.unread or bool(req.drafts)
            drafts.append(len(req.drafts))
            index.append(req.num_output_tokens + req.unread)
            final.append(samples)
            if samples and req.needs_host_tokens:
                mask = token_mask(req, self.vocab_size)
                if mask is not None:
                    masks.append((len(rows), mask))
            rows.append(Row(req, n, start, samples, req.num_preemptions, req.drafts))
            lag.append(int(req in behind))
            req.row_drafted |= kept and samples
            if kept and samples:  # the stage writes the sample into the row itself
                end += 1
            if end > held.tokens:
                held.tokens = end
            req.num_computed += n
            req.unread += samples * (1 + len(req.drafts))  # as if every draft is accepted
            exact = not (req.drafts or lag[-1])  # where the run ends is known
            kept_window = self.blocks.keep_window(req, req.num_computed) if exact else None
            if kept_window is not None:
                snapshots.append((req.slot, kept_window))
        batch = StepBatch(
            tokens,
            [req.slot for req, _ in scheduled],
            [n for _, n in scheduled],
            [r.start for r in rows],
            new_blocks=new_blocks,
            block_starts=starts,
            admitted=new,
            token_counts=counts,
            sample_index=index,
            final=final,
            targets=targets if target_k is not None else None,
            target_k=target_k or 0,
            masks=masks,
            drafts=drafts if any(drafts) else None,
            draft_tokens=[] if kept else [t for r in rows for t in r.drafts],
            commits=self.commits,
            snapshots=snapshots,
            lag=lag if any(lag) else None,
        )
        self.commits = []
        launch = getattr(self.pipeline, "launch", None)
        if launch is None:  # a stub with ``step`` only
            return InFlight(rows, DeviceResult.ready(self.pipeline.step(batch)))
        return InFlight(rows, launch(batch))

    def _new_request(self, req: Request) -> NewRequest:
        """A request taking its slot: everything the stages keep for it, sent once (a resumed
        preempted request brings its outputs too: penalties count them)."""
        controls = req.params.controls(self.cfg.eos_token_id)
        self.held[req] = Held(len(req.blocks), req.num_tokens)
        req.row_drafted = False
        return NewRequest(
            req.slot,
            list(req.token_ids),
            req.num_prompt_tokens,
            req.num_computed,
            list(req.blocks),
            req.params.row(0),
            controls,
            req.snapshot,
        )

    def _apply(self, launched: InFlight) -> list[RequestOutput]:
        """Wait for a launched step's tokens and apply them. Rows of requests that finished or
        were aborted since it was launched are discarded (their extra token was never theirs);
        a request preempted since keeps a sampled token (it was the next one) but nothing of a
        prompt chunk (it is recomputed)."""
        result = launched.result.wait()
        now, outputs, offset, x = time.monotonic(), [], 0, 0
        for b, row in enumerate(launched.rows):
            req, n, i = row.req, row.n, x  # i: the row's first sample
            offset += n
            x += 1 + len(row.drafts)
            if req.status is Status.FINISHED:
                continue
            preempted = req.num_preemptions != row.epoch
            if preempted and not row.samples:
                continue
            if req.params.prompt_logprobs is not None:
                self._add_prompt_logprobs(req, result, offset - n, n, row.start)
            self.blocks.register(req)
            if not row.samples:  # mid-prompt chunk: its sample is not used
                continue
            req.unread -= 1 + len(row.drafts)
            if row.drafts and not preempted:
                outputs.append(self._verified(req, row, result, i, now))
            else:
                outputs.append(self._append(req, result, i, now))
            if result.drafts is not None and not preempted:  # DSpark's, for what follows
                req.proposed, req.proposed_at = result.drafts[b], req.num_tokens
        return outputs

    def _propose(self, req: Request, limit: int) -> list[int]:
        """Drafts for a decoding request with nothing that needs its tokens one at a time
        (grammars, logit controls, logprobs), within the context (and max_tokens unless every
        run verifies K drafts: those past it are discarded with the rest of the run)."""
        p = req.params
        if (
            req.needs_host_tokens
            or p.logprobs is not None
            or p.prompt_logprobs is not None
            or p.controls(self.cfg.eos_token_id) is not None
        ):
            return []
        room = min(limit, self.cfg.max_model_len - req.num_tokens - req.unread)
        if not self.cfg.uniform_drafts:  # (a verify graph costs the same with drafts past it)
            room = min(room, p.max_tokens - req.num_output_tokens - req.unread - 1)
        spec = self.cfg.speculative
        k = spec.num_speculative_tokens
        if self.samples_kept:  # the stage drafted k into the row; only the count is the host's
            if not req.row_drafted:
                return []
            return [-1] * (k if room >= k else 0 if self.cfg.uniform_drafts else max(room, 0))
        if spec.method == "dspark":  # drafted by the last step, when that left it here
            return req.proposed[: min(k, room)] if req.proposed_at == req.num_tokens else []
        drafts = spec.propose(req.token_ids, room)
        if self.cfg.uniform_drafts and room >= k:  # any token is a valid guess
            drafts += [(drafts or req.token_ids)[-1]] * (k - len(drafts))
        return drafts

    def _verified(
        self, req: Request, row: Row, result: StepResult, i: int, now: float
    ) -> RequestOutput:
        """A verify run's outcome: its accepted drafts and the bonus token, in one output; the
        rejected drafts' positions are computed no more and their spare blocks go back; the
        history commit (anchor + accepted) goes with the next step, unless the stage made it.
        Drafts the stage made are known from the step before (``Request.proposed``)."""
        drafts = row.drafts
        if self.samples_kept:
            if req.proposed_at != req.num_tokens:
                raise RuntimeError(
                    f"request {req.id}: the stage's drafts for token "
                    f"{req.num_tokens} were never received"
                )
            drafts = req.proposed[: len(row.drafts)]
        a = accepted(drafts, result.tokens[i : i + 1 + len(drafts)])
        held = self.held[req]
        if not self.samples_kept:  # the row past the accepted drafts holds rejected ones
            held.tokens = min(held.tokens, row.start + 1 + a)
        self.spec_drafts += 1
        self.spec_draft_tokens += len(drafts)
        self.spec_accepted_tokens += a
        for j in range(a):
            self.spec_accepted_per_pos[j] += 1
        req.num_computed -= len(drafts) - a
        out = None
        for j in range(a + 1):
            nxt = self._append(req, result, i + j, now)
            out = nxt if out is None else out.then(nxt)
            if nxt.finished:
                return out
        # (a run launched behind this one computes up to num_computed: its blocks stay)
        self.blocks.shrink(req, max(req.num_tokens, req.num_computed))
        # the stage's table keeps the given-back blocks until the next send, which starts here:
        # a block taken again at the same index may be another one (another request's since)
        held.blocks = min(held.blocks, len(req.blocks))
        if not self.samples_kept:
            self.commits.append((req.slot, [req.token_ids[row.start], *drafts], a))
        return out

    def _add_prompt_logprobs(
        self, req: Request, result: StepResult, offset: int, n: int, start: int
    ) -> None:
        """The scores of the prompt tokens this chunk predicts (the first token has none)."""
        k = req.params.prompt_logprobs
        if start == 0:
            req.prompt_logprobs = [None]
        for j in range(offset, offset + n):
            if start + (j - offset) + 1 < req.num_prompt_tokens:
                req.prompt_logprobs.append(
                    Logprob(
                        result.target_logprobs[j],
                        result.target_top_ids[j][:k],
                        result.target_top_logprobs[j][:k],
                    )
                )

    def _append(self, req: Request, result: StepResult, i: int, now: float) -> RequestOutput:
        if result.finite is not None and not result.finite[i]:
            return self._not_finite(req)
        token, p = result.tokens[i], req.params
        if p.max_tokens == 0:  # the prompt alone: its logprobs, no token
            self.prompt_tokens_total += req.num_prompt_tokens
            self.scheduler.finish(req, "length")
            self.requests.pop(req.id, None)
            return RequestOutput(
                req.id,
                [],
                "",
                [],
                req.prompt_logprobs if p.prompt_logprobs is not None else None,
                True,
                "length",
                req.num_prompt_tokens,
            )
        new_lp = []
        if p.logprobs is not None:
            k = p.logprobs
            new_lp = [
                Logprob(result.logprobs[i], result.top_ids[i][:k], result.top_logprobs[i][:k])
            ]
            req.output_logprobs += new_lp
        first = req.num_output_tokens == 0
        req.token_ids.append(token)
        self.blocks.register(req)  # before a finish releases the blocks
        req.first_token_time = req.first_token_time or now
        req.last_token_time = now
        self.generation_tokens_total += 1
        if first:
            self.prompt_tokens_total += req.num_prompt_tokens
        reason = None
        if (token == self.cfg.eos_token_id and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        elif req.num_output_tokens >= p.max_tokens or req.num_tokens >= self.cfg.max_model_len:
            reason = "length"
        error = None
        if req.matcher is not None:  # the grammar follows the token; complete: the request stops
            req.matcher.consume_token(token)
            if req.matcher.is_error():  # the output no longer follows it: never a silent stop
                reason = "error"
                detail = req.matcher.get_error()
                error = f"the grammar cannot be followed: {one_line(detail)}"
                print(f"engramrt: request {req.id}: {detail}", file=sys.stderr, flush=True)
            elif reason is None and req.matcher.is_stopped():
                reason = "stop"
        out = RequestOutput(
            req.id,
            [token],
            "",
            new_lp,
            req.prompt_logprobs if first and p.prompt_logprobs is not None else None,
            reason is not None,
            reason,
            req.num_prompt_tokens,
            req.num_output_tokens,
            error,
        )
        if reason is not None:
            self.scheduler.finish(req, reason)
            self.requests.pop(req.id, None)
        return out

    def _not_finite(self, req: Request) -> RequestOutput:
        """The logits of its next token hold NaN or infinity: the request ends with an error
        and nothing sampled from them is kept (its other requests' rows are their own)."""
        error = (
            f"request {req.id}: the model's logits for output token {req.num_output_tokens} "
            "hold NaN or infinity (a weight of the checkpoint, or an overflow); nothing was "
            "sampled from them"
        )
        print(f"engramrt: {error}", file=sys.stderr, flush=True)
        self.scheduler.finish(req, "error")
        self.requests.pop(req.id, None)
        return RequestOutput(
            req.id,
            [],
            "",
            finished=True,
            finish_reason="error",
            num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens,
            error=error,
            model_failed=True,
        )

    # --- gauges --------------------------------------------------------------------------

    def stats(self) -> Stats:
        s = self.scheduler
        return {
            "num_requests_running": len(s.running),
            "num_requests_waiting": len(s.waiting),
            "kv_cache_usage_perc": 1 - self.blocks.num_free / self.cfg.num_blocks,
            "kv_blocks_free": self.blocks.num_free,
            "engram_history_slots_used": s.slots_in_use,
            "num_preemptions": s.num_preemptions,
            "prefix_cache_queries": self.blocks.queries,
            "prefix_cache_hits": self.blocks.hits,
            "spec_decode_num_drafts": self.spec_drafts,
            "spec_decode_num_draft_tokens": self.spec_draft_tokens,
            "spec_decode_num_accepted_tokens": self.spec_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.spec_accepted_per_pos),
            "prompt_tokens": self.prompt_tokens_total,
            "generation_tokens": self.generation_tokens_total,
        }
