"""What ``/openapi.json`` says each route answers, so that it matches what the server does (a
client generator or a schema-driven fuzzer sees the real contract): response bodies as pydantic
models (documentation only: ``responses`` builds them as dicts), the OpenAI error body for every
error status a route can give, streams as ``text/event-stream``, ``/health`` with no body and
``/metrics`` as Prometheus text; FastAPI's 422 (this server answers 400) is taken out.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict


class _Doc(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Doc):
    message: str
    type: str
    param: str | None
    code: int


class ErrorBody(_Doc):
    error: ErrorDetail


class Usage(_Doc):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class _Choice(_Doc):
    index: int
    logprobs: dict[str, Any] | None
    finish_reason: Literal["stop", "length", "abort"] | None


class CompletionChoice(_Choice):
    text: str


class _Response(_Doc):
    id: str
    created: int
    model: str
    usage: Usage | None = None


class Completion(_Response):
    object: Literal["text_completion"]
    choices: list[CompletionChoice]


class ChatMessageOut(_Doc):
    role: Literal["assistant"]
    content: str


class ChatChoice(_Choice):
    message: ChatMessageOut


class ChatCompletion(_Response):
    object: Literal["chat.completion"]
    choices: list[ChatChoice]


class ModelCard(_Doc):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(_Doc):
    object: Literal["list"]
    data: list[ModelCard]


class Tokenized(_Doc):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None


class Detokenized(_Doc):
    prompt: str


class Version(_Doc):
    version: str


class TokenizerInfo(_Doc):
    """``tokenizer_config.json``, added tokens as their text."""


def _errors(*statuses: int) -> dict:
    return {s: {"model": ErrorBody, "description": "OpenAI's error body"} for s in statuses}


API_ERRORS = (400, 401, 404, 413)  # a bad body, a key, an unknown model, a body too large


# one event of a stream (OpenAPI 3.1 reads an event stream's schema as each event's): its data
# is a JSON chunk, an error object, or [DONE] at the end
SSE_EVENT = {
    "type": "object",
    "required": ["data"],
    "properties": {"data": {"type": "string"}},
}


def generation(model: type[BaseModel]) -> dict:
    """A completion: JSON, or with ``stream`` an SSE stream of chunks ending in ``[DONE]``;
    500 when the model failed on it (logits holding NaN or infinity), 503 while the server shuts
    down or after its engine died."""
    ok = {
        "model": model,
        "description": "The response, or with `stream` server-sent events",
        "content": {"text/event-stream": {"schema": SSE_EVENT}},
    }
    return {200: ok, **_errors(*API_ERRORS, 500, 503)}


def plain(model: type[BaseModel], *statuses: int) -> dict:
    return {200: {"model": model}, **_errors(*statuses)}


HEALTH = {
    200: {"description": "Serving", "content": {}},
    503: {"description": "Shutting down, or the engine has died", "content": {}},
}
METRICS = {
    200: {
        "description": "Prometheus text",
        "content": {"text/plain": {"schema": {"type": "string"}}},
    }
}


def install(app: FastAPI) -> None:
    """``app.openapi`` builds the schema once, without FastAPI's phantom 422s."""

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            for path in schema.get("paths", {}).values():
                for op in path.values():
                    op.get("responses", {}).pop("422", None)
            components = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                components.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi
