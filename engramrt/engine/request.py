"""A request's parameters and state, from arrival to finish."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from engramrt.engine.grammar import GrammarSpec
from engramrt.runner.batch import SampleRow
from engramrt.runner.logit_controls import Controls


@dataclass
class SamplingParams:
    """The per-request knobs clients send (OpenAI and vLLM names)."""

    max_tokens: int = 16  # 0: compute the prompt (its logprobs) and sample nothing
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # sampled token's logprob plus the top k
    prompt_logprobs: int | None = None  # score the prompt tokens too (completions echo)
    # logit controls (vLLM's names; applied on the device, engramrt.runner.logit_controls)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    allowed_token_ids: list[int] | None = None
    banned_ids: list[int] = field(default_factory=list)  # single-token bad words
    # bad words of several tokens: the last one is banned while the output ends with the rest
    bad_word_seqs: list[list[int]] = field(default_factory=list)
    grammar: GrammarSpec | None = None  # structured outputs (engramrt.engine.grammar)

    def row(self, index: int, final: bool = True) -> SampleRow:
        return SampleRow(
            self.temperature,
            self.top_p,
            self.top_k,
            self.min_p,
            self.seed,
            index,
            self.logprobs,
            final,
        )

    def controls(self, eos_token_id: int | None) -> Controls | None:
        """What the sampler must apply, or None when nothing is asked (the usual case)."""
        stops = [*self.stop_token_ids]
        if eos_token_id is not None and not self.ignore_eos:
            stops.append(eos_token_id)
        c = Controls(
            self.presence_penalty,
            self.frequency_penalty,
            self.repetition_penalty,
            dict(self.logit_bias),
            self.min_tokens,
            stops if self.min_tokens else [],
            self.allowed_token_ids,
            list(self.banned_ids),
        )
        return None if c == Controls() else c

    def validate(self, vocab: int | None = None, eos_token_id: int | None = None) -> None:
        if self.max_tokens < 0:
            raise ValueError(f"max_tokens must be >= 0, got {self.max_tokens}")
        self.row(0).validate()
        if any(not s for s in self.stop):
            # it would match at once, ending every request before its first token (vLLM: a 400)
            raise ValueError("stop must not hold an empty string")
        bad = [t for t in self.stop_token_ids if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            where = "" if vocab is None else f" [0, {vocab})"
            raise ValueError(f"stop_token_ids: token id {bad[0]} is outside the vocabulary{where}")
        if self.prompt_logprobs is not None:
            SampleRow(logprobs=self.prompt_logprobs).validate()
        controls = self.controls(eos_token_id)
        if controls is not None:
            controls.validate(vocab)
        if self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )


def check_context_length(prompt_len: int, max_tokens: int, max_model_len: int) -> None:
    """The context-length rule (vLLM's, with its message): the prompt and every token the
    request may sample fit in ``max_model_len``."""
    total = prompt_len + max_tokens
    if total > max_model_len or max_tokens < 0:
        raise ValueError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {total} tokens ({prompt_len} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion."
        )


@dataclass(frozen=True)
class RequestLimits:
    """What a request may ask of an engine: the one validation of a request, at the boundary
    (the server's process holds a copy; the engine checks again when it builds the request)."""

    tokenizer_size: int
    model_vocab_size: int | None  # the embedding's rows; None: the tokenizer's size
    max_model_len: int
    num_blocks: int
    block_size: int
    eos_token_id: int | None
    # an id the model cannot run: the image token of a V4.1 model served text-only (its
    # vision tower is not loaded), refused rather than embedded as text
    text_only_image_token: int | None = None

    @property
    def vocab_size(self) -> int:
        """Ids must index both the tokenizer (Engram token map) and the embedding: a tokenizer
        larger than the model's vocab_size must not let one request crash the engine."""
        return min(self.tokenizer_size, self.model_vocab_size or self.tokenizer_size)

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Every rule a request must meet, with the numbers in each ValueError."""
        vocab = self.vocab_size
        params.validate(vocab, self.eos_token_id)
        if not prompt_ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(
                f"token ids {bad[:8]} are outside the vocabulary [0, {vocab}) (the "
                f"tokenizer has {self.tokenizer_size} tokens, the model's embedding "
                f"{self.model_vocab_size or self.tokenizer_size} rows)"
            )
        image = self.text_only_image_token
        if image is not None and image in prompt_ids:
            raise ValueError(
                f"the prompt holds the image token id {image} at position "
                f"{prompt_ids.index(image)}: this engine serves the model text-only (its vision "
                "tower is not loaded)"
            )
        check_context_length(len(prompt_ids), params.max_tokens, self.max_model_len)
        total = len(prompt_ids) + params.max_tokens
        blocks = -(-total // self.block_size)
        if blocks > self.num_blocks:
            raise ValueError(
                f"{total} tokens need {blocks} KV blocks; the cache has {self.num_blocks}"
            )


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Logprob:
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass(eq=False)  # a request is itself: queues find and remove it by identity
class Request:
    """``token_ids`` is the prompt and then every output token, one list that grows in place, so
    no step rebuilds a request's tokens. Built by ``Engine.new_request``, which validates it."""

    id: str
    token_ids: list[int]
    params: SamplingParams
    num_prompt_tokens: int = -1  # default: all of token_ids
    arrival: float = field(default_factory=time.monotonic)
    output_logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob | None] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_computed: int = 0  # tokens whose K/V are in the cache or on the way (a launched step)
    # sampled tokens of launched steps that the host has not read yet (overlap scheduling: 1
    # when a step is scheduled, 1 + its drafts after a verify run: as if all are accepted);
    # they count as present for positions and KV, and (one of them) for max_tokens
    unread: int = 0
    slot: int | None = None  # Engram history slot while running
    blocks: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # prefix-cache bookkeeping: full blocks already registered
    prefix_key: bytes | None = None  # the chain key of the last registered block
    snapshot: int | None = None  # a prefix hit's window snapshot (``BlockManager.snapshots``)
    window_snapshot: tuple[int, int] | None = None  # (snapshot, block) of its latest boundary
    first_token_time: float | None = None
    last_token_time: float | None = None
    num_preemptions: int = 0
    matcher: Any = None  # the grammar's llguidance matcher, for a guided request
    drafts: list[int] = field(default_factory=list)  # speculative tokens of its scheduled run
    # DSpark: the drafts its last step made for the tokens after its ``proposed_at``-th
    proposed: list[int] = field(default_factory=list)
    proposed_at: int = -1
    # a stage that keeps samples drafted into its row after a sampled run of this admission
    # (a decoding run there may verify them, before the host has seen them)
    row_drafted: bool = False

    @property
    def needs_host_tokens(self) -> bool:
        """Its next step's mask depends on its last token (a grammar, multi-token bad words),
        so the engine schedules synchronously while it runs."""
        return self.matcher is not None or bool(self.params.bad_word_seqs)

    def banned_now(self) -> list[int]:
        """The last tokens of the bad words whose other tokens end the output."""
        out = self.token_ids[self.num_prompt_tokens :]
        return [
            s[-1]
            for s in self.params.bad_word_seqs
            if len(out) >= len(s) - 1 and out[len(out) - len(s) + 1 :] == s[:-1]
        ]

    def __post_init__(self) -> None:
        self.token_ids = list(self.token_ids)
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def length_capped(self) -> bool:
        """The tokens it surely has pending reach max_tokens: it must not be scheduled again (a
        verify run in flight yields at least one token, perhaps all ``unread``)."""
        return self.num_output_tokens + min(self.unread, 1) >= self.params.max_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_ids(self) -> list[int]:
        """A copy; the engine's per-step paths index ``token_ids`` instead."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_ids(self) -> list[int]:
        """A copy; the engine's per-step paths index ``token_ids`` instead."""
        return self.token_ids[self.num_prompt_tokens :]
