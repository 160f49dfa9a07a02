"""What one step asks of the stages (``StepBatch``, with each request's ``SampleRow``) and what
the last stage answers (``StepResult``). The engine builds a batch; the pipeline carries it to
every stage in the one wire codec below (msgpack by field name, through msgspec: a new field
travels with no codec change, and a typed decode rebuilds the same dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import msgspec
import torch

from engramrt.runner.logit_controls import Controls

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs


@dataclass
class SampleRow:
    """One request's sampling parameters for one step."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    index: int = 0  # which output token of the request this is (keys the seeded noise)
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's plus the top k
    final: bool = True  # False: a mid-prompt chunk's sample, which the engine discards

    def validate(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must lie in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must lie in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must lie in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must lie in [0, 2**63), got {self.seed}")


@dataclass
class ImageRef:
    """An image of a request's prompt as the first stage encodes it: its span takes positions
    ``start`` .. ``start + length`` of the request's tokens (each one the image token id);
    ``pixels`` are its RGB bytes (uint8, ``height x width x 3``) fitted to the family's grid
    (``grid``, the family's numbers: for V4.1 ``images.ImageGrid``'s fields); ``key``: a hash
    of them, which the stage's encoder cache and prefix caching key the span by."""

    start: int
    length: int
    key: str
    grid: list[int]
    pixels: bytes


@dataclass
class NewRequest:
    """A request taking a slot this step (fresh, a prefix-cache hit, resumed after preemption),
    whole: what the stages keep per slot until it leaves (``engramrt.runner.slots``). It crosses
    once; later steps carry only its runs and what changed."""

    slot: int
    tokens: list[int]  # every token the host has: the prompt, then the outputs so far
    num_prompt: int  # how many of ``tokens`` are the prompt
    num_computed: int  # tokens before this step's run: its history is rebuilt from them
    blocks: list[int] | None = None  # its block table, whole (None: the slot's stays)
    sampling: SampleRow = field(default_factory=SampleRow)  # its parameters (``index`` unused)
    controls: Controls | None = None  # its logit controls (None: none asked)
    snapshot: int | None = None  # a V4.1 prefix hit: the window snapshot its rings start from
    images: list[ImageRef] = field(default_factory=list)  # its prompt's, in order

    @property
    def needs_tokens_on_last_stage(self) -> bool:
        """Penalties read the prompt and the outputs; nothing else past the first stage does."""
        return self.controls is not None and self.controls.needs_tokens


@dataclass
class StepBatch:
    """Request ``b`` computes ``run_lens[b]`` tokens from position ``start_pos[b]`` in history
    and KV slot ``slots[b]``.

    What a slot keeps from step to step crosses once: ``admitted`` requests take their slots
    before the step runs (block table, token row, history rebuilt from their tokens on the
    first stage, sampling parameters and logit controls on the last; ``engramrt.runner.slots``).
    A slot no request was admitted to samples greedily. The rest are deltas. ``tokens``: the
    tokens the first stage's rows lack, flat: run ``b``'s last ``token_counts[b]`` (default:
    all of every run); a stage that samples where it embeds has each final sample already
    (``SlotTable.keep_samples``), so a decode step there sends none. Request ``b``'s block
    table becomes its first ``block_starts[b]`` blocks (default 0) followed by
    ``new_blocks[b]`` (without ``new_blocks`` the tables stay as they are: by default each
    slot's fixed blocks); ``sample_index[b]`` is which output token its sample is (keys seeded
    noise and ``min_tokens``; default 0) and ``final[b]`` whether the engine keeps it (False: a
    mid-prompt chunk; default True)."""

    tokens: list[int] | None
    slots: list[int]
    run_lens: list[int]
    start_pos: list[int]
    new_blocks: list[list[int]] | None = None
    block_starts: list[int] | None = None
    admitted: list[NewRequest] = field(default_factory=list)
    token_counts: list[int] | None = None
    sample_index: list[int] | None = None
    final: list[bool] | None = None
    return_logits: bool = False
    targets: list[int] | None = None  # per token: the next-token id to score (-1: none)
    target_k: int = 0  # top-k alternatives reported with each scored target
    # (row, the tokens its grammar allows next as int32 bit words) of guided rows that sample
    masks: list[tuple[int, list[int]]] = field(default_factory=list)
    # speculative drafts per request (its run is the anchor and them; a token is sampled after
    # each); None: none in this step
    drafts: list[int] | None = None
    # those drafts, run after run, where the host made them (over a pipeline; a stage that keeps
    # its token rows reads them there and gets none)
    draft_tokens: list[int] = field(default_factory=list)
    # (slot, the anchor and drafts of its last verify run, drafts accepted): history commits of
    # the previous step's verify runs, applied by the first stage before it hashes
    commits: list[tuple[int, list[int], int]] = field(default_factory=list)
    # per run, 1 where it starts behind a verify run still in flight, whose drafts its start
    # counts as accepted (overlap scheduling with speculation: ``engramrt.runner.verify``)
    lag: list[int] | None = None
    # (slot, snapshot) of runs ending on a block boundary: V4.1 rings kept after the step for
    # prefix hits there (``V41Cache.save_windows``)
    snapshots: list[tuple[int, int]] = field(default_factory=list)

    @property
    def full_logits(self) -> bool:
        """Logits at every token (returned, or scored for prompt logprobs), not only at each
        run's last token, which is all that sampling reads."""
        return self.return_logits or self.targets is not None

    @property
    def num_tokens(self) -> int:
        return sum(self.run_lens)

    @property
    def tails(self) -> list[int]:
        """Tokens sampled per run: after its last token, and after each draft."""
        return [1] * len(self.slots) if self.drafts is None else [1 + d for d in self.drafts]

    @property
    def num_samples(self) -> int:
        return sum(self.tails)


@dataclass
class StepResult:
    # sampled after each request's last token this step (-1: empty run); with drafts, after the
    # anchor and each draft of a run, run after run (``StepBatch.tails``)
    tokens: list[int]
    logits: torch.Tensor | None = None  # [T, V] fp32 when asked for
    logprobs: list[float] | None = None  # of each sampled token, when any row asked
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None
    target_logprobs: list[float] | None = None  # per token, of its target (NaN: none)
    target_top_ids: list[list[int]] | None = None
    target_top_logprobs: list[list[float]] | None = None
    # DSpark: each run's drafts for its next step, from its last accepted position
    drafts: list[list[int]] | None = None
    # per sample (as ``tokens``): whether the logits it was drawn from were all finite, before
    # any mask (False: NaN or infinity, a broken weight or an overflow; the engine ends the
    # request with an error and keeps nothing of the sample); None: unchecked (a stub)
    finite: list[bool] | None = None


class DeviceResult:
    """A step's ``StepResult`` while the device may still be computing it (overlap scheduling).

    The sampler's outputs are device tensors; on a GPU each is copied ``non_blocking`` into
    pinned host memory and a CUDA event is recorded after the copies, so launching the next
    step needs no synchronisation. ``wait`` blocks on that event and turns the host copies into
    the lists of a ``StepResult`` (on the CPU everything is already done). A result that is
    known at once (a pipeline of several stages, a stub) is wrapped by ``ready``."""

    def __init__(
        self,
        parts: dict[str, torch.Tensor] | None = None,
        logits: torch.Tensor | None = None,
        targets: list[int] | None = None,
        result: StepResult | None = None,
    ):
        self.targets, self.result = targets, result
        self.host = {k: v.to("cpu", non_blocking=True) for k, v in (parts or {}).items()}
        self.logits = logits  # stays where it is, as in a synchronous step
        self.event = None
        devices = [v.device for v in (parts or {}).values()]
        if devices and devices[0].type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record(torch.cuda.current_stream(devices[0]))

    @classmethod
    def ready(cls, result: StepResult) -> DeviceResult:
        return cls(result=result)

    def add(self, name: str, value: torch.Tensor) -> None:
        """One more output computed after the sampler's (its copy then ends the step)."""
        self.host[name] = value.to("cpu", non_blocking=True)
        if self.event is not None:
            self.event.record(torch.cuda.current_stream(value.device))

    def wait(self) -> StepResult:
        if self.result is not None:
            return self.result
        if self.event is not None:
            self.event.synchronize()
        h = {k: v.tolist() for k, v in self.host.items()}
        result = StepResult(
            h["tokens"], self.logits, drafts=h.get("drafts"), finite=h.get("finite")
        )
        if "logprobs" in h:
            result.logprobs, result.top_ids = h["logprobs"], h["top_ids"]
            result.top_logprobs = h["top_logprobs"]
        if self.targets is not None:
            result.target_logprobs = [
                x if t >= 0 else float("nan")
                for x, t in zip(h["target_logprobs"], self.targets, strict=True)
            ]
            result.target_top_ids = h["target_top_ids"]
            result.target_top_logprobs = h["target_top_logprobs"]
        self.result = result
        return result


_ENCODER = msgspec.msgpack.Encoder()
_BATCH = msgspec.msgpack.Decoder(StepBatch)
_RESULT = msgspec.msgpack.Decoder(StepResult)


def encode_batch(batch: StepBatch, with_tokens: bool) -> torch.Tensor:
    """The step for another rank, as bytes: the first stage's own business (the tokens, unless
    the receiver embeds them too, a TP follower of the first stage, or penalties need an admitted
    request's on the last stage; the verify commits: only its hasher reads them) stays behind."""
    admitted = [
        a if with_tokens or a.needs_tokens_on_last_stage else replace(a, tokens=[])
        for a in batch.admitted
    ]
    wire = replace(
        batch, tokens=batch.tokens if with_tokens else None, admitted=admitted, commits=[]
    )
    return _as_tensor(_ENCODER.encode(wire))


def decode_batch(buf: torch.Tensor) -> StepBatch:
    return _BATCH.decode(buf.cpu().numpy().tobytes())


def encode_result(result: StepResult) -> torch.Tensor:
    """A result's lists as bytes; its logits (a tensor) travel apart, raw."""
    return _as_tensor(_ENCODER.encode(replace(result, logits=None)))


def decode_result(buf: torch.Tensor) -> StepResult:
    return _RESULT.decode(buf.cpu().numpy().tobytes())


def _as_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)
