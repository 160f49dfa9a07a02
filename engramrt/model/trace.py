"""Tracers: observers a forward calls at fixed points (engram_in, engram_out, attn_collapse_in)."""

from __future__ import annotations

import torch


class EngramUpdateStats:
    """Per Engram layer: RMS of the update (out - in), RMS of the stream it was added to, and the
    fraction of stream elements whose stored value changed, accumulated over forwards (the
    measurement of the seed PR that showed a skipped Engram matters)."""

    def __init__(self) -> None:
        self._input: dict[int, torch.Tensor] = {}
        self._acc: dict[int, list[float]] = {}

    def __call__(self, event: str, layer_id: int, tensor: torch.Tensor) -> None:
        if event == "engram_in":
            self._input[layer_id] = tensor
        elif event == "engram_out":
            before = self._input.pop(layer_id)
            diff = tensor.float() - before.float()
            acc = self._acc.setdefault(layer_id, [0.0, 0.0, 0.0, 0.0])
            acc[0] += float(diff.square().sum())
            acc[1] += float(before.float().square().sum())
            acc[2] += float((tensor != before).sum())
            acc[3] += before.numel()

    def summary(self) -> dict[int, dict[str, float]]:
        return {
            layer: {
                "update_rms": (sq / n) ** 0.5,
                "stream_rms": (stream / n) ** 0.5,
                "changed_frac": changed / n,
            }
            for layer, (sq, stream, changed, n) in sorted(self._acc.items())
        }
