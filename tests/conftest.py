"""Without a GPU, Triton kernels run in Triton's interpreter; it must be on before the kernel
modules are imported. Without the server's stack (the GPU image has no openai, fastapi, uvicorn
or pydantic) the modules that serve HTTP are not collected, and the header says why, so that
``pytest -m gpu`` runs there."""

import importlib
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SERVER_TESTS = [
    "server/test_server.py",
    "server/test_lifecycle.py",
    "server/test_tokenize_endpoints.py",
    "server/test_api_schema.py",
    "server/test_nonfinite.py",
    "commands/test_lm_eval.py",
    "commands/test_eval.py",
]


def _missing_server_stack() -> str | None:
    for name in ("httpx", "fastapi", "uvicorn", "pydantic", "openai"):
        try:
            importlib.import_module(name)
        except ImportError:
            return name
    return None


MISSING = _missing_server_stack()
collect_ignore = SERVER_TESTS if MISSING else []


def pytest_report_header(config):
    if MISSING:
        return f"not collected ({MISSING} is not installed): {', '.join(SERVER_TESTS)}"
    return None


def pytest_configure(config):
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # xdist: start the files in collection order
    config.addinivalue_line("markers", "gpu: needs a CUDA device (skipped without one)")
    config.addinivalue_line(
        "markers", "triton: Triton kernels (the interpreter on a CPU, natively on a GPU)"
    )
    config.addinivalue_line(
        "markers", "slow: starts processes (pipeline stages, a server, the CLI); CI runs them"
    )


# The files that take longest, in the order to start them. CI runs the tests in two workers, a
# file's tests in one (README: ``-n 2 --dist loadfile``); xdist would start the files with
# the most tests first, and one of these started last keeps the run waiting on it alone.
FIRST = [
    "engine/test_speculation_is_exact.py",
    "server/test_api_schema.py",
    "server/test_server.py",
    "server/test_lifecycle.py",
    "parallel/test_pipeline.py",
    "test_docs_examples.py",
]


def _start_order(item) -> int:
    path = item.nodeid.split("::")[0].removeprefix("tests/")
    return FIRST.index(path) if path in FIRST else len(FIRST)


def pytest_collection_modifyitems(config, items):
    items.sort(key=_start_order)  # stable: the rest keep their order
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def v41_small(tmp_path_factory):
    """A ``v41-small`` checkpoint (six layers of every V4.1 role), shared by the session."""
    from tests.support.v41 import write_v41_small

    return write_v41_small(tmp_path_factory.mktemp("v41-small"))
