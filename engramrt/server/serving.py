"""Serving the API on the engine: requests become validated engine requests (one per choice),
their outputs are merged as they come, and completions and chat turn them into a stream of SSE
chunks or into one response. Both share the streaming and collecting loops and differ only in
how a choice looks, so each behaviour has a single code path."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any

from engramrt.engine.client import EngineClient
from engramrt.engine.engine import RequestOutput
from engramrt.engine.request import Logprob, Request, SamplingParams, check_context_length
from engramrt.prompts import PromptEncoder
from engramrt.server.metrics import Metrics
from engramrt.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from engramrt.server.responses import (
    ApiError,
    Envelope,
    TextOffsets,
    chat_choice,
    chat_chunk_choice,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    join_completion_logprobs,
    sse,
    usage,
)


@dataclass
class ServerConfig:
    model_names: list[str]
    max_model_len: int
    api_key: str | None = None
    max_request_bytes: int = 32 * 2**20
    log_requests: bool = False  # one log line per API request (vLLM's --enable-log-requests)
    # what a request leaves out, by field (vLLM's --override-generation-config)
    defaults: dict[str, Any] = field(default_factory=dict)


@dataclass
class Choice:
    """One engine request: an API request asks for ``n`` of these per prompt."""

    index: int
    request: Request  # built, and so validated, by the engine
    prompt_text: str | None = None  # as the client sent it, for echo

    @property
    def prompt_ids(self) -> list[int]:
        return self.request.prompt_ids


@dataclass
class ChoiceResult:
    """All one choice produced, gathered for a response that is not streamed."""

    choice: Choice
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_out: RequestOutput | None = None  # the output that carries the prompt's logprobs

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.finish_reason = out.finish_reason
        if out.prompt_logprobs is not None:
            self.prompt_out = out


@dataclass
class StreamState:
    """What a stream has sent of one choice so far."""

    offsets: TextOffsets | None = None  # of the generated tokens, from the choice's first chunk
    output_tokens: int = 0  # for the closing usage chunk
    held: RequestOutput | None = None  # an output with no text yet (an incomplete character)

    def take(self, out: RequestOutput, opens: bool) -> RequestOutput | None:
        """The output to send now, joined with any held before it; None to hold this one: a
        chunk without text (a token ending inside a character) confuses clients that count a
        chunk per token, unless it opens the choice (an echo) or finishes it."""
        held, self.held = self.held, None
        if held is not None:
            out = held.then(out)
        if not out.new_text and not out.finished and not opens:
            self.held = out
            return None
        return out


class Server:
    """The engine, tokenizer and config behind the app, and the only place that hands requests
    to the engine (``new_request`` while building them, ``generate`` while running them)."""

    def __init__(self, engine: EngineClient, prompts: PromptEncoder, cfg: ServerConfig):
        self.engine, self.prompts, self.tok, self.cfg = engine, prompts, prompts.tokenizer, cfg
        self.metrics = Metrics(engine, cfg.model_names[0])
        self.created = int(time.time())

    # --- building requests ----------------------------------------------------------------

    def check_model(self, model: str | None) -> str:
        if model is not None and model not in self.cfg.model_names:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return model or self.cfg.model_names[0]

    def encode(self, text: str, special: bool = True) -> list[int]:
        try:
            self.prompts.check_fits(text, self.cfg.max_model_len)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="prompt") from None
        return self.prompts.text(text, special)

    def bad_words(self, words: list[str]) -> tuple[list[int], list[list[int]]]:
        """vLLM's ``bad_words``, as written and after a space: words of one token (banned
        outright) and the token sequences of longer ones."""
        single, seqs = [], []
        for word in words:
            for variant in {word, " " + word.lstrip()}:
                enc = self.encode(variant, special=False)
                if len(enc) == 1:
                    single += enc
                elif enc:
                    seqs.append(enc)
        return single, seqs

    def completion_prompts(
        self, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> list[tuple[list[int], str | None]]:
        """(token ids, the text as sent when it was text)."""
        if isinstance(prompt, str):
            return [(self.encode(prompt), prompt)]
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [(list(prompt), None)]
        return [(self.encode(p), p) if isinstance(p, str) else (list(p), None) for p in prompt]

    def chat_prompt(
        self, messages: list[ChatMessage], add_generation_prompt: bool = True, special: bool = False
    ) -> list[int]:
        chat = [{"role": m.template_role, "content": m.text()} for m in messages]
        try:
            return self.prompts.chat(chat, add_generation_prompt, special, self.cfg.max_model_len)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="messages") from None

    def choices(
        self,
        prompts: list[tuple[list[int], str | None]],
        req: CompletionRequest | ChatCompletionRequest,
        max_tokens: int | None,
        logprobs: int | None,
        echo_k: int | None,
        echo: bool = False,
    ) -> list[Choice]:
        """``prompts``: (ids, text or None) pairs; ``req.n`` choices for each. ``echo``
        allows ``max_tokens`` 0 (the prompt and its logprobs alone)."""
        (banned, bad_seqs), grammar = self.bad_words(req.bad_words), req.grammar()
        out = []
        for i, (prompt, text) in enumerate(prompts):
            limit = self.cfg.max_model_len
            mt = max_tokens
            if mt is None:  # the rest of the context, or less by the server's default
                mt = min(limit - len(prompt), self.cfg.defaults.get("max_tokens", limit))
            if mt == 0 and not echo:
                raise ApiError(
                    400, "max_tokens 0 needs echo (the prompt alone)", param="max_tokens"
                )
            try:
                check_context_length(len(prompt), mt, limit)
            except ValueError as exc:
                raise ApiError(400, str(exc), param="max_tokens") from None
            for j in range(req.n):
                params = SamplingParams(
                    max_tokens=mt,
                    temperature=self._given(req, "temperature"),
                    top_p=self._given(req, "top_p"),
                    top_k=max(self._given(req, "top_k"), 0),
                    min_p=self._given(req, "min_p"),
                    seed=None if req.seed is None else req.seed + j,
                    stop=req.stops(),
                    stop_token_ids=list(req.stop_token_ids),
                    ignore_eos=req.ignore_eos,
                    logprobs=logprobs,
                    prompt_logprobs=echo_k,
                    presence_penalty=req.presence_penalty,
                    frequency_penalty=req.frequency_penalty,
                    repetition_penalty=self._given(req, "repetition_penalty"),
                    logit_bias=req.bias(),
                    min_tokens=req.min_tokens,
                    allowed_token_ids=req.allowed_token_ids,
                    banned_ids=banned,
                    bad_word_seqs=bad_seqs,
                    grammar=grammar,
                )
                try:
                    request = self.engine.new_request(uuid.uuid4().hex, prompt, params)
                except ValueError as exc:
                    raise ApiError(400, str(exc)) from None
                out.append(Choice(i * req.n + j, request, text))
        return out

    def _given(self, req: CompletionRequest | ChatCompletionRequest, name: str) -> Any:
        """A sampling field as the request gave it, else the server's default for it, else the
        API's (vLLM's order); ``null`` counts as not given."""
        if name in req.model_fields_set:
            return getattr(req, name)
        return self.cfg.defaults.get(name, getattr(req, name))

    # --- running them ---------------------------------------------------------------------

    async def _pump(self, choice: Choice, sink: asyncio.Queue) -> None:
        """One request's outputs into the shared queue, with its latency metrics; a request that
        ends without finishing (a disconnect, an error) counts as aborted, as in vLLM."""
        start, last, model = time.monotonic(), None, self.metrics.model
        finished = False
        try:
            async for out in self.engine.generate(choice.request):
                now = time.monotonic()
                if last is None:
                    self.metrics.ttft.labels(model).observe(now - start)
                else:
                    self.metrics.itl.labels(model).observe(now - last)
                last = now
                if out.finished:
                    finished = True
                    self.metrics.e2e.labels(model).observe(now - start)
                    self.metrics.success.labels(model, out.finish_reason).inc()
                await sink.put((choice, out))
        except Exception as exc:  # noqa: BLE001 - surfaced to the client
            await sink.put((choice, exc))
        finally:
            if not finished:
                self.metrics.success.labels(model, "abort").inc()
            await sink.put((choice, None))

    async def run(self, choices: list[Choice]) -> AsyncIterator[tuple[Choice, RequestOutput]]:
        """Outputs of all choices as they come; closing this iterator aborts what is left."""
        sink: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.create_task(self._pump(c, sink)) for c in choices]
        try:
            done = 0
            while done < len(tasks):
                choice, item = await sink.get()
                if item is None:
                    done += 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield choice, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def collect(self, choices: list[Choice]) -> list[ChoiceResult]:
        """Every choice run to its end, in index order."""
        results = {c.index: ChoiceResult(c) for c in choices}
        async for c, out in self.run(choices):
            results[c.index].add(out)
        return [results[i] for i in sorted(results)]


class Call(ABC):
    """One completions or chat request, built (and checked) up front and then either streamed as
    SSE chunks or run into a single response. Subclasses say how a choice looks."""

    object_type: str
    chunk_type: str
    id_prefix: str
    _echoes = False  # the first chunk of each choice carries the echoed prompt

    def __init__(
        self,
        server: Server,
        req: CompletionRequest | ChatCompletionRequest,
        model: str,
        choices: list[Choice],
        n_prompt: int,
    ):
        self.server, self.req, self.choices, self.n_prompt = server, req, choices, n_prompt
        usage_on = bool(req.stream and req.stream_options and req.stream_options.include_usage)
        self.envelope = Envelope(f"{self.id_prefix}-{uuid.uuid4().hex}", model, usage_on)
        if server.cfg.log_requests:
            p = choices[0].request.params
            line = (
                f"engramrt: request {self.envelope.id}: {len(choices)} choice(s), {n_prompt} "
                f"prompt tokens, max_tokens {p.max_tokens}, temperature {p.temperature}, "
                f"stream {req.stream}"
            )
            print(line, file=sys.stderr, flush=True)

    def _opening(self) -> Iterator[dict]:
        """Chunk choices sent before any output."""
        return iter(())

    @abstractmethod
    def _chunk_choice(self, c: Choice, out: RequestOutput, state: StreamState) -> dict:
        """One output of ``c`` as a stream chunk's choice; ``state`` carries what that depends
        on from the choice's earlier chunks."""

    @abstractmethod
    def _result_choice(self, result: ChoiceResult) -> dict:
        """A finished choice as it appears in the single response."""

    async def stream(self) -> AsyncIterator[str]:
        states = {c.index: StreamState() for c in self.choices}
        for choice in self._opening():
            yield sse(self.envelope.wrap(self.chunk_type, [choice]))
        async for c, out in self.server.run(self.choices):
            state = states[c.index]
            out = state.take(out, opens=state.offsets is None and self._echoes)
            if out is None:
                continue
            choice = self._chunk_choice(c, out, state)
            state.output_tokens = out.num_output_tokens
            yield sse(self.envelope.wrap(self.chunk_type, [choice]))
        if self.envelope.usage_on:
            n_out = sum(s.output_tokens for s in states.values())
            yield sse(self.envelope.wrap(self.chunk_type, [], usage(self.n_prompt, n_out)))

    async def build(self) -> dict:
        results = await self.server.collect(self.choices)
        body = [self._result_choice(r) for r in results]
        n_out = sum(len(r.token_ids) for r in results)
        return self.envelope.wrap(self.object_type, body, usage(self.n_prompt, n_out))


class CompletionCall(Call):
    object_type = chunk_type = "text_completion"
    id_prefix = "cmpl"
    req: CompletionRequest

    def __init__(self, server: Server, req: CompletionRequest):
        self._echoes = req.echo
        model = server.check_model(req.model)
        prompts = server.completion_prompts(req.prompt)
        echo_k = req.logprobs if (req.echo and req.logprobs is not None) else None
        max_tokens = 16 if req.max_tokens is None else req.max_tokens
        choices = server.choices(prompts, req, max_tokens, req.logprobs, echo_k, req.echo)
        super().__init__(server, req, model, choices, sum(len(ids) for ids, _ in prompts))

    def _prompt_part(self, c: Choice, out: RequestOutput | None) -> tuple[str, dict | None]:
        """The echoed prompt (its text as sent, else decoded) and, when asked, its logprobs."""
        text = ""
        if self.req.echo:
            text = c.prompt_text
            if text is None:
                text = self.server.tok.decode(c.prompt_ids, skip_special_tokens=False)
        lps = None
        if self.req.echo and self.req.logprobs is not None and out is not None:
            offsets = TextOffsets(self.server.tok, specials=True, text=text)(c.prompt_ids)
            lps = completion_logprobs(
                self.server.tok,
                c.prompt_ids,
                out.prompt_logprobs,
                offsets,
                self.req.return_tokens_as_token_ids,
            )
        return text, lps

    def _choice(
        self,
        c: Choice,
        prompt: tuple[str, dict | None],
        text: str,
        ids: list[int],
        lps: list[Logprob],
        finish_reason: str | None,
        offsets: TextOffsets,
    ) -> dict:
        """``prompt``: what ``_prompt_part`` gives when the echo goes in this choice, else
        ``("", None)``; ``offsets``: the choice's generated tokens' (they follow the echo)."""
        prefix, prompt_lps = prompt
        logprobs = None
        if self.req.logprobs is not None:
            logprobs = completion_logprobs(
                self.server.tok, ids, lps, offsets(ids), self.req.return_tokens_as_token_ids
            )
            if prompt_lps is not None:
                logprobs = join_completion_logprobs(prompt_lps, logprobs)
        return completion_choice(c.index, prefix + text, logprobs, finish_reason)

    def _chunk_choice(self, c: Choice, out: RequestOutput, state: StreamState) -> dict:
        prompt = ("", None)  # the echoed prompt goes with the choice's first chunk only
        if state.offsets is None:
            prompt = self._prompt_part(c, out)
            state.offsets = TextOffsets(self.server.tok, len(prompt[0]))
        return self._choice(
            c,
            prompt,
            out.new_text,
            out.new_token_ids,
            out.new_logprobs,
            out.finish_reason,
            state.offsets,
        )

    def _result_choice(self, r: ChoiceResult) -> dict:
        prompt = self._prompt_part(r.choice, r.prompt_out)
        offsets = TextOffsets(self.server.tok, len(prompt[0]))
        return self._choice(
            r.choice, prompt, r.text, r.token_ids, r.logprobs, r.finish_reason, offsets
        )


class ChatCall(Call):
    object_type = "chat.completion"
    chunk_type = "chat.completion.chunk"
    id_prefix = "chatcmpl"
    req: ChatCompletionRequest

    def __init__(self, server: Server, req: ChatCompletionRequest):
        model = server.check_model(req.model)
        prompt = server.chat_prompt(req.messages)
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        max_tokens = req.max_completion_tokens or req.max_tokens
        choices = server.choices([(prompt, None)], req, max_tokens, logprobs, None)
        super().__init__(server, req, model, choices, len(prompt))

    def _logprobs(self, ids: list[int], lps: list[Logprob]) -> dict | None:
        if not self.req.logprobs:
            return None
        return chat_logprobs(self.server.tok, ids, lps, self.req.return_tokens_as_token_ids)

    def _opening(self) -> Iterator[dict]:
        """Each choice's role, before its first token."""
        for c in self.choices:
            yield chat_chunk_choice(c.index, {"role": "assistant", "content": ""}, None, None)

    def _chunk_choice(self, c: Choice, out: RequestOutput, state: StreamState) -> dict:
        lps = self._logprobs(out.new_token_ids, out.new_logprobs)
        # the last chunk may carry no text; it still names the finish reason
        delta = {"content": out.new_text} if out.new_text or not out.finished else {}
        return chat_chunk_choice(c.index, delta, lps, out.finish_reason)

    def _result_choice(self, r: ChoiceResult) -> dict:
        lps = self._logprobs(r.token_ids, r.logprobs)
        return chat_choice(r.choice.index, r.text, lps, r.finish_reason)
