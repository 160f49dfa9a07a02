"""What every benchmark shares, none of it engramrt's: the record of a run (device, versions,
command, date), the device's two ceilings measured in the same run, GPU timing, and the JSON a
suite writes (``benchmarks/results/<date>/<suite>.json``)."""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.table import fmt

RESULTS = Path(__file__).parent / "results"
# The vendor's datasheet (H200 SXM): leads only; every fraction a suite reports is of the
# ceilings measured in the same run (``copy_gbs``, ``matmul_tflops``).
DATASHEET = {"device": "NVIDIA H200", "hbm_gbs": 4800.0, "bf16_dense_tflops": 989.0}
FLUSH_BYTES = 256 * 2**20  # more than the H200's 60 MB of L2
DATE_ENV = "ENGRAMRT_BENCH_DATE"  # the runner's date, for the suites it starts


def today() -> str:
    """The results' date folder: the runner's when it started this suite, else today (UTC)."""
    return os.environ.get(DATE_ENV) or datetime.datetime.now(datetime.timezone.utc).strftime(
        "%Y-%m-%d"
    )


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def git_commit() -> str | None:
    """The checkout's commit (``+`` when its tree has changes), or None without git (the device
    machine gets a copy of the tree without its history)."""
    root = Path(__file__).parents[1]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
        )
    except OSError:
        return None
    if head.returncode:
        return None
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


def environment(device: str) -> dict[str, Any]:
    """What a number depends on besides the code: the device and the stack's versions."""
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": None,
        "commit": os.environ.get("ENGRAMRT_COMMIT") or git_commit(),
        "cpus": os.cpu_count(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        pass
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(
            device=props.name,
            sms=props.multi_processor_count,
            memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
        )
    else:
        info["device"] = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    return info


def command_line() -> str:
    """The command that ran, as a user would type it."""
    argv = list(sys.argv)
    if argv and argv[0].endswith(".py"):
        module = Path(argv[0]).resolve()
        root = Path(__file__).parents[1]
        if module.is_relative_to(root):
            argv[0] = ".".join(module.relative_to(root).with_suffix("").parts)
            argv.insert(0, "-m")
    return "python " + " ".join(shlex.quote(a) for a in argv)


# --------------------------------------------------------------------------- timing


def events_us(fn: Callable[[], Any], device: str, reps: int = 20, warmup: int = 3) -> float:
    """Median time of one call in us: CUDA events around each call on a GPU (its launches
    included), the host's clock around each call elsewhere."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device == "cuda":
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def graph_us(fn: Callable[[], Any], reps: int = 20) -> float:
    """GPU time of one call without the host's launch cost: the call captured in a CUDA graph
    (after two warm-up calls, which compile), replayed after a 256 MB write that flushes the L2,
    CUDA events around each replay; the median of ``reps``."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _after_flush(graph.replay, reps)


def flushed_us(fn: Callable[[], Any], reps: int = 20) -> float:
    """As ``graph_us`` for what a graph cannot capture: each call launched after an L2 flush,
    CUDA events around it (its launches included)."""
    for _ in range(2):
        fn()
    return _after_flush(fn, reps)


def _after_flush(run: Callable[[], Any], reps: int) -> float:
    """The median GPU time of ``run`` over ``reps`` calls, each after a write that flushes the
    L2, CUDA events around it."""
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(reps):
        flush.zero_()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def gpu_us(fn: Callable[[], Any], graph: bool = True, reps: int = 20) -> tuple[float, str]:
    """(us, how): from a CUDA graph (``graph``, and its capture works), else launched eagerly
    after the flush."""
    if graph:
        try:
            return graph_us(fn, reps), "graph"
        except RuntimeError:  # a capture refused: what it left on the device settles first
            torch.cuda.synchronize()
    return flushed_us(fn, reps), "eager"


# --------------------------------------------------------------------------- ceilings


def copy_gbs(device: str) -> float:
    """Measured ceiling: a large copy in device memory, bytes read plus bytes written over its
    median time (2 GiB on a GPU, 256 MiB on a CPU)."""
    n = 2**29 if device == "cuda" else 2**26
    src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    us = events_us(lambda: dst.copy_(src), device, reps=20 if device == "cuda" else 5)
    return 2 * n * 4 / (us * 1e3)


def matmul_tflops(device: str, n: int = 8192) -> float:
    """Measured ceiling: a bf16 [n, n] @ [n, n] product on random data (never zeros: they run
    faster), median of 10 (n = 1024 in fp32 on a CPU)."""
    if device != "cuda":
        n = 1024
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    us = events_us(lambda: a @ b, device, reps=10 if device == "cuda" else 3)
    return 2 * n**3 / us / 1e6


def fp8_matmul_tflops(device: str, n: int = 8192) -> float | None:
    """Measured ceiling of FP8 (E4M3) products through ``torch._scaled_mm``; None where it does
    not run (a CPU, an older GPU)."""
    if device != "cuda":
        return None
    a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as asked
    one = torch.ones((), device=device)
    try:
        us = events_us(lambda: torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16), device)
    except RuntimeError:
        return None
    return 2 * n**3 / us / 1e6


def ceilings(device: str, fp8: bool = False) -> dict[str, Any]:
    """The copy and matmul rates measured now, beside the datasheet's (for reference only)."""
    out: dict[str, Any] = {"copy_gbs": copy_gbs(device), "matmul_tflops": matmul_tflops(device)}
    if fp8:
        out["fp8_matmul_tflops"] = fp8_matmul_tflops(device)
    if device == "cuda":
        out["datasheet"] = DATASHEET
    return out


# --------------------------------------------------------------------------- results


class Record:
    """A suite's JSON, saved after every row (a run cut short keeps what it measured): ``rows``
    (every measurement) and ``headline`` (the few rows BENCHMARKS.md's table shows, each with
    its same-run comparison)."""

    def __init__(self, suite: str, out_root: Path | None, device: str, options: dict[str, Any]):
        self.started = time.perf_counter()
        self.path = None if out_root is None else Path(out_root) / today() / f"{suite}.json"
        self.data: dict[str, Any] = {
            "suite": suite,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "command": command_line(),
            "env": environment(device),
            "options": options,
            "ceilings": {},
            "rows": [],
            "headline": [],
        }

    def __getitem__(self, key: str) -> Any:
        return self.data[key]

    def __setitem__(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.save()

    def row(self, **fields: Any) -> dict[str, Any]:
        self.data["rows"].append(fields)
        self.save()
        return fields

    def headline(
        self, what: str, value: float, unit: str, comparison: str, **extra: Any
    ) -> dict[str, Any]:
        """A row of BENCHMARKS.md's table: ``what`` measured, its number, and what it is
        compared with in the same run (a floor, a ceiling, another path)."""
        entry = {"what": what, "value": value, "unit": unit, "comparison": comparison, **extra}
        self.data["headline"].append(entry)
        self.save()
        return entry

    def save(self) -> None:
        self.data["wall_s"] = round(time.perf_counter() - self.started, 1)
        if self.path is None:  # a check, not a measurement: nothing written
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=1, default=str) + "\n")

    def summary(self) -> str:
        where = f" -> {self.path}" if self.path else ""
        lines = [f"{self.data['suite']} on {self.data['env']['device']}{where}"]
        for h in self.data["headline"]:
            lines.append(f"  {h['what']}: {fmt(h['value'])} {h['unit']} ({h['comparison']})")
        return "\n".join(lines)
