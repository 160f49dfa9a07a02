"""The OpenAI-compatible FastAPI app: /v1/models[/{id}], /v1/completions, /v1/chat/completions
(plain and SSE), vLLM's /tokenize, /detokenize and /tokenizer_info, /health, /metrics, /version.
Errors use OpenAI's body shape; a client that goes away aborts its requests. Only routing lives
here: requests are built and run in ``serving`` (``tokenization`` for the tokenizer endpoints)
and shaped in ``responses``."""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import AsyncIterator

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

import engramrt
from engramrt.engine.client import EngineClosed, EngineDead, ModelFailed
from engramrt.server import schema, tokenization
from engramrt.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from engramrt.server.responses import (
    SSE_DONE,
    ApiError,
    error_body,
    model_card,
    sse,
    validation_error_body,
)
from engramrt.server.serving import Call, ChatCall, CompletionCall, Server, ServerConfig

__all__ = ["Server", "ServerConfig", "create_app"]

public = APIRouter()
api = APIRouter()  # behind the API key, when there is one


def _server(request: Request) -> Server:
    return request.app.state.server


@public.get("/health", response_class=Response, responses=schema.HEALTH)
async def health(request: Request) -> Response:
    """503 once the engine has died or the server is shutting down: route traffic elsewhere."""
    engine = _server(request).engine
    return Response(status_code=503 if engine.error or engine.closed else 200)


@public.get("/version", response_model=None, responses=schema.plain(schema.Version))
async def version() -> dict:
    return {"version": engramrt.__version__}


@public.get("/metrics", response_class=Response, responses=schema.METRICS)
async def metrics(request: Request) -> Response:
    return Response(_server(request).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@api.get("/v1/models", response_model=None, responses=schema.plain(schema.ModelList, 401))
async def models(request: Request) -> dict:
    server = _server(request)
    data = [model_card(n, server.created, server.cfg.max_model_len) for n in server.cfg.model_names]
    return {"object": "list", "data": data}


@api.get(
    "/v1/models/{model_id:path}",
    response_model=None,
    responses=schema.plain(schema.ModelCard, 401, 404),
)
async def model(model_id: str, request: Request) -> dict:
    """One model's card (``client.models.retrieve``); names may hold slashes (paths)."""
    server = _server(request)
    return model_card(server.check_model(model_id), server.created, server.cfg.max_model_len)


# Calls are built on a worker thread: tokenising a long prompt (which releases the GIL) must not
# stall every stream and /health on the event loop.
@api.post("/v1/completions", response_model=None, responses=schema.generation(schema.Completion))
async def completions(req: CompletionRequest, request: Request) -> dict | Response:
    call = await asyncio.to_thread(CompletionCall, _server(request), req)
    return await _respond(request, call, req.stream)


@api.post(
    "/v1/chat/completions", response_model=None, responses=schema.generation(schema.ChatCompletion)
)
async def chat(req: ChatCompletionRequest, request: Request) -> dict | Response:
    call = await asyncio.to_thread(ChatCall, _server(request), req)
    return await _respond(request, call, req.stream)


# vLLM's paths (no /v1), behind the API key like /v1/*; off the event loop like a prompt
@api.post(
    "/tokenize", response_model=None, responses=schema.plain(schema.Tokenized, *schema.API_ERRORS)
)
async def tokenize(req: TokenizeRequest, request: Request) -> dict:
    return await asyncio.to_thread(tokenization.tokenize, _server(request), req)


@api.post(
    "/detokenize",
    response_model=None,
    responses=schema.plain(schema.Detokenized, *schema.API_ERRORS),
)
async def detokenize(req: DetokenizeRequest, request: Request) -> dict:
    return await asyncio.to_thread(tokenization.detokenize, _server(request), req)


@api.get("/tokenizer_info", response_model=None, responses=schema.plain(schema.TokenizerInfo, 401))
async def tokenizer_info(request: Request) -> dict:
    return tokenization.tokenizer_info(_server(request).prompts)


FAILURES = (EngineDead, EngineClosed, ModelFailed, ValueError)  # a request's, while it runs


async def _respond(request: Request, call: Call, stream: bool) -> dict | Response:
    """Stream ``call``, or run it to completion while watching for a disconnect."""
    engine = call.server.engine
    if engine.error is not None or engine.closed:
        reason = "the server is shutting down" if engine.error is None else "the engine has died"
        raise ApiError(503, reason, "ServiceUnavailableError")
    if stream:
        return StreamingResponse(_sse_body(call.stream()), media_type="text/event-stream")
    task = asyncio.ensure_future(call.build())
    while not task.done():
        await asyncio.wait([task], timeout=0.25)
        if not task.done() and await request.is_disconnected():
            task.cancel()
            return Response(status_code=499)
    try:
        return task.result()
    except FAILURES as exc:
        raise _failure(exc) from None


def _failure(exc: Exception) -> ApiError:
    """What a request that fails while it runs answers, streamed or not: 503 once the engine is
    gone or going, 500 when the model failed on it (its logits were not finite), 400 for what
    the request itself caused (a grammar the engine could not follow, a request the engine
    refused)."""
    if isinstance(exc, (EngineDead, EngineClosed)):
        return ApiError(503, str(exc), "ServiceUnavailableError")
    if isinstance(exc, ModelFailed):
        return ApiError(500, str(exc), "InternalServerError")
    return ApiError(400, str(exc))


async def _sse_body(chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Once streaming has begun the status is sent, so a failure becomes an error event."""
    try:
        async for chunk in chunks:
            yield chunk
    except FAILURES as exc:
        e = _failure(exc)
        yield sse(error_body(e.status, e.message, e.kind, e.param))
    yield SSE_DONE


async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
    return JSONResponse(error_body(exc.status, exc.message, exc.kind, exc.param), exc.status)


async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
    return JSONResponse(validation_error_body(exc.errors()), 400)


_KINDS = {
    400: "BadRequestError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
}


def _authorized(request: Request) -> bool:
    """The API key, when there is one, compared in constant time (the time taken does not tell
    how much of a guess matched)."""
    expected = request.app.state.expected_key
    if expected is None:
        return True
    given = request.headers.get("authorization", "").encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, expected)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    """Unknown routes, wrong methods and bodies that are not even text, in OpenAI's shape; an
    unknown route (``/v1/embeddings``, ``/v1/responses``, ...) says what the server serves.
    With an API key, anything under ``/v1/`` asks for the key first (as vLLM's check does):
    a caller without it learns nothing about which paths exist."""
    if request.url.path.startswith("/v1/") and not _authorized(request):
        return await _api_error(
            request, ApiError(401, "invalid or missing API key", "AuthenticationError")
        )
    kind = _KINDS.get(
        exc.status_code, "InternalServerError" if exc.status_code >= 500 else "BadRequestError"
    )
    message = str(exc.detail)
    if exc.status_code == 404 and message == "Not Found":
        message = (
            f"{request.method} {request.url.path} is not supported by this server; it "
            f"serves {', '.join(_SERVED)}"
        )
    body = error_body(exc.status_code, message, kind)
    return JSONResponse(body, exc.status_code, headers=getattr(exc, "headers", None))


_SERVED = (
    "/v1/completions",
    "/v1/chat/completions",
    "/v1/models",
    "/tokenize",
    "/detokenize",
    "/tokenizer_info",
    "/health",
    "/metrics",
    "/version",
)


class BodyLimit:
    """A pure ASGI middleware (an HTTP middleware would hide client disconnects): a body over
    ``limit`` bytes is a 413 in OpenAI's shape, by its Content-Length before any of it is read,
    or once a chunked body passes the limit."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope["headers"]).get(b"content-length", b"0")
        if length.isdigit() and int(length) > self.limit:
            return await self._too_large(send)
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise StarletteHTTPException(413, self._message())
            return message

        await self.app(scope, counted, send)

    def _message(self) -> str:
        return f"the request body is over --max-request-bytes ({self.limit} bytes)"

    async def _too_large(self, send) -> None:
        body = JSONResponse(error_body(413, self._message(), "RequestTooLargeError"), 413)
        await body({"type": "http"}, None, send)


def create_app(server: Server) -> FastAPI:
    app = FastAPI(title="engramrt", version=engramrt.__version__)
    app.add_middleware(BodyLimit, limit=server.cfg.max_request_bytes)
    app.state.server = server
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    cfg = server.cfg

    app.state.expected_key = f"Bearer {cfg.api_key}".encode() if cfg.api_key else None

    async def require_key(request: Request) -> None:
        # a dependency, not an HTTP middleware: those hide client disconnects from handlers
        if not _authorized(request):
            raise ApiError(401, "invalid or missing API key", "AuthenticationError")

    app.include_router(public)
    app.include_router(api, dependencies=[Depends(require_key)])
    schema.install(app)
    return app
