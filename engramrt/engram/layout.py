"""Hash layout: primes, column offsets and multipliers as DeepSeek-V4.1 builds them."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch

from engramrt.config import ConfigError, EngramConfig

MULT_SEED = 10007  # multiplier RNG seed per global layer id (hard-coded in the reference)


def is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    f = 3
    while f * f <= n:
        if n % f == 0:
            return False
        f += 2
    return True


def _next_prime(after: int, seen: set[int]) -> int:
    n = after + 1
    while not is_prime(n) or n in seen:
        n += 1
    return n


def search_primes(cfg: EngramConfig) -> list[list[list[int]]]:
    """``primes[layer][ngram-2][head]``: one shared ``seen`` set, so no prime is used twice."""
    seen: set[int] = set()
    primes = []
    for _ in cfg.layer_ids:
        per_layer = []
        for _n in range(2, cfg.max_ngram_size + 1):
            current = cfg.vocab_size - 1
            heads = []
            for _h in range(cfg.n_heads):
                current = _next_prime(current, seen)
                seen.add(current)
                heads.append(current)
            per_layer.append(heads)
        primes.append(per_layer)
    return primes


def hash_multipliers(layer_id: int, max_ngram_size: int, compressed_vocab_size: int) -> list[int]:
    """Odd multipliers per look-back shift; the bound keeps every product below 2**63."""
    bound = max(1, (2**63 - 1) // compressed_vocab_size // 2)
    rng = np.random.default_rng(MULT_SEED * layer_id)
    draws = rng.integers(low=0, high=bound, size=(max_ngram_size,), dtype=np.int64)
    return [int(v) * 2 + 1 for v in draws]


@dataclass(frozen=True)
class EngramLayout:
    """Everything the hash needs besides the token map; tensors are built on demand (CPU)."""

    config: EngramConfig
    primes: tuple[tuple[int, ...], ...]  # [L][(N-1)*H], column order c = (n-2)*H + h
    offsets: tuple[tuple[int, ...], ...]  # [L][(N-1)*H], exclusive prefix sums of primes
    multipliers: tuple[tuple[int, ...], ...]  # [L][N], row s = look-back shift

    @classmethod
    def from_config(cls, cfg: EngramConfig) -> EngramLayout:
        nested = search_primes(cfg)
        primes = tuple(tuple(p for per_n in layer for p in per_n) for layer in nested)
        offsets = []
        for i, (layer_id, cols) in enumerate(zip(cfg.layer_ids, primes, strict=True)):
            total = sum(cols)
            if total != cfg.num_embeddings[i]:
                raise ConfigError(
                    f"engram_num_embeddings[{i}] (layer {layer_id}) is {cfg.num_embeddings[i]} but "
                    f"the layer's primes sum to {total}"
                )
            starts = [0]
            for p in cols[:-1]:
                starts.append(starts[-1] + p)
            offsets.append(tuple(starts))
        mults = tuple(
            tuple(hash_multipliers(lid, cfg.max_ngram_size, cfg.compressed_vocab_size))
            for lid in cfg.layer_ids
        )
        return cls(cfg, primes, tuple(offsets), mults)

    def column_bounds(self, layer: int) -> list[int]:
        """Row boundaries of the hash columns of ``layer`` (index in layer_ids); last = rows."""
        return [*self.offsets[layer], self.config.num_embeddings[layer]]

    @cached_property
    def primes_tensor(self) -> torch.Tensor:
        return torch.tensor(self.primes, dtype=torch.int64)

    @cached_property
    def offsets_tensor(self) -> torch.Tensor:
        return torch.tensor(self.offsets, dtype=torch.int64)

    @cached_property
    def multipliers_tensor(self) -> torch.Tensor:
        return torch.tensor(self.multipliers, dtype=torch.int64)
