"""Tracers: observers a forward calls at fixed points. Events: stage_entry (the stream a stage
starts from), engram_in, engram_out, attn_collapse_in, stage_exit (the stream it hands on)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

Tracer = Callable[[str, int, torch.Tensor], None]


def engram_update(before: torch.Tensor, after: torch.Tensor) -> dict[str, float]:
    """RMS of the update, RMS of the stream, fraction of stream elements whose value changed."""
    diff = after.float() - before.float()
    n = max(before.numel(), 1)
    return {
        "update_rms": float(diff.square().sum() / n) ** 0.5,
        "stream_rms": float(before.float().square().sum() / n) ** 0.5,
        "changed_frac": float((after != before).sum()) / n,
    }


def sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy()).hexdigest()


def fanout(*tracers: Tracer | None) -> Tracer | None:
    live = [t for t in tracers if t is not None]
    if len(live) <= 1:
        return live[0] if live else None
    return lambda event, layer, tensor: [t(event, layer, tensor) for t in live] and None


class EngramUpdateStats:
    """Per Engram layer, the update statistics averaged over every forward it saw (the
    measurement of the seed PR that showed a skipped Engram matters)."""

    def __init__(self) -> None:
        self._input: dict[int, torch.Tensor] = {}
        self._rows: dict[int, list[dict[str, float]]] = {}

    def __call__(self, event: str, layer: int, tensor: torch.Tensor) -> None:
        if event == "engram_in":
            self._input[layer] = tensor
        elif event == "engram_out":
            before = self._input.pop(layer)
            self._rows.setdefault(layer, []).append(
                {**engram_update(before, tensor), "n": before.numel()}
            )

    def summary(self) -> dict[int, dict[str, float]]:
        out = {}
        for layer, rows in sorted(self._rows.items()):
            n = sum(r["n"] for r in rows)
            out[layer] = {
                "update_rms": (sum(r["update_rms"] ** 2 * r["n"] for r in rows) / n) ** 0.5,
                "stream_rms": (sum(r["stream_rms"] ** 2 * r["n"] for r in rows) / n) ** 0.5,
                "changed_frac": sum(r["changed_frac"] * r["n"] for r in rows) / n,
            }
        return out


class EngramTrace:
    """``--engram-trace``: one JSON line per (rank, step, layer) with SHA-256 checksums of the
    tensors seen at each event and the Engram update statistics. Lines from several processes
    go to one file; each step's are a single append, made at the stage's exit."""

    def __init__(self, path: str | Path, rank: int = 0):
        self.path, self.rank, self.step = Path(path), rank, 0
        self._rows: dict[int, dict] = {}
        self._engram_in: torch.Tensor | None = None

    def __call__(self, event: str, layer: int, tensor: torch.Tensor) -> None:
        row = self._rows.setdefault(layer, {"rank": self.rank, "step": self.step, "layer": layer})
        row[f"{event}_sha256"] = sha256(tensor)
        if event == "engram_in":
            self._engram_in = tensor
        elif event == "engram_out":
            stats = engram_update(self._engram_in, tensor)
            row["engram_update_rms"] = stats["update_rms"]
            row["engram_changed_frac"] = stats["changed_frac"]
        elif event == "stage_exit":  # a stage's last event of a step
            self._flush()

    def _flush(self) -> None:
        lines = "".join(json.dumps(self._rows[k]) + "\n" for k in sorted(self._rows))
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, lines.encode())
        finally:
            os.close(fd)
        self._rows.clear()
        self.step += 1
