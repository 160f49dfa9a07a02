"""Start ``engramrt serve`` in a subprocess for HTTP tests.

``start_server(*flags)`` launches the server on a free port in its own session (so the pipeline
stage children share its process group), polls ``GET /health`` until it answers 200 and returns
``(base_url, proc)``; ``stop_server(proc)`` kills the whole group. ``running_server`` is the
same as a context manager and ``server_fixture(*flags)`` makes a pytest fixture that yields the
base URL (module scope by default)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.parallel.launch import free_port

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 90.0


def _log_tail(proc: subprocess.Popen, limit: int = 4000) -> str:
    log = getattr(proc, "log_path", None)
    if log is None or not os.path.exists(log):
        return ""
    with open(log, errors="replace") as f:
        return f.read()[-limit:]


def stop_server(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """SIGTERM the server's process group, then SIGKILL whatever is left of it."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            continue
        # the leader is gone; make sure no stage child of the group outlives it
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        break
    log = getattr(proc, "log_path", None)
    if log is not None and os.path.exists(log):
        os.unlink(log)


def start_server(
    *args: str,
    timeout: float = START_TIMEOUT_S,
    launcher: list[str] | None = None,
    model: Path | None = GQA_MODEL_DIR,
) -> tuple[str, subprocess.Popen]:
    """``python -m engramrt serve MODEL --port <free> --device cpu *args``; waits for /health
    200. ``launcher`` replaces ``python`` (torchrun, say). ``model``: the GQA fixture unless
    given here or in ``args`` (a first positional or ``--model``; None: the bundled default),
    served as ``engramrt-tiny`` unless ``args`` name it."""
    if "--model" in args or (args and not args[0].startswith("-")):
        model = None
    port = free_port()
    cmd = [*(launcher or [sys.executable]), "-m", "engramrt", "serve"]
    cmd += [] if model is None else [str(model)]
    cmd += ["--port", str(port), "--device", "cpu", *args]
    if model is not None and "--served-model-name" not in args:
        cmd += ["--served-model-name", "engramrt-tiny"]
    fd, log_path = tempfile.mkstemp(prefix="engramrt-serve-", suffix=".log")
    with os.fdopen(fd, "w") as log:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO,
            # one thread: beside the tests' other worker (xdist, two cores) a server's OpenMP
            # threads spin against it, and a 0.1 s step of the tiny model took over 60 s (the
            # step watchdog then stopped the server)
            env={**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")},
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    proc.log_path = log_path  # type: ignore[attr-defined]
    base_url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    try:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"server exited with {proc.returncode}: {' '.join(cmd)}\n{_log_tail(proc)}"
                )
            try:
                if httpx.get(f"{base_url}/health", timeout=2.0).status_code == 200:
                    return base_url, proc
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"server not healthy after {timeout:.0f} s: {' '.join(cmd)}\n{_log_tail(proc)}"
                )
            time.sleep(0.2)
    except BaseException:
        stop_server(proc)
        raise


@contextmanager
def running_server(
    *args: str, timeout: float = START_TIMEOUT_S, stop_timeout: float = 15.0
) -> Iterator[str]:
    base_url, proc = start_server(*args, timeout=timeout)
    try:
        yield base_url
    finally:
        stop_server(proc, stop_timeout)


def server_fixture(*args: str, scope: str = "module"):
    """A pytest fixture yielding the base URL of a server started with ``args``."""

    @pytest.fixture(scope=scope)
    def _server() -> Iterator[str]:
        with running_server(*args) as base_url:
            yield base_url

    return _server
