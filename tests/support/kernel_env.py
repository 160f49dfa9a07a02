"""Whether the Triton kernels can run here: natively on a GPU, or in Triton's interpreter on a
CPU (``tests/conftest.py`` turns the interpreter on when there is no GPU)."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch


def triton_runs() -> bool:
    if importlib.util.find_spec("triton") is None:
        return False
    return torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"


def interpreter_on() -> bool:
    return importlib.util.find_spec("triton") is not None and (
        os.environ.get("TRITON_INTERPRET") == "1"
    )


def kernel_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


# the engine tests that run on the CPU, and with ``-m gpu`` on CUDA too
ENGINE_DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
        ],
    ),
]
