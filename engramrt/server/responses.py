"""What the server sends back, in OpenAI's shapes: error bodies, usage, the response/chunk
envelope, SSE framing and the two logprob formats. Kept apart from running requests so the wire
format can be read (and changed) in one place."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenizers import Tokenizer

from engramrt.engine.detokenize import IncrementalDecoder
from engramrt.engine.request import Logprob

SSE_DONE = "data: [DONE]\n\n"


class ApiError(Exception):
    """An error the client caused (or is told about) with its HTTP status and OpenAI type."""

    def __init__(
        self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def error_body(status: int, message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def validation_error_body(errors: Sequence[dict]) -> dict:
    """A body that fails validation, as a 400 naming the first problem by its field path (less
    FastAPI's leading ``body``), or the JSON parser's complaint."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":
        msg = f"Invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
        return error_body(400, msg, "BadRequestError")
    parts = [str(x) for x in first.get("loc", []) if x != "body"]
    loc = ".".join(parts) or None
    msg = first.get("msg", "invalid request")
    error = first.get("ctx", {}).get("error")
    if first.get("type") == "value_error" and isinstance(error, ValueError):
        # a validator's own message, without pydantic's "Value error, "; its field as param
        return error_body(400, str(error), "BadRequestError", getattr(error, "param", loc))
    return error_body(400, f"{loc}: {msg}" if loc else msg, "BadRequestError", loc)


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


@dataclass
class Envelope:
    """The response/chunk wrapper of one request: every chunk of a stream carries the same id
    and timestamp, and ``usage`` (``null`` until the last chunk) when the client asked for it."""

    id: str
    model: str
    usage_on: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def wrap(self, obj_type: str, choices: list[dict], usage: dict | None = None) -> dict:
        obj = {"id": self.id, "object": obj_type, "created": self.created, "model": self.model}
        obj["choices"] = choices
        if self.usage_on or usage is not None:
            obj["usage"] = usage
        return obj


def completion_choice(
    index: int, text: str, logprobs: dict | None, finish_reason: str | None
) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}


def chat_choice(index: int, content: str, logprobs: dict | None, finish_reason: str | None) -> dict:
    return {
        "index": index,
        "message": {"role": "assistant", "content": content},
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def chat_chunk_choice(
    index: int, delta: dict, logprobs: dict | None, finish_reason: str | None
) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}


def model_card(name: str, created: int, max_model_len: int) -> dict:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "engramrt",
        "root": name,
        "max_model_len": max_model_len,
    }


# --- logprobs in OpenAI's two formats ---------------------------------------------------------


def token_text(tok: Tokenizer, token_id: int) -> str:
    """One token on its own, special tokens included, so a logprob always names its token."""
    return tok.decode([token_id], skip_special_tokens=False)


def token_name(tok: Tokenizer, token_id: int, as_ids: bool) -> str:
    """How a logprob names its token: its text, or vLLM's ``token_id:N`` when the client sent
    ``return_tokens_as_token_ids`` (two tokens with one text would share a top-logprobs key)."""
    return f"token_id:{token_id}" if as_ids else token_text(tok, token_id)


class TextOffsets:
    """``text_offset`` of a choice's tokens, fed a chunk of ids at a time (so a stream and the
    single response get the same numbers): where the text each token adds begins. A token adds
    what decoding it adds to the tokens before it, decoded as the text was made (an echoed
    prompt keeps special tokens, generated text leaves them out): a token that ends inside a
    character adds nothing and the one that completes it the whole character. ``text``: the
    text when it was not decoded from these ids (a prompt as the client sent it), where a token
    whose addition is not found (the BOS of ``add_bos_token``) adds nothing. So every offset
    indexes the text, whatever its characters."""

    def __init__(
        self, tok: Tokenizer, start: int = 0, *, specials: bool = False, text: str | None = None
    ):
        self.decoder = IncrementalDecoder(tok, skip_special=not specials)
        self.ids: list[int] = []
        self.start, self.pos, self.text = start, start, text

    def __call__(self, ids: list[int]) -> list[int]:
        offsets = []
        for t in ids:
            offsets.append(self.pos)
            self.ids.append(t)
            part = self.decoder.advance(self.ids) or ""
            if self.text is None or self.text.startswith(part, self.pos - self.start):
                self.pos += len(part)
        return offsets


def completion_logprobs(
    tok: Tokenizer,
    ids: list[int],
    lps: list[Logprob | None],
    offsets: list[int],
    as_ids: bool = False,
) -> dict:
    """The legacy format; ``offsets`` from the choice's ``TextOffsets``. Each top-logprobs entry
    names the token itself first and then the k most likely, so up to k + 1 of them and with
    ``logprobs: 0`` the token alone (vLLM's answer, and OpenAI's "up to logprobs + 1")."""

    def top(t: int, lp: Logprob) -> dict[str, float]:
        entry = {token_name(tok, t, as_ids): lp.logprob}
        for i, v in zip(lp.top_ids, lp.top_logprobs, strict=True):
            entry.setdefault(token_name(tok, i, as_ids), v)  # the token's own value stays
        return entry

    return {
        "tokens": [token_name(tok, t, as_ids) for t in ids],
        "token_logprobs": [None if lp is None else lp.logprob for lp in lps],
        "top_logprobs": [
            None if lp is None else top(t, lp) for t, lp in zip(ids, lps, strict=True)
        ],
        "text_offset": offsets,
    }


def join_completion_logprobs(first: dict, then: dict) -> dict:
    """The echoed prompt's logprobs followed by the generated tokens' ones."""
    return {k: first[k] + then[k] for k in then}


def chat_logprobs(tok: Tokenizer, ids: list[int], lps: list[Logprob], as_ids: bool = False) -> dict:
    def entry(t: int, lp: float) -> dict:
        s = token_text(tok, t)
        return {"token": token_name(tok, t, as_ids), "logprob": lp, "bytes": list(s.encode())}

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
