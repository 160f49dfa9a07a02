"""Request bodies of the OpenAI API, the vLLM extras clients send and vLLM's tokenizer
endpoints. Unknown fields are ignored, as vLLM does; wrong types and out-of-range values become
a 400."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    Strict,
    ValidationError,
    model_validator,
)

from engramrt.engine.grammar import GrammarSpec


class FieldError(ValueError):
    """A request field that is wrong: the message, and the field for the error's ``param``."""

    def __init__(self, param: str | None, message: str):
        super().__init__(message)
        self.param = param


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data):
        """Clients send ``"temperature": null`` and the like for "use the default"."""
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @model_validator(mode="before")
    @classmethod
    def _text_is_unicode(cls, data):
        """JSON may spell a lone surrogate (``"\\ud800"``), which is no text: the tokenizer
        would fail on it, so it is a 400 here, not a 500 later."""
        _check_text(data)
        return data


def _check_text(value, path: str = "") -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise FieldError(
                path or None, f"{path or 'a string'} holds a lone UTF-16 surrogate"
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _check_text(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            _check_text(v, f"{path}[{i}]")


def _whole(value):
    """An integer-valued float (``8.0``, which clients send) as the int it is; else unchanged."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


# Strict types, as the OpenAI API: a string or a boolean where a number is expected is a 400, not
# coerced (``"8"`` -> 8, ``true`` -> 1); an int is a number, and so is a float with no fraction.
Int = Annotated[int, Strict(), BeforeValidator(_whole)]
Float = Annotated[float, Strict()]
Bool = Annotated[bool, Strict()]


class StreamOptions(_Base):
    include_usage: Bool = False


class _Sampling(_Base):
    model: str | None = None
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: Float = Field(default=1.0, ge=0)
    top_p: Float = Field(default=1.0, gt=0, le=1)
    top_k: Int = Field(default=0, ge=-1)  # -1 or 0: off
    min_p: Float = Field(default=0.0, ge=0, le=1)
    n: Int = Field(default=1, ge=1, le=16)
    seed: Int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] = Field(default_factory=list)
    ignore_eos: Bool = False
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted and ignored, as a hint (OpenAI: for abuse monitoring)
    return_tokens_as_token_ids: Bool = False  # logprobs name tokens ``token_id:N`` (vLLM's)
    # logit controls, applied in the sampler (engramrt.runner.logit_controls)
    presence_penalty: Float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: Float = Field(default=0.0, ge=-2, le=2)
    repetition_penalty: Float = Field(default=1.0, gt=0, le=2)
    logit_bias: dict[str, Float] | None = None  # token id (as a string) -> bias, clamped to 100
    min_tokens: Int = Field(default=0, ge=0)
    allowed_token_ids: list[Int] | None = Field(default=None, min_length=1)
    bad_words: list[str] = Field(default_factory=list)
    # structured outputs: OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, min_length=1)
    guided_grammar: str | None = None  # Lark
    structured_outputs: dict[str, Any] | None = None
    # not supported: refused with a 400 rather than accepted and ignored, unless the request
    # itself says no tool is to be called (tool_choice "none"), as vLLM and OpenAI accept
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def grammar(self) -> GrammarSpec | None:
        """The one grammar the request asks for, if any (two are a 400)."""
        asked = []
        fmt = self.response_format or {}
        kind = fmt.get("type", "text")
        if kind == "json_object":
            asked.append(GrammarSpec("json", {}))
        elif kind == "json_schema":
            schema = (fmt.get("json_schema") or {}).get("schema")
            if not isinstance(schema, dict):
                raise FieldError(
                    "response_format",
                    "response_format json_schema needs json_schema.schema, an object",
                )
            asked.append(GrammarSpec("json", schema))
        elif kind != "text":
            raise FieldError(
                "response_format",
                f"response_format type {kind!r} is not one of text, json_object, json_schema",
            )
        so = self.structured_outputs or {}
        unknown = set(so) - {"json", "regex", "choice", "grammar", "json_object"}
        if unknown:
            raise FieldError(
                "structured_outputs", f"structured_outputs: unknown key {sorted(unknown)[0]!r}"
            )
        pairs = [
            ("json", self.guided_json),
            ("regex", self.guided_regex),
            ("choice", self.guided_choice),
            ("lark", self.guided_grammar),
            ("json", so.get("json")),
            ("regex", so.get("regex")),
            ("choice", so.get("choice")),
            ("lark", so.get("grammar")),
            ("json", {} if so.get("json_object") else None),
        ]
        asked += [GrammarSpec(k, v) for k, v in pairs if v is not None]
        if len(asked) > 1:
            raise ValueError("give one of response_format, guided_* and structured_outputs")
        return asked[0] if asked else None

    @model_validator(mode="after")
    def _refuse_unsupported(self) -> _Sampling:
        self.grammar()  # a malformed request is a 400 here
        if self.tools and self.tool_choice != "none":
            raise FieldError(
                "tools",
                "tools: tool calling is not supported for this model "
                '(tool_choice "none" sends them and calls none)',
            )
        if self.tool_choice not in (None, "none", "auto"):
            raise FieldError(
                "tool_choice", "tool_choice: tool calling is not supported for this model"
            )
        for key in self.logit_bias or {}:
            if not key.strip().lstrip("-").isascii() or not key.strip().lstrip("-").isdigit():
                raise FieldError("logit_bias", f"logit_bias keys are token ids, got {key!r}")
        return self

    def bias(self) -> dict[int, float]:
        return {int(k): v for k, v in (self.logit_bias or {}).items()}

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else self.stop or []


# vLLM's generation-config keys that give a request's fields their defaults (Hugging Face's
# ``max_new_tokens`` is a request's ``max_tokens``)
GENERATION_DEFAULTS = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


def generation_defaults(config: dict[str, Any]) -> dict[str, Any]:
    """A generation config as defaults by request field, checked by the request's own rules;
    a key that gives no request default is an error, not ignored (vLLM ignores it)."""
    unknown = sorted(set(config) - set(GENERATION_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown key {unknown[0]!r} (known: {', '.join(GENERATION_DEFAULTS)})")
    fields = {GENERATION_DEFAULTS[k]: v for k, v in config.items() if v is not None}
    try:
        checked = _Sampling.model_validate(fields)
    except ValidationError as exc:
        first = exc.errors()[0]
        key = {v: k for k, v in GENERATION_DEFAULTS.items()}[str(first["loc"][0])]
        raise ValueError(f"{key}: {first['msg']}") from None
    return {name: getattr(checked, name) for name in fields}


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[Int] | list[list[Int]]
    max_tokens: Int | None = Field(default=None, ge=0)  # 0: the echoed prompt alone, as vLLM
    echo: Bool = False
    logprobs: Int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    best_of: Int | None = Field(default=None, ge=1)

    @model_validator(mode="after")
    def _refuse_completion_extras(self) -> CompletionRequest:
        if self.suffix:
            raise FieldError(
                "suffix", "suffix is not supported (no model here is trained to insert)"
            )
        if self.best_of is not None and self.best_of != self.n:
            raise FieldError(
                "best_of", f"best_of ({self.best_of}) other than n ({self.n}) is not supported"
            )
        return self


class ChatMessage(_Base):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.get("text", "") for p in self.content)
        return self.content or ""

    @property
    def template_role(self) -> str:
        """The role the chat template sees: OpenAI's ``developer`` is the system's voice."""
        return "system" if self.role == "developer" else self.role


def _text_only(messages: list[ChatMessage] | None) -> None:
    """Content parts other than text (an image, audio, a file) are a 400 naming the part: this
    engine serves text only, and answering from the text around a dropped image would be a
    silent wrong answer."""
    for i, m in enumerate(messages or []):
        for j, part in enumerate(m.content if isinstance(m.content, list) else []):
            kind = part.get("type")
            if kind != "text" or not isinstance(part.get("text"), str):
                where = f"messages[{i}].content[{j}]"
                raise FieldError(
                    where,
                    f"{where}: a {kind!r} part; this model reads text only "
                    '(parts of type "text" with a "text" string)',
                )


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: Bool = False
    top_logprobs: Int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="after")
    def _chat_checks(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise FieldError("top_logprobs", "top_logprobs needs logprobs: true")
        _text_only(self.messages)
        return self


class TokenizeRequest(_Base):
    """vLLM's /tokenize body: a text ``prompt`` or chat ``messages``, never both.
    ``add_special_tokens`` defaults as vLLM's: on for a prompt (the ids a completion runs), off
    for messages (the template writes its own)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: Bool | None = None
    add_generation_prompt: Bool = True
    return_token_strs: Bool = False

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt (a string) or messages")
        _text_only(self.messages)
        return self

    def special(self) -> bool:
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        return self.prompt is not None


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[Int]
