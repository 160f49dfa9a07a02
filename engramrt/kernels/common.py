"""Helpers that several kernels share: a dot product that stays exact under Triton's
interpreter, whether the interpreter runs, the machine's size, and the arrival counters of
split reductions."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

SMS = 132  # H200; only a split heuristic
SPREAD_BELOW = 2 * SMS  # tiles under which each split takes a program of its own
MAX_TILES = 1 << 16  # split tiles in flight a launch (their arrival counters)


@triton.jit
def dot_f32(a, b, F32: tl.constexpr):
    """``a @ b`` accumulated in fp32. ``F32``: in fp32 at full precision, for fp32 operands, and
    for bf16 ones under Triton's interpreter, whose ``tl.dot`` multiplies bf16 bit patterns as
    integers; bf16 values are exact in fp32, so the result is the tensor-core one's."""
    if F32:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


def interpreted() -> bool:
    """Triton's CPU interpreter (``TRITON_INTERPRET=1``), where the tests run the kernels."""
    return os.environ.get("TRITON_INTERPRET") == "1"


_counters: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device) -> torch.Tensor:
    """``MAX_TILES`` counters on ``device``, zeroed once, for kernels whose splits of a tile
    are summed by the tile's last program to arrive: that program sets its counter back to zero
    (so a CUDA graph replays with them zero). Kernels run one after another on a stream, so
    they share them."""
    if device not in _counters:
        _counters[device] = torch.zeros(MAX_TILES, dtype=torch.int32, device=device)
    return _counters[device]
