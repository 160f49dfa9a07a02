"""The engine: one ``step`` = schedule, run the pipeline once, apply what it sampled.

It runs on rank 0 (the first pipeline stage, which owns the Engram history); the last stage
samples with each request's own parameters. A request is validated once, where it is built
(``new_request``); inside the engine only cheap invariants are checked.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from tokenizers import Tokenizer

from engramrt.engine.block_manager import BlockManager
from engramrt.engine.detokenize import OutputText
from engramrt.engine.request import Logprob, Request, SamplingParams
from engramrt.engine.scheduler import Scheduler
from engramrt.runner.batch import StepBatch, StepResult


class Runs(Protocol):
    """What the engine drives: the pipeline on rank 0 (or a stub, in the host benchmark)."""

    def step(self, batch: StepBatch) -> StepResult: ...


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


class Engine:
    def __init__(self, pipeline: Runs, tokenizer: Tokenizer, cfg: EngineConfig):
        self.pipeline, self.tokenizer, self.cfg = pipeline, tokenizer, cfg
        # ids must index both the tokenizer (Engram token map) and the embedding: a tokenizer
        # larger than the model's vocab_size must not let one request crash the engine
        self.tokenizer_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.vocab_size = min(self.tokenizer_size, cfg.model_vocab_size or self.tokenizer_size)
        self.blocks = BlockManager(cfg.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, cfg.max_num_batched_tokens)
        self.requests: dict[str, Request] = {}
        self.prompt_tokens_total = self.generation_tokens_total = 0

    # --- requests ------------------------------------------------------------------------

    def new_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> Request:
        """The one validation of a request, with the numbers in every ValueError. Needs no
        engine state, so the server calls it on its own thread, at the boundary."""
        params.validate()
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"token ids {bad[:8]} are outside the vocabulary [0, {self.vocab_size}) (the "
                f"tokenizer has {self.tokenizer_size} tokens, the model's embedding "
                f"{self.cfg.model_vocab_size or self.tokenizer_size} rows)"
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
        return Request(request_id, prompt_ids, params)

    def add(self, req: Request) -> None:
        """Queue a request built by ``new_request``."""
        if req.id in self.requests:
            raise ValueError(f"request id {req.id!r} is already in use")
        req.text = OutputText(self.tokenizer, req.params.stop, req.num_prompt_tokens)
        self.requests[req.id] = req
        self.scheduler.add(req)

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        self.add(self.new_request(request_id, prompt_ids, params))

    def abort(self, request_id: str) -> None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self.scheduler.finish(req, "abort")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    # --- one step ------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        batch, admitted = self.scheduler.schedule()
        if not batch:
            return []
        for req in admitted:  # a new slot: the stages' table for it is sent whole
            req.blocks_sent = 0
        asked = [r.params.prompt_logprobs for r, _ in batch if r.params.prompt_logprobs is not None]
        target_k = max(asked) if asked else None  # prompt tokens are scored only when asked
        tokens, targets, starts, new_blocks = [], [], [], []
        for req, n in batch:
            starts.append(req.blocks_sent)
            new_blocks.append(req.blocks[req.blocks_sent :])  # usually none: O(new blocks)
            req.blocks_sent = len(req.blocks)
            start = req.num_computed
            tokens += req.token_ids[start : start + n]
            if target_k is not None:
                scored = req.params.prompt_logprobs is not None
                for p in range(start + 1, start + n + 1):  # token p - 1 predicts token p
                    targets.append(req.token_ids[p] if scored and p < req.num_prompt_tokens
                                   else -1)  # fmt: skip
        result = self.pipeline.step(
            StepBatch(
                tokens,
                [req.slot for req, _ in batch],
                [n for _, n in batch],
                [req.num_computed for req, _ in batch],
                new_blocks=new_blocks,
                block_starts=starts,
                sampling=[req.params.row(req.num_output_tokens) for req, _ in batch],
                targets=targets if target_k is not None else None,
                target_k=target_k or 0,
                rebuilds=[(req.slot, req.token_ids[: req.num_computed]) for req in admitted],
            )
        )
        now, outputs, offset = time.monotonic(), [], 0
        for i, (req, n) in enumerate(batch):
            if req.params.prompt_logprobs is not None:
                self._add_prompt_logprobs(req, result, offset, n)
            offset += n
            req.num_computed += n
            self.blocks.register(req)
            if req.num_computed < req.num_tokens:  # mid-prompt chunk: its sample is not used
                continue
            outputs.append(self._append(req, result, i, now))
        return outputs

    def _add_prompt_logprobs(self, req: Request, result: StepResult, offset: int, n: int) -> None:
        """The scores of the prompt tokens this chunk predicts (the first token has none)."""
        k = req.params.prompt_logprobs
        if req.num_computed == 0:
            req.prompt_logprobs = [None]
        for j in range(offset, offset + n):
            if req.num_computed + (j - offset) + 1 < req.num_prompt_tokens:
                req.prompt_logprobs.append(Logprob(
                    result.target_logprobs[j], result.target_top_ids[j][:k],
                    result.target_top_logprobs[j][:k],
                ))  # fmt: skip

    def _append(self, req: Request, result: StepResult, i: int, now: float) -> RequestOutput:
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
        new_text, hit_stop = req.text.update(req.token_ids, reason is not None)
        if hit_stop:
            reason = "stop"
        out = RequestOutput(
            req.id, [token], new_text, new_lp,
            req.prompt_logprobs if first and p.prompt_logprobs is not None else None,
            reason is not None, reason, req.num_prompt_tokens, req.num_output_tokens,
        )  # fmt: skip
        if reason is not None:
            self.scheduler.finish(req, reason)
            self.requests.pop(req.id, None)
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
