"""The engine: one ``step`` = schedule, run the pipeline once, apply what it sampled.

It runs on rank 0 (the first pipeline stage, which owns the Engram history); the last stage
samples with each request's own parameters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from engramrt.engine.block_manager import BlockManager
from engramrt.engine.request import Logprob, Request, SamplingParams
from engramrt.engine.scheduler import Scheduler
from engramrt.parallel.pipeline import Pipeline


@dataclass
class EngineConfig:
    max_model_len: int
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_blocks: int = 1024
    enable_prefix_caching: bool = True


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob | None] | None = None  # with the first output, when asked
    finished: bool = False
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0


class _Detok:
    """Incremental text with stop strings: text that could still become part of a stop string,
    or an unfinished UTF-8 character, is held back until it cannot."""

    def __init__(self, stops: list[str]):
        self.stops, self.sent, self.hold = stops, 0, max((len(s) for s in stops), default=1) - 1

    def update(self, text: str, finished: bool) -> tuple[str, bool]:
        """New text to emit, and whether a stop string ended the request."""
        hit = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if hit >= 0:
            text, finished = text[:hit], True
        # an unfinished UTF-8 character (U+FFFD) is held back, and the stop-string margin
        # counts from before it
        end = len(text) if finished else len(text.rstrip("\ufffd")) - self.hold
        new = text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return new, hit >= 0


class IncrementalText:
    """``decode(ids)`` of a growing output, decoding only the tokens since the last point where
    the text ended on a whole character (the earlier text is kept), so a long output costs
    O(1) per token instead of O(length). The window starts one chunk back, so tokenizers whose
    decoders strip a leading space see the same context as a full decode."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok, self.done, self.prefix, self.read = tokenizer, "", 0, 0

    def __call__(self, ids: list[int]) -> str:
        def dec(a: int, b: int | None = None) -> str:
            return self.tok.decode(ids[a:b], skip_special_tokens=True)

        head = dec(self.prefix, self.read) if self.read > self.prefix else ""
        full = dec(self.prefix)
        if not full.startswith(head):  # a decoder that rewrites earlier text: decode it all
            return dec(0)
        tail = full[len(head) :]
        if tail and not tail.endswith("\ufffd"):  # ends on a whole character: commit
            self.done += tail
            self.prefix, self.read = self.read, len(ids)
            return self.done
        return self.done + tail


class Engine:
    def __init__(self, pipeline: Pipeline, tokenizer: Tokenizer, cfg: EngineConfig):
        self.pipeline, self.tokenizer, self.cfg = pipeline, tokenizer, cfg
        model = pipeline.session.model.cfg
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos = model.eos_token_id
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self._detok: dict[str, tuple[IncrementalText, _Detok]] = {}
        self.prompt_tokens_total = self.generation_tokens_total = 0

    # --- requests ------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Validate and queue; every problem is a ValueError with the numbers in it."""
        self.validate(prompt_ids, params)
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        req = Request(request_id, list(prompt_ids), params)
        self.requests[request_id] = req
        self._detok[request_id] = (IncrementalText(self.tokenizer), _Detok(params.stop))
        self.scheduler.add(req)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """The checks of ``add_request`` that need no engine state (safe from any thread)."""
        params.validate()
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:8]} are outside the vocabulary [0, {self.vocab_size})"
            )
        total = len(prompt_ids) + params.max_tokens
        if total > self.cfg.max_model_len:
            raise ValueError(
                f"This model's maximum context length is {self.cfg.max_model_len} tokens. However, "
                f"you requested {total} tokens ({len(prompt_ids)} in the messages, "
                f"{params.max_tokens} in the completion)."
            )
        if self.blocks.blocks_for(total) > self.cfg.num_blocks:
            raise ValueError(
                f"{total} tokens need {self.blocks.blocks_for(total)} KV blocks; the cache has "
                f"{self.cfg.num_blocks}"
            )

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req, "abort")
            self._detok.pop(request_id, None)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # --- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch, admitted = self.scheduler.schedule()
        if not batch:
            return []
        hasher = self.pipeline.session.hasher
        for req in admitted:  # prefix hit, resume after preemption, or a fresh request
            hasher.rebuild(req.slot, req.all_ids[: req.num_computed])
        tokens, targets, want_targets, target_k = [], [], False, 0
        for req, n in batch:
            start = req.num_computed
            tokens += req.all_ids[start : start + n]
            k = req.params.prompt_logprobs
            for p in range(start, start + n):
                scored = k is not None and p + 1 < len(req.prompt_ids)
                targets.append(req.prompt_ids[p + 1] if scored else -1)
            if k is not None:
                want_targets, target_k = True, max(target_k, k)
        result = self.pipeline.step(
            tokens,
            [req.slot for req, _ in batch],
            [n for _, n in batch],
            [req.num_computed for req, _ in batch],
            block_tables=[req.blocks for req, _ in batch],
            sampling=[req.params.row(len(req.output_ids)) for req, _ in batch],
            targets=targets if want_targets else None,
            target_k=target_k,
        )
        now, outputs, offset = time.monotonic(), [], 0
        for i, (req, n) in enumerate(batch):
            prompt_lp = self._prompt_logprobs(req, result, offset, n) if want_targets else None
            offset += n
            first_chunk = req.num_computed == 0
            req.num_computed += n
            self.blocks.register(req)
            if first_chunk and req.params.prompt_logprobs is not None:
                req.prompt_logprobs = [None]
            if prompt_lp:
                req.prompt_logprobs += prompt_lp
            if req.num_computed < req.num_tokens:  # mid-prompt chunk: its sample is not used
                continue
            outputs.append(self._append(req, result, i, now))
        return outputs

    def _prompt_logprobs(self, req: Request, result, offset: int, n: int) -> list[Logprob]:
        if req.params.prompt_logprobs is None:
            return []
        k = req.params.prompt_logprobs
        out = []
        for j in range(offset, offset + n):
            p = req.num_computed + (j - offset)
            if p + 1 < len(req.prompt_ids):
                out.append(Logprob(result.target_logprobs[j], result.target_top_ids[j][:k],
                                   result.target_top_logprobs[j][:k]))  # fmt: skip
        return out

    def _append(self, req: Request, result, i: int, now: float) -> RequestOutput:
        token = result.tokens[i]
        new_lp = []
        if req.params.logprobs is not None:
            k = req.params.logprobs
            new_lp = [
                Logprob(result.logprobs[i], result.top_ids[i][:k], result.top_logprobs[i][:k])
            ]
            req.output_logprobs += new_lp
        first = not req.output_ids
        req.output_ids.append(token)
        req.first_token_time = req.first_token_time or now
        req.last_token_time = now
        self.generation_tokens_total += 1
        if first:
            self.prompt_tokens_total += len(req.prompt_ids)
        p = req.params
        reason = None
        if (token == self.eos and not p.ignore_eos) or token in p.stop_token_ids:
            reason = "stop"
        elif len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.cfg.max_model_len:
            reason = "length"
        text, stops = self._detok[req.id]
        new_text, hit_stop = stops.update(text(req.output_ids), reason is not None)
        if hit_stop:
            reason = "stop"
        out = RequestOutput(
            req.id, [token], new_text, new_lp,
            req.prompt_logprobs if first and p.prompt_logprobs is not None else None,
            reason is not None, reason, len(req.prompt_ids), len(req.output_ids),
        )  # fmt: skip
        if reason is not None:
            self.scheduler.finish(req, reason)
            self.requests.pop(req.id, None)
            self._detok.pop(req.id, None)
        return out

    # --- gauges --------------------------------------------------------------------------

    def stats(self) -> dict[str, float]:
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
        }
