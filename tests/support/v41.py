"""The ``v41-small`` preset (``benchmarks/make_models.py``), written once per test session."""

from __future__ import annotations

from pathlib import Path

from benchmarks.make_models import preset_config, write_model


def write_v41_small(out: Path) -> Path:
    write_model(preset_config("v41-small"), out, "cpu", 2**30)
    return out
