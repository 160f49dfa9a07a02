"""Brute-force Engram hash oracle on plain Python integers.

Written independently of ``engramrt.engram.hashing`` and ``engramrt.engram.history``: it takes a
request's full token history as a list and applies the per-token definition of DeepSeek's
reference literally, one position at a time. Only the layout's primes, offsets and multipliers
are borrowed.
"""

from __future__ import annotations

from collections.abc import Sequence

from engramrt.engram.layout import EngramLayout


def is_dead(tok: int, image_token_id: int | None, mm_pad_start: int | None) -> bool:
    """An image id, or a multimodal pad id (``>= mm_pad_start``) when that bound is given."""
    if image_token_id is not None and tok == image_token_id:
        return True
    return mm_pad_start is not None and tok >= mm_pad_start


def ids_from_compressed(layout: EngramLayout, comp: Sequence[int]) -> list[list[int]]:
    """ids ``[L][(N-1)*H]`` from the compressed ids ``c_0 .. c_{N-1}`` (index = look-back shift)."""
    cfg = layout.config
    n, heads = cfg.max_ngram_size, cfg.n_heads
    assert len(comp) == n
    out = []
    for layer in range(cfg.num_layers):
        mult = layout.multipliers[layer]
        primes, offsets = layout.primes[layer], layout.offsets[layer]
        r = comp[0] * mult[0]
        row = []
        for i in range(1, n):
            r ^= comp[i] * mult[i]
            for h in range(heads):
                col = (i - 1) * heads + h
                row.append(r % primes[col] + offsets[col])
        out.append(row)
    return out


def oracle_position_ids(
    layout: EngramLayout,
    token_map: Sequence[int],
    tokens: Sequence[int],
    p: int,
    image_token_id: int | None = None,
    mm_pad_start: int | None = None,
) -> list[list[int]]:
    """ids ``[L][(N-1)*H]`` of position ``p`` of a request whose tokens so far are ``tokens``."""
    cfg = layout.config
    pad_c = token_map[cfg.pad_token_id]
    blocked = False
    comp = []
    for s in range(cfg.max_ngram_size):
        blocked = blocked or p < s or is_dead(tokens[p - s], image_token_id, mm_pad_start)
        comp.append(pad_c if blocked else token_map[tokens[p - s]])
    return ids_from_compressed(layout, comp)


def oracle_ids(
    layout: EngramLayout,
    token_map: Sequence[int],
    tokens: Sequence[int],
    image_token_id: int | None = None,
    mm_pad_start: int | None = None,
) -> list[list[list[int]]]:
    """ids ``[T][L][(N-1)*H]`` for every position of a request's full token history."""
    return [
        oracle_position_ids(layout, token_map, tokens, p, image_token_id, mm_pad_start)
        for p in range(len(tokens))
    ]


def oracle_pad_ids(layout: EngramLayout, token_map: Sequence[int]) -> list[list[int]]:
    """The all-pad ids ``[L][(N-1)*H]``: every shift blocked (padding rows, image tokens)."""
    pad_c = token_map[layout.config.pad_token_id]
    return ids_from_compressed(layout, [pad_c] * layout.config.max_ngram_size)


def oracle_history(tokens: Sequence[int], n: int) -> list[int]:
    """History row after ``tokens``: the last ``n - 1`` ids, oldest first, left-padded with 0."""
    width = n - 1
    tail = [int(t) for t in tokens][-width:]
    return [0] * (width - len(tail)) + tail
