"""How the paged prefill kernel splits queries into programs. Kept apart from the kernel (no
Triton import) because the host builds the tiles with each step's inputs."""

from __future__ import annotations

PREFILL_TILE = 32  # queries per program of the paged prefill kernel


def prefill_tiles(run_lens: list[int]) -> tuple[list[int], list[int]]:
    """(request, first query) of every ``PREFILL_TILE``-query tile of every non-empty run."""
    req, m0 = [], []
    for b, n in enumerate(run_lens):
        starts = range(0, n, PREFILL_TILE)
        req += [b] * len(starts)
        m0 += starts
    return req, m0
