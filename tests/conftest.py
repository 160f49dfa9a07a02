"""Without a GPU, Triton kernels run in Triton's interpreter; it must be on before the kernel
modules are imported."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA device")
