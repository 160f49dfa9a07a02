"""Triton kernels for the Engram path, each with its torch reference elsewhere in engramrt.

``use_triton(device)`` decides: kernels on CUDA when Triton is importable, the torch reference
otherwise; ``ENGRAMRT_TORCH_ENGRAM=1`` forces the reference (for debugging). Tests run the
kernels on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import importlib.util
import os

import torch

FORCE_TORCH_ENV = "ENGRAMRT_TORCH_ENGRAM"


def use_triton(device: torch.device | str) -> bool:
    if os.environ.get(FORCE_TORCH_ENV) == "1":
        return False
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.device(device).type == "cuda"
