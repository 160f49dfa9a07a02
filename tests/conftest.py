"""Without a GPU, Triton kernels run in Triton's interpreter; it must be on before the kernel
modules are imported."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line(
        "markers", "triton: Triton kernels (the interpreter on a CPU, natively on a GPU)"
    )
    config.addinivalue_line(
        "markers", "slow: starts processes (pipeline stages, a server, the CLI); CI runs them"
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
