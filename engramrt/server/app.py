"""The OpenAI-compatible FastAPI app: /v1/models, /v1/completions, /v1/chat/completions (plain
and SSE), /health, /metrics, /version. Errors use OpenAI's body shape; a client that goes away
aborts its requests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2.sandbox import ImmutableSandboxedEnvironment
from prometheus_client import CONTENT_TYPE_LATEST
from tokenizers import Tokenizer

import engramrt
from engramrt.engine.async_engine import AsyncEngine, EngineDead
from engramrt.engine.engine import RequestOutput
from engramrt.engine.request import Logprob, SamplingParams
from engramrt.server.metrics import Metrics
from engramrt.server.protocol import ChatCompletionRequest, CompletionRequest


@dataclass
class ServerConfig:
    model_names: list[str]
    max_model_len: int
    api_key: str | None = None
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    bos_token_id: int | None = None


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param=None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_body(status: int, message: str, kind: str, param=None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


@dataclass
class _Choice:
    index: int
    prompt_ids: list[int]
    params: SamplingParams
    prompt_text: str | None = None  # as the client sent it, for echo


class Server:
    def __init__(self, engine: AsyncEngine, tokenizer: Tokenizer, cfg: ServerConfig):
        self.engine, self.tok, self.cfg = engine, tokenizer, cfg
        self.metrics = Metrics(engine.engine, cfg.model_names[0])
        self.created = int(time.time())
        self.template = None
        if cfg.chat_template:
            self.template = ImmutableSandboxedEnvironment().from_string(cfg.chat_template)

    # --- building requests ----------------------------------------------------------------

    def check_model(self, model: str | None) -> str:
        if model is not None and model not in self.cfg.model_names:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return model or self.cfg.model_names[0]

    def encode(self, text: str) -> list[int]:
        bos = [self.cfg.bos_token_id] if self.cfg.bos_token_id is not None else []
        return bos + self.tok.encode(text).ids

    def completion_prompts(self, prompt) -> list[tuple[list[int], str | None]]:
        """(token ids, the text as sent when it was text)."""
        if isinstance(prompt, str):
            return [(self.encode(prompt), prompt)]
        if not prompt:
            raise ApiError(400, "prompt must not be empty", param="prompt")
        if all(isinstance(p, int) for p in prompt):
            return [(list(prompt), None)]
        return [(self.encode(p), p) if isinstance(p, str) else (list(p), None) for p in prompt]

    def chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        if self.template is None:
            raise ApiError(400, "this model has no chat template", param="messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        text = self.template.render(
            messages=messages,
            add_generation_prompt=True,
            bos_token=self.cfg.bos_token,
            eos_token=self.cfg.eos_token,
        )
        return self.tok.encode(text).ids

    def choices(self, prompts, req, max_tokens, logprobs, echo_k) -> list[_Choice]:
        """``prompts``: (ids, text or None) pairs; ``req.n`` choices for each."""
        out = []
        for i, (prompt, text) in enumerate(prompts):
            limit = self.cfg.max_model_len
            mt = max_tokens if max_tokens is not None else limit - len(prompt)
            if len(prompt) + mt > limit or mt < 1:
                raise ApiError(
                    400,
                    f"This model's maximum context length is {limit} tokens. However, you "
                    f"requested {len(prompt) + mt} tokens ({len(prompt)} in the messages, {mt} "
                    "in the completion). Please reduce the length of the messages or completion.",
                    param="max_tokens",
                )
            for j in range(req.n):
                params = SamplingParams(
                    max_tokens=mt,
                    temperature=req.temperature,
                    top_p=req.top_p,
                    top_k=max(req.top_k, 0),
                    min_p=req.min_p,
                    seed=None if req.seed is None else req.seed + j,
                    stop=req.stops(),
                    stop_token_ids=list(req.stop_token_ids),
                    ignore_eos=req.ignore_eos,
                    logprobs=logprobs,
                    prompt_logprobs=echo_k,
                )
                try:
                    self.engine.engine.validate(prompt, params)
                except ValueError as exc:
                    raise ApiError(400, str(exc)) from None
                out.append(_Choice(i * req.n + j, prompt, params, text))
        return out

    # --- running them ---------------------------------------------------------------------

    async def _pump(self, choice: _Choice, sink: asyncio.Queue) -> None:
        """One request's outputs into the shared queue, with its latency metrics."""
        start, last, model = time.monotonic(), None, self.metrics.model
        try:
            async for out in self.engine.generate(choice.prompt_ids, choice.params):
                now = time.monotonic()
                if last is None:
                    self.metrics.ttft.labels(model).observe(now - start)
                else:
                    self.metrics.itl.labels(model).observe(now - last)
                last = now
                if out.finished:
                    self.metrics.e2e.labels(model).observe(now - start)
                    self.metrics.success.labels(model, out.finish_reason).inc()
                await sink.put((choice, out))
        except Exception as exc:  # noqa: BLE001 - surfaced to the client
            await sink.put((choice, exc))
        finally:
            await sink.put((choice, None))

    async def run(self, choices: list[_Choice]) -> AsyncIterator[tuple[_Choice, RequestOutput]]:
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

    # --- logprobs in OpenAI's two formats -------------------------------------------------

    def _tok(self, token_id: int) -> str:
        return self.tok.decode([token_id], skip_special_tokens=False)

    def completion_logprobs(self, ids: list[int], lps: list[Logprob | None], offset: int) -> dict:
        tokens = [self._tok(t) for t in ids]
        offsets, pos = [], offset
        for t in tokens:
            offsets.append(pos)
            pos += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
            "top_logprobs": [
                None
                if lp is None
                else {self._tok(i): v for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)}
                for lp in lps
            ],
            "text_offset": offsets,
        }

    def chat_logprobs(self, ids: list[int], lps: list[Logprob]) -> dict:
        def entry(t: int, lp: float) -> dict:
            s = self._tok(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode())}

        return {
            "content": [
                {
                    **entry(t, lp.logprob),
                    "top_logprobs": [
                        entry(i, v) for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True)
                    ],
                }
                for t, lp in zip(ids, lps, strict=True)
            ]
        }


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(req, rid: str, model: str):
    """The response/chunk wrapper of one request: ids and timestamps fixed, ``usage`` present
    when given, and ``null`` in every stream chunk when the client asked for usage."""
    created = int(time.time())
    usage_on = bool(req.stream and req.stream_options and req.stream_options.include_usage)

    def wrap(obj_type: str, choices: list, usage: dict | None = None) -> dict:
        obj = {"id": rid, "object": obj_type, "created": created, "model": model}
        obj["choices"] = choices
        if usage_on or usage is not None:
            obj["usage"] = usage
        return obj

    return wrap


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def create_app(server: Server, ready_message: str | None = None) -> FastAPI:
    """``ready_message`` is printed once the app accepts requests."""

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        if ready_message:
            print(ready_message, file=sys.stderr, flush=True)
        yield

    app = FastAPI(title="engramrt", version=engramrt.__version__, lifespan=lifespan)
    cfg = server.cfg

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return JSONResponse(error_body(exc.status, exc.message, exc.kind, exc.param), exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            msg = f"Invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
            return JSONResponse(error_body(400, msg, "BadRequestError"), 400)
        parts = [str(x) for x in first.get("loc", []) if x != "body"]
        loc = ".".join(parts) or None
        msg = first.get("msg", "invalid request")
        return JSONResponse(
            error_body(400, f"{loc}: {msg}" if loc else msg, "BadRequestError", loc), 400
        )

    async def _require_key(request: Request) -> None:
        # a dependency, not an HTTP middleware: those hide client disconnects from handlers
        if cfg.api_key and request.headers.get("authorization") != f"Bearer {cfg.api_key}":
            raise ApiError(401, "invalid or missing API key", "AuthenticationError")

    auth = [Depends(_require_key)]

    @app.get("/health")
    async def health():
        return Response(status_code=503 if server.engine.error else 200)

    @app.get("/version")
    async def version():
        return {"version": engramrt.__version__}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models", dependencies=auth)
    async def models():
        data = [
            {
                "id": name,
                "object": "model",
                "created": server.created,
                "owned_by": "engramrt",
                "root": name,
                "max_model_len": cfg.max_model_len,
            }
            for name in cfg.model_names
        ]
        return {"object": "list", "data": data}

    async def _respond(raw: Request, gen, build, stream: bool):
        """Run ``gen`` to completion (watching for a disconnect) or stream it."""
        if stream:

            async def body():
                try:
                    async for chunk in gen:
                        yield chunk
                except (EngineDead, ValueError) as exc:
                    yield _sse(error_body(500, str(exc), "InternalServerError"))
                yield "data: [DONE]\n\n"

            return StreamingResponse(body(), media_type="text/event-stream")
        task = asyncio.ensure_future(build())
        while not task.done():
            await asyncio.wait([task], timeout=0.25)
            if not task.done() and await raw.is_disconnected():
                task.cancel()
                return Response(status_code=499)
        try:
            return task.result()
        except EngineDead as exc:
            raise ApiError(503, str(exc), "ServiceUnavailableError") from None

    @app.post("/v1/completions", dependencies=auth)
    async def completions(req: CompletionRequest, raw: Request):
        model = server.check_model(req.model)
        prompts = server.completion_prompts(req.prompt)
        n_prompt = sum(len(ids) for ids, _ in prompts)
        echo_k = req.logprobs if (req.echo and req.logprobs is not None) else None
        choices = server.choices(prompts, req, req.max_tokens or 16, req.logprobs, echo_k)
        usage_on = bool(req.stream_options and req.stream_options.include_usage)
        envelope = _envelope(req, f"cmpl-{uuid.uuid4().hex}", model)

        def chunk(choices_, usage=None):
            return envelope("text_completion", choices_, usage)

        def prompt_part(c: _Choice, out: RequestOutput | None):
            text = ""
            if req.echo:
                text = c.prompt_text
                if text is None:
                    text = server.tok.decode(c.prompt_ids, skip_special_tokens=False)
            lps = None
            if req.echo and req.logprobs is not None and out is not None:
                lps = server.completion_logprobs(c.prompt_ids, out.prompt_logprobs, 0)
            return text, lps

        async def stream():
            sent, n_out = {}, {}  # characters already streamed per choice (text_offset base)
            async for c, out in server.run(choices):
                text, lps = "", None
                if c.index not in sent:
                    text, lps = prompt_part(c, out)
                base = sent.get(c.index, 0) + len(text)
                sent[c.index] = base + len(out.new_text)
                gen_lps = None
                if req.logprobs is not None:
                    gen_lps = server.completion_logprobs(out.new_token_ids, out.new_logprobs, base)
                    if lps is not None:
                        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                            lps[key] += gen_lps[key]
                        gen_lps = lps
                n_out[c.index] = out.num_output_tokens
                yield _sse(
                    chunk(
                        [
                            {
                                "index": c.index,
                                "text": text + out.new_text,
                                "logprobs": gen_lps,
                                "finish_reason": out.finish_reason,
                            }
                        ]
                    )
                )
            if usage_on:
                yield _sse({**chunk([]), "usage": _usage(n_prompt, sum(n_out.values()))})

        async def build():
            acc = {c.index: [c, "", [], [], None, None] for c in choices}
            async for c, out in server.run(choices):
                a = acc[c.index]
                a[1] += out.new_text
                a[2] += out.new_token_ids
                a[3] += out.new_logprobs
                a[4] = out.finish_reason
                if out.prompt_logprobs is not None:
                    a[5] = out
            result, completion = [], 0
            for index, (c, text, ids, lps, reason, first) in sorted(acc.items()):
                prefix, plps = prompt_part(c, first)
                logprobs = None
                if req.logprobs is not None:
                    logprobs = server.completion_logprobs(ids, lps, len(prefix))
                    if plps is not None:
                        logprobs = {k: plps[k] + logprobs[k] for k in logprobs}
                result.append(
                    {
                        "index": index,
                        "text": prefix + text,
                        "logprobs": logprobs,
                        "finish_reason": reason,
                    }
                )
                completion += len(ids)
            return chunk(result, _usage(n_prompt, completion))

        return await _respond(raw, stream(), build, req.stream)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat(req: ChatCompletionRequest, raw: Request):
        model = server.check_model(req.model)
        prompt = server.chat_prompt(req)
        top = req.top_logprobs or 0
        logprobs = top if req.logprobs else None
        choices = server.choices(
            [(prompt, None)], req, req.max_completion_tokens or req.max_tokens, logprobs, None
        )
        usage_on = bool(req.stream_options and req.stream_options.include_usage)
        chunk = _envelope(req, f"chatcmpl-{uuid.uuid4().hex}", model)

        async def stream():
            started, n_out = set(), {}
            for c in choices:
                started.add(c.index)
                yield _sse(
                    chunk(
                        "chat.completion.chunk",
                        [
                            {
                                "index": c.index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                    )
                )
            async for c, out in server.run(choices):
                lps = None
                if req.logprobs:
                    lps = server.chat_logprobs(out.new_token_ids, out.new_logprobs)
                n_out[c.index] = out.num_output_tokens
                delta = {"content": out.new_text} if out.new_text or not out.finished else {}
                yield _sse(
                    chunk(
                        "chat.completion.chunk",
                        [
                            {
                                "index": c.index,
                                "delta": delta,
                                "logprobs": lps,
                                "finish_reason": out.finish_reason,
                            }
                        ],
                    )
                )
            if usage_on:
                yield _sse(
                    {
                        **chunk("chat.completion.chunk", []),
                        "usage": _usage(len(prompt), sum(n_out.values())),
                    }
                )

        async def build():
            acc = {c.index: ["", [], [], None] for c in choices}
            async for c, out in server.run(choices):
                a = acc[c.index]
                a[0] += out.new_text
                a[1] += out.new_token_ids
                a[2] += out.new_logprobs
                a[3] = out.finish_reason
            result = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": text},
                    "logprobs": server.chat_logprobs(ids, lps) if req.logprobs else None,
                    "finish_reason": reason,
                }
                for i, (text, ids, lps, reason) in sorted(acc.items())
            ]
            completion = sum(len(a[1]) for a in acc.values())
            return chunk("chat.completion", result, _usage(len(prompt), completion))

        return await _respond(raw, stream(), build, req.stream)

    return app
