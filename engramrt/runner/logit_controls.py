"""Per-request logit controls, applied in the batched sampler on the device: ``logit_bias``,
``allowed_token_ids``, banned ids (single-token bad words), ``min_tokens``, and vLLM's
repetition, frequency and presence penalties.

A request registers its controls once, when it is admitted to a slot (``StepBatch.controls``).
The sampler keeps per-slot rows on the device (the bias, with -inf for every id the request may
not produce; the ids masked until ``min_tokens``; the prompt's ids; the output-token counts) and
counts each step's sampled tokens there without reading them back, so overlap scheduling (the
host learns a token one step late) and CUDA graphs keep working. Rows of requests without
controls are not touched. Order, per row (``restate`` is the same, row by row, for tests):
bias, then the ``min_tokens`` mask, then the repetition penalty (over prompt and output ids:
positive logits divided, others multiplied), then frequency and presence (output ids only).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch

from engramrt.transfer import to_device

BIAS_LIMIT = 100.0  # OpenAI's range for logit_bias values; vLLM clamps to it


@dataclass
class Controls:
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    min_tokens: int = 0
    min_tokens_ids: list[int] = field(default_factory=list)  # EOS and stop ids, until min_tokens
    allowed_token_ids: list[int] | None = None
    banned_ids: list[int] = field(default_factory=list)

    def validate(self, vocab: int | None = None) -> None:
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must lie in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must lie in [-2, 2], got {self.frequency_penalty}")
        if not 0 < self.repetition_penalty <= 2:
            raise ValueError(
                f"repetition_penalty must lie in (0, 2], got {self.repetition_penalty}"
            )
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise ValueError("allowed_token_ids must not be empty")
        if self.allowed_token_ids is not None:
            left = set(self.allowed_token_ids) - set(self.banned_ids)
            if not left:
                raise ValueError("allowed_token_ids: bad_words ban every allowed token")
            if self.min_tokens and not left - set(self.min_tokens_ids):
                raise ValueError("min_tokens: every allowed token would end the request early")
        named = [*self.logit_bias, *(self.allowed_token_ids or []), *self.banned_ids]
        bad = [t for t in named if t < 0 or (vocab is not None and t >= vocab)]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary (0..{vocab})")

    @property
    def needs_tokens(self) -> bool:
        """Penalties read the prompt's ids and the output's counts."""
        return (self.repetition_penalty, self.frequency_penalty, self.presence_penalty) != (
            1.0,
            0.0,
            0.0,
        )

    def encode(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def decode(cls, text: str) -> Controls:
        c = cls(**json.loads(text))
        c.logit_bias = {int(k): v for k, v in c.logit_bias.items()}
        return c


class LogitControls:
    """The sampler's per-slot device rows; grown on demand to the highest slot registered."""

    def __init__(self, device: torch.device):
        self.device, self.slots, self.vocab = device, 0, 0
        self.live: dict[int, Controls] = {}  # slot -> the controls of the request in it
        self.bias = self.min_mask = self.prompt = self.counts = self.params = None

    def _grow(self, slots: int, vocab: int) -> None:
        if slots <= self.slots and vocab == self.vocab:
            return
        slots = max(slots, 2 * self.slots)
        dev = self.device

        def grown(old, new):
            if old is not None and old.shape[1:] == new.shape[1:]:
                new[: old.shape[0]] = old
            return new

        def zeros(dtype=torch.float32, width=vocab):
            return torch.zeros(slots, width, dtype=dtype, device=dev)

        self.bias = grown(self.bias, zeros())
        self.min_mask = grown(self.min_mask, zeros(torch.bool))
        self.prompt = grown(self.prompt, zeros(torch.bool))
        self.counts = grown(self.counts, zeros(torch.int32))
        self.params = grown(self.params, zeros(width=4))
        self.slots, self.vocab = slots, vocab

    def register(
        self, slot: int, c: Controls | None, prompt: list[int], output: list[int], vocab: int
    ) -> None:
        """A request admitted to ``slot``: its controls (None: it has none), and for penalties
        its prompt and the output tokens it already has (a resumed preempted request)."""
        if c is None:
            self.live.pop(slot, None)
            return
        self._grow(slot + 1, vocab)
        self.live[slot] = c
        bias = torch.zeros(vocab)
        if c.allowed_token_ids is not None:
            bias.fill_(float("-inf"))
            bias[c.allowed_token_ids] = 0.0
        for t, b in c.logit_bias.items():
            bias[t] += max(-BIAS_LIMIT, min(BIAS_LIMIT, b))
        bias[c.banned_ids] = float("-inf")
        self.bias[slot] = to_device(bias, self.device)
        mask = torch.zeros(vocab, dtype=torch.bool)
        mask[[t for t in c.min_tokens_ids if 0 <= t < vocab]] = True
        self.min_mask[slot] = to_device(mask, self.device)
        seen = torch.zeros(vocab, dtype=torch.bool)
        counts = torch.zeros(vocab, dtype=torch.int32)
        if c.needs_tokens:
            seen[torch.tensor(prompt, dtype=torch.int64)] = True
            out = torch.tensor(output, dtype=torch.int64)
            counts = torch.bincount(out, minlength=vocab)[:vocab].to(torch.int32)
        self.prompt[slot] = to_device(seen, self.device)
        self.counts[slot] = to_device(counts, self.device)
        params = [c.presence_penalty, c.frequency_penalty, c.repetition_penalty, c.min_tokens]
        self.params[slot] = to_device(torch.tensor(params, dtype=torch.float32), self.device)

    def rows(self, slots: list[int]) -> list[int]:
        """The batch rows whose requests have controls."""
        return [i for i, s in enumerate(slots) if s in self.live]

    def apply(self, logits: torch.Tensor, slots: list[int], index: list[int]) -> torch.Tensor:
        """``logits [B, V]`` of requests in ``slots`` about to sample their output token
        ``index``: the controlled rows processed, the others untouched (a new tensor only when
        some row has controls)."""
        at = self.rows(slots)
        if not at:
            return logits
        dev = logits.device
        rows = to_device(torch.tensor(at), dev)
        s = to_device(torch.tensor([slots[i] for i in at]), dev)
        idx = to_device(torch.tensor([index[i] for i in at], dtype=torch.float32), dev)
        p = self.params[s]
        x = logits[rows].float() + self.bias[s]
        x = x.masked_fill(self.min_mask[s] & (idx < p[:, 3])[:, None], float("-inf"))
        c = self.counts[s]
        seen = c > 0
        rep = p[:, 2:3]
        x = torch.where(self.prompt[s] | seen, torch.where(x > 0, x / rep, x * rep), x)
        x = x - p[:, 1:2] * c - p[:, 0:1] * seen
        out = logits.clone()
        out[rows] = x.to(out.dtype)
        return out

    def count(self, slots: list[int], final: list[bool], tokens: torch.Tensor) -> None:
        """Add each controlled row's sampled token (``tokens [B]`` on the device) to its slot's
        counts; rows whose sample is discarded (mid-prompt chunks) add nothing."""
        at = [i for i in self.rows(slots) if final[i] and self.live[slots[i]].needs_tokens]
        if not at:
            return
        dev = tokens.device
        s = to_device(torch.tensor([slots[i] for i in at]), dev)
        t = tokens[to_device(torch.tensor(at), dev)]
        self.counts.index_put_((s, t), torch.ones_like(t, dtype=torch.int32), accumulate=True)


def restate(
    logits: torch.Tensor, c: Controls, prompt: list[int], output: list[int], index: int
) -> torch.Tensor:
    """One row ``logits [V]`` under ``c``, written out per token id: the tests' oracle."""
    x = [float(v) for v in logits.cpu()]
    vocab = len(x)
    for t in range(vocab):
        if c.allowed_token_ids is not None and t not in c.allowed_token_ids:
            x[t] = float("-inf")
    for t, b in c.logit_bias.items():
        x[t] += max(-BIAS_LIMIT, min(BIAS_LIMIT, b))
    for t in c.banned_ids:
        x[t] = float("-inf")
    if index < c.min_tokens:
        for t in c.min_tokens_ids:
            x[t] = float("-inf")
    for t in range(vocab):
        n = output.count(t)
        if t in prompt or n:
            x[t] = x[t] / c.repetition_penalty if x[t] > 0 else x[t] * c.repetition_penalty
        x[t] -= c.frequency_penalty * n + c.presence_penalty * (n > 0)
    return torch.tensor(x)
