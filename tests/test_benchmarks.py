"""Benchmarks cannot rot silently: every script in ``benchmarks/`` starts (``--help``: its
module-level imports and its parser) and every name it imports from engramrt, at any depth,
exists; the scripts with a CPU path make a tiny run; the shell scripts parse and name only
files that exist. A rename that breaks one fails here, on the CPU, in CI."""

from __future__ import annotations

import ast
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).parents[1] / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name != "__init__.py")
SHELL = sorted(BENCH.glob("*.sh"))

# (script, arguments): tiny runs of the scripts that have a CPU path
TINY_RUNS = [
    ("host_step.py", ["--requests", "4", "--contexts", "64", "--steps", "2"]),
    ("detok_bench.py", ["--lengths", "8"]),
    ("generate_bench.py", ["--max-tokens", "2"]),
    ("dspark_accept.py", ["--batch-sizes", "2", "--max-tokens", "3", "--per-kind", "1"]),
    (
        "spec_step_profile.py",
        [
            "--model",
            "engramrt/bundled/tiny_gqa",
            "--device",
            "cpu",
            "--batch-size",
            "1",
            "--input-len",
            "8",
            "--output-len",
            "3",
        ],
    ),
    (
        "engine_core.py",
        [
            "--model",
            "engramrt/bundled/tiny_gqa",
            "--device",
            "cpu",
            "--batch-sizes",
            "2",
            "--input-len",
            "8",
            "--output-len",
            "3",
            "--rounds",
            "1",
            "--out",
            "/dev/null",
        ],
    ),
    ("train_step.py", ["--device", "cpu", "--batch", "2", "--length", "32", "--steps", "1"]),
    ("step_kernels.py", ["--device", "cpu", "--prompt", "20"]),
]

# one interpreter runs every script in turn (torch is imported once), as ``__main__``
RUNNER = """
import json, runpy, sys, traceback
results = {}
for path, args in json.loads(sys.argv[1]):
    sys.argv = [path, *args]
    try:
        runpy.run_path(path, run_name="__main__")
        results[path] = None
    except SystemExit as exc:
        results[path] = None if exc.code in (0, None) else f"exit {exc.code}"
    except BaseException:
        results[path] = traceback.format_exc()
print("RESULTS " + json.dumps(results))
"""


def run_scripts(calls: list[tuple[str, list[str]]]) -> dict[str, str | None]:
    out = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(calls)],
        capture_output=True,
        text=True,
        cwd=BENCH.parent,
        timeout=600,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )
    line = next((x for x in out.stdout.splitlines() if x.startswith("RESULTS ")), None)
    assert line is not None, out.stderr[-3000:]
    return json.loads(line.removeprefix("RESULTS "))


def engramrt_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every ``from engramrt... import name`` in the file, at any depth, but
    those in an ``except ImportError`` handler (a fallback for older trees a benchmark can
    measure)."""
    tree = ast.parse(path.read_text())
    fallback = {
        id(n)
        for h in ast.walk(tree)
        if isinstance(h, ast.ExceptHandler) and getattr(h.type, "id", None) == "ImportError"
        for n in ast.walk(h)
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("engramrt"):
            if id(node) not in fallback:
                found += [(node.module, a.name) for a in node.names]
    return found


def test_every_script_starts() -> None:
    results = run_scripts([(str(p), ["--help"]) for p in SCRIPTS])
    assert {k: v for k, v in results.items() if v is not None} == {}
    assert len(results) == len(SCRIPTS) > 15


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_imported_name_exists(script: Path) -> None:
    missing = []
    for module, name in engramrt_imports(script):
        mod = importlib.import_module(module)
        if not hasattr(mod, name):
            try:
                importlib.import_module(f"{module}.{name}")
            except ModuleNotFoundError:
                missing.append(f"{module}.{name}")
    assert missing == []


def test_the_import_check_sees_a_rename(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from engramrt.commands.bench_throughput import _engine\n")
    assert engramrt_imports(bad) == [("engramrt.commands.bench_throughput", "_engine")]
    assert not hasattr(importlib.import_module("engramrt.commands.bench_throughput"), "_engine")


def test_scripts_with_a_cpu_path_make_a_tiny_run() -> None:
    results = run_scripts([(str(BENCH / s), args) for s, args in TINY_RUNS])
    assert {k: v for k, v in results.items() if v is not None} == {}


def test_serve_summary_reads_a_result_file(tmp_path: Path) -> None:
    res = {
        "output_throughput": 10.0,
        "itls": [[0.005, 0.02]],
        "median_ttft_ms": 1,
        "p99_ttft_ms": 2,
        "median_tpot_ms": 3,
        "p99_tpot_ms": 4,
    }
    (tmp_path / "r.json").write_text(json.dumps(res))
    cmd = [sys.executable, str(BENCH / "serve_summary.py"), str(tmp_path / "r.json")]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    row = json.loads(out)
    assert row["output_tok_s"] == 10.0 and row["time_in_gaps_over_10ms"] == 0.8


@pytest.mark.parametrize("script", SHELL, ids=lambda p: p.name)
def test_shell_scripts_parse_and_name_existing_files(script: Path) -> None:
    subprocess.run(["bash", "-n", str(script)], check=True)
    named = set(re.findall(r"benchmarks/([\w.-]+\.(?:py|sh))", script.read_text()))
    assert {n for n in named if not (BENCH / n).exists()} == set()
