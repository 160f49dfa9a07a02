"""A bundled model with some of its tensors edited (a NaN written into a weight, say), for the
tests of what a broken checkpoint does at load and at run time. The other files are linked, not
copied."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engramrt.bundled import GQA_MODEL_DIR


def edited_model(
    out: Path, edit: Callable[[dict[str, torch.Tensor]], object], src: Path = GQA_MODEL_DIR
) -> Path:
    """``src`` (a single-file checkpoint) in ``out`` with its tensors edited in place by
    ``edit``."""
    out.mkdir(parents=True)
    for f in Path(src).iterdir():
        if f.name != "model.safetensors":
            (out / f.name).symlink_to(f)
    state = load_file(Path(src) / "model.safetensors")
    edit(state)
    save_file(state, out / "model.safetensors")
    return out


def poison(name: str, index: tuple[int, ...] | int = 0, value: float = float("nan")):
    """An ``edit`` writing ``value`` at ``index`` of tensor ``name``."""

    def edit(state: dict[str, torch.Tensor]) -> None:
        state[name][index] = value

    return edit
