"""How many KV blocks a stage gets: arithmetic on plain numbers, so it is testable without a GPU.

Two ways, as in vLLM: a fixed byte budget (``--kv-cache-memory-bytes``, or a default off GPU),
or what ``--gpu-memory-utilization`` of the GPU leaves after a profiled forward.
"""

from __future__ import annotations

from dataclasses import dataclass

CPU_KV_BYTES = 256 * 2**20  # the budget where there is no GPU memory to size it from


def blocks_from_bytes(budget: int, per_block: int, cap: int) -> int:
    """At least one block, at most ``cap`` (what the longest sequences could ever use)."""
    return max(1, min(cap, budget // per_block))


@dataclass
class MemoryProfile:
    """GPU memory figures after a forward of ``tokens`` tokens (bytes)."""

    total: int
    free: int
    reserved: int  # by torch's allocator
    weights: int  # allocated once the profile's tensors are gone
    peak: int  # allocated at the forward's peak, the profile's own cache included
    profile_cache: int  # the small cache the profile ran with
    tokens: int


def blocks_from_profile(
    p: MemoryProfile,
    utilization: float,
    per_block: int,
    stages_per_gpu: int = 1,
    graph_rows: int = 0,
    graph_outputs: int = 0,
    fixed: int = 0,
) -> int:
    """What ``utilization`` of the GPU (shared by ``stages_per_gpu`` stages) leaves after memory
    outside torch (CUDA context, NCCL), the weights, the peak's activations, the CUDA graphs'
    pool (about a forward of ``graph_rows`` tokens; 0 without graphs), the ``graph_outputs``
    bytes each captured graph keeps for its own outputs and the ``fixed`` bytes the cache holds
    whatever its block count (V4.1's per-slot rings and tails), in blocks."""
    outside_torch = p.total - p.free - p.reserved
    activations = p.peak - p.profile_cache - p.weights
    graphs = activations * min(1.0, graph_rows / p.tokens) if graph_rows else 0
    budget = int(
        p.total * utilization / stages_per_gpu
        - outside_torch
        - p.weights
        - activations
        - graphs
        - graph_outputs
        - fixed
    )
    if budget < per_block:
        raise ValueError(
            f"--gpu-memory-utilization {utilization} leaves no room for the KV cache: the "
            f"weights and a {p.tokens}-token forward peak at {p.peak / 2**30:.2f} GiB of "
            f"{p.total / 2**30:.2f} GiB (stages sharing this GPU: {stages_per_gpu})"
        )
    return budget // per_block


def stages_per_gpu(local_world_size: int, gpus: int) -> int:
    """How many of this host's stage processes share the busiest GPU."""
    return -(-local_world_size // max(gpus, 1))
