"""Layer partitions across pipeline stages, with vLLM's rules and default split.

``--pp-layer-partition`` "a,b,..." (or ``ENGRAMRT_PP_LAYER_PARTITION``, or vLLM's
``VLLM_PP_LAYER_PARTITION``): one entry per stage, summing to the layer count; unlike vLLM, an
empty (zero) or negative stage is rejected too. The environment is read only when there are
several stages, so a partition exported for a pipeline does not break a one-stage run.
"""

from __future__ import annotations

import os

ENV = "ENGRAMRT_PP_LAYER_PARTITION"
VLLM_ENV = "VLLM_PP_LAYER_PARTITION"


class PartitionError(ValueError):
    """An invalid layer partition; the message names the rule and the values."""


def parse_partition(text: str) -> list[int]:
    try:
        return [int(piece) for piece in text.split(",")]
    except ValueError:
        raise PartitionError(
            f"layer partition must be comma-separated integers, got {text!r}"
        ) from None


def default_partition(num_layers: int, pp_size: int) -> list[int]:
    """vLLM's split: equal shares, the remainder one layer each to the stages before the last,
    from the second-to-last backwards (the last stage also holds the norm and head)."""
    parts = [num_layers // pp_size] * pp_size
    for i in range(2, num_layers % pp_size + 2):
        parts[-i] += 1
    return parts


def resolve_partition(num_layers: int, pp_size: int, text: str | None = None) -> list[int]:
    """The partition from ``text``, else (with several stages) the environment, else the
    default; validated."""
    if pp_size < 1:
        raise PartitionError(f"pipeline_parallel_size must be >= 1, got {pp_size}")
    if text is None and pp_size > 1:
        text = os.environ.get(ENV) or os.environ.get(VLLM_ENV)
    if not text and pp_size > num_layers:
        raise PartitionError(
            f"pipeline_parallel_size {pp_size} exceeds the model's {num_layers} layers: every "
            "stage needs at least one layer"
        )
    parts = parse_partition(text) if text else default_partition(num_layers, pp_size)
    if len(parts) != pp_size:
        raise PartitionError(
            f"layer partition {parts} has {len(parts)} entries but pipeline_parallel_size is "
            f"{pp_size}: one entry per stage"
        )
    if any(p < 1 for p in parts):
        raise PartitionError(
            f"layer partition {parts} has an empty stage: every entry must be >= 1"
        )
    if sum(parts) != num_layers:
        raise PartitionError(
            f"layer partition {parts} sums to {sum(parts)} but the model has {num_layers} layers: "
            "the entries must sum to num_hidden_layers"
        )
    return parts


def stage_layers(parts: list[int], rank: int) -> list[int]:
    start = sum(parts[:rank])
    return list(range(start, start + parts[rank]))


def all_partitions(num_layers: int, stages: int) -> list[list[int]]:
    """Every composition of ``num_layers`` into ``stages`` positive parts, lexicographic."""
    if stages == 1:
        return [[num_layers]]
    return [
        [first, *rest]
        for first in range(1, num_layers - stages + 2)
        for rest in all_partitions(num_layers - first, stages - 1)
    ]
