"""Token sampling with per-request parameters, on the stage that holds the logits.

Each row carries its own temperature, top-k, top-p, min-p and optional seed. A seeded row draws
its noise from a generator keyed by (seed, token index), so a request's samples do not depend on
its batch neighbours or on how its steps were scheduled. Logprobs are of the raw model
distribution (before temperature and truncation), as vLLM reports them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_SEED_STRIDE = 1_000_003
MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
GREEDY_BELOW = 1e-5


@dataclass
class SampleRow:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    index: int = 0  # which output token of the request this is (keys the seeded noise)
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's plus the top k

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

    def floats(self) -> list[float]:
        return [self.temperature, self.top_p, self.min_p]

    def ints(self) -> list[int]:
        seed = -1 if self.seed is None else self.seed
        k = -1 if self.logprobs is None else self.logprobs
        return [self.top_k, seed, self.index, k]

    @classmethod
    def from_parts(cls, f: list[float], i: list[int]) -> SampleRow:
        (t, p, m), (k, seed, index, lp) = f, i
        return cls(t, p, k, m, None if seed < 0 else seed, index, None if lp < 0 else lp)


@dataclass
class Sampled:
    tokens: list[int]
    logprobs: list[float] | None = None  # of each sampled token
    top_ids: list[list[int]] | None = None
    top_logprobs: list[list[float]] | None = None


def _filtered_probs(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Temperature, then top-k, min-p and top-p truncation, each row with its own values."""
    dev, vocab = logits.device, logits.shape[-1]

    def col(values, dtype=torch.float32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=dev)[:, None]

    probs = torch.softmax(logits.float() / col([r.temperature for r in rows]), dim=-1)
    ks = [r.top_k if r.top_k < vocab else 0 for r in rows]
    if any(ks):
        k = col(ks, torch.int64)
        kth = probs.topk(max(ks), dim=-1).values.gather(1, (k - 1).clamp(min=0))
        probs = probs.masked_fill((k > 0) & (probs < kth), 0.0)
    if any(r.min_p > 0 for r in rows):
        floor = col([r.min_p for r in rows]) * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    if any(r.top_p < 1 for r in rows):
        top_p = col([r.top_p for r in rows])
        sorted_p, order = probs.sort(dim=-1, descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p >= top_p * sorted_p.sum(-1, keepdim=True)
        outside &= top_p < 1  # the top one always stays; rows without top-p keep everything
        probs = probs.scatter(1, order, sorted_p.masked_fill(outside, 0.0))
    return probs


def sample_rows(
    logits: torch.Tensor, rows: list[SampleRow], generator: torch.Generator | None
) -> Sampled:
    """``logits [B, V]`` -> one token per row: argmax for greedy rows, else argmax of
    probs / Exp(1) noise. Batched on the logits' device: greedy rows move nothing but the tokens
    read back at the end; sampled rows add a few small parameter copies."""
    if not rows:
        return Sampled([])
    tokens = logits.argmax(-1)
    hot = [i for i, r in enumerate(rows) if r.temperature >= GREEDY_BELOW]  # vanishing: argmax
    if hot:
        probs = _filtered_probs(logits[hot], [rows[i] for i in hot])
        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(hot) if rows[i].seed is None]
        if unseeded:
            noise[unseeded] = torch.empty_like(probs[unseeded]).exponential_(generator=generator)
        for j, i in enumerate(hot):
            row = rows[i]
            if row.seed is not None:
                gen = torch.Generator(device=logits.device)
                gen.manual_seed((row.seed * _SEED_STRIDE + row.index) % 2**63)
                noise[j].exponential_(generator=gen)
        tokens[hot] = (probs / noise).argmax(-1)
    picked = tokens.tolist()
    want = [r.logprobs for r in rows if r.logprobs is not None]
    if not want:
        return Sampled(picked)
    return Sampled(picked, *token_logprobs(logits, picked, max(want)))


def token_logprobs(
    logits: torch.Tensor, targets: list[int], k: int
) -> tuple[list[float], list[list[int]], list[list[float]]]:
    """Log-probability of ``targets[i]`` under row i, and the row's top ``k``."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, torch.tensor(targets, device=lp.device)[:, None])[:, 0].tolist()
    if k == 0:
        return picked, [[] for _ in targets], [[] for _ in targets]
    top = lp.topk(min(k, lp.shape[-1]), dim=-1)
    return picked, top.indices.tolist(), top.values.tolist()


def sample(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """One set of parameters for every row of ``logits [B, V]``."""
    row = SampleRow(temperature, top_p)
    row.validate()
    return torch.tensor(sample_rows(logits, [row] * logits.shape[0], generator).tokens)
