"""How the paged prefill kernel splits queries into programs. Kept apart from the kernel (no
Triton import) because the host builds the tiles with each step's inputs."""

from __future__ import annotations

# Queries per host tile, the one tile size: the prefill kernel's default BLOCK_M, and a launch
# with a smaller BLOCK_M (a power of two dividing it) runs PREFILL_TILE // BLOCK_M programs per
# tile, so the host tiles never depend on the launch configuration.
PREFILL_TILE = 128


def prefill_tiles(
    run_lens: list[int], start_pos: list[int] | None = None
) -> tuple[list[int], list[int]]:
    """(request, first query) of every ``PREFILL_TILE``-query tile of every non-empty run, the
    tiles with the most keys to walk first (``start_pos[b]`` cached positions plus the run up to
    the tile's last query): under a causal mask the last tiles of a long run cost the most, and
    starting them first leaves the short ones to fill the GPU's last wave."""
    tiles = []
    for b, n in enumerate(run_lens):
        p0 = 0 if start_pos is None else start_pos[b]
        tiles += [(-(p0 + min(m0 + PREFILL_TILE, n)), b, m0) for m0 in range(0, n, PREFILL_TILE)]
    tiles.sort()
    return [b for _, b, _ in tiles], [m0 for _, _, m0 in tiles]
