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
_batch_invariant = False  # --batch-invariant: dense products through ``dense_linear``
# what a sublayer asks its norm's launch to make for its linears (``norm_inputs``,
# ``mhc_fused.NormInputs``): act_quant codes and scales, or those and the bf16 values and fp32 row
NORM_CODES, NORM_VALUES = 1, 2


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


def set_batch_invariant(on: bool) -> None:
    """``--batch-invariant`` for this process (every stage's process sets it at start)."""
    global _batch_invariant
    _batch_invariant = on


def batch_invariant(device: torch.device | str) -> bool:
    """Whether dense products on ``device`` run the batch-invariant kernel (a GPU's; a CPU
    step is row-invariant already: ``row_invariant``)."""
    return _batch_invariant and use_triton(device)
