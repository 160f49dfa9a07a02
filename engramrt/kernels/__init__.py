"""Triton kernels for the Engram path, each with its torch reference elsewhere in engramrt.

``use_triton(device)`` decides: kernels on CUDA when Triton is importable, the torch reference
otherwise; ``ENGRAMRT_TORCH_ENGRAM=1`` forces the reference (for debugging). Tests run the
kernels on the CPU under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import importlib.util
import os

import torch

FORCE_TORCH_ENV = "ENGRAMRT_TORCH_ENGRAM"


@functools.cache
def _triton_installed() -> bool:
    """Looked up once: ``find_spec`` walks the import path (tens of us), and the model asks
    several times per sublayer."""
    return importlib.util.find_spec("triton") is not None


def use_triton(device: torch.device | str) -> bool:
    if os.environ.get(FORCE_TORCH_ENV) == "1":
        return False
    if not _triton_installed():
        return False
    return torch.device(device).type == "cuda"
