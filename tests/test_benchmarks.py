"""Benchmarks cannot rot silently: every script in ``benchmarks/`` starts (``--help``: its
module-level imports and its parser) and every name it imports from engramrt, at any depth,
exists; the kernel harness checks every kernel against its torch path on tiny shapes (Triton's
interpreter on a CPU); the suites make tiny runs on the bundled models through the runner and
write their JSON; the table generator writes the rows it read, and BENCHMARKS.md's table is the
one the committed results give. No number is asserted."""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).parents[1] / "benchmarks"
SCRIPTS = sorted(p for p in BENCH.glob("*.py") if p.name != "__init__.py")
ENV = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TRITON_INTERPRET": "1"}

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
        env=ENV,
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
    assert len(results) == len(SCRIPTS) >= 8


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


def test_engramrt_internals_are_imported_in_one_module() -> None:
    """The package's module paths move: the benchmarks take its internals from
    ``benchmarks/cases.py`` alone (``make_models.py`` writes checkpoints through them too)."""
    importers = {p.name for p in SCRIPTS if engramrt_imports(p)}
    assert importers <= {"cases.py", "make_models.py"}


@pytest.mark.triton
def test_the_kernel_harness_checks_every_case_on_tiny_shapes() -> None:
    """Each kernel against its torch path: every case, every tiny shape, agreeing (``--check``
    times nothing and writes no file); natively where there is a GPU (as every ``triton``
    test), else in Triton's interpreter."""
    from benchmarks.cases import KERNEL_CASES

    cuda = torch.cuda.is_available()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.kernels",
            "--check",
            "--device",
            "cuda" if cuda else "cpu",
        ],
        capture_output=True,
        text=True,
        cwd=BENCH.parent,
        timeout=600,
        env=os.environ if cuda else ENV,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    lines = [x.split() for x in out.stdout.splitlines()]
    checked = [x[0] for x in lines if x and x[0] in {c.name for c in KERNEL_CASES}]
    assert checked == [c.name for c in KERNEL_CASES for _ in c.tiny]
    assert "DISAGREES" not in out.stdout and "FAILED" not in out.stdout


def test_disagreement_sees_a_flipped_bit_and_a_drift() -> None:
    from benchmarks.kernels import disagreement

    x = torch.randn(4, 8)
    assert disagreement((x, x.long()), (x.clone(), x.long()), exact=True) == 0.0
    flipped = x.clone()
    flipped.view(torch.int32)[1, 2] ^= 1
    assert disagreement(flipped, x, exact=True) == float("inf")
    assert 0 < disagreement(flipped, x, exact=False) < 1e-6
    assert disagreement(x * 1.01, x, exact=False) == pytest.approx(0.01, rel=1e-4)
    inf = x.clone()
    inf[0, 0] = float("-inf")
    assert disagreement(x, inf, exact=False) == float("inf")  # -inf only in the reference
    assert disagreement(torch.zeros(3), torch.zeros(4), exact=False) == float("inf")


@pytest.mark.slow
def test_the_suites_make_a_tiny_run(tmp_path: Path) -> None:
    """The runner on a CPU, the bundled models at tiny sizes, every suite in ``all`` (the
    serving suite starts a server): each writes its JSON with the run's record and rows."""
    suites = ["kernels", "gqa-decode", "v41-prefill", "dspark", "serving"]
    cmd = [sys.executable, "-m", "benchmarks.run", "--suite", ",".join(suites)]
    cmd += ["--device", "cpu", "--tiny", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=BENCH.parent, env=ENV)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    files = {p.stem: json.loads(p.read_text()) for p in tmp_path.glob("*/*.json")}
    assert set(files) == set(suites)
    for name, data in files.items():
        assert data["suite"] == name and data["ok"] and data["rows"]
        assert data["env"]["torch"] and data["env"]["device"].startswith("CPU")
        assert "benchmarks.run" in data["command"] and data["date"]
        assert data["options"]["tiny"]
        assert name == "kernels" or data["headline"]
    assert {r["kind"] for r in files["serving"]["rows"]} == {"offline", "latency", "serve"}
    # a CPU step is batch-invariant: under the flag every output equals its request alone
    (inv,) = [r for r in files["dspark"]["rows"] if r.get("batch_invariant")]
    assert inv["plain_equal_alone"] == inv["dspark_equal_alone"] == inv["prompts"] > 0


def test_the_decode_floor_counts_what_a_batch_reads() -> None:
    """V4.1's floor: ``bench throughput``'s bytes, less the experts a batch cannot reach (an
    independent count: each layer's experts from index ``batch x top-k`` on) and the embedding
    rows no token reads."""
    from benchmarks import cases
    from engramrt.commands.bench_throughput import decode_bytes

    engine = cases.engine(
        cases.engine_args(cases.BUNDLED_MODEL, "cpu", "--num-gpu-blocks-override", "64"), 64
    )
    cfg = cases.model_of(engine).cfg
    state = cases.model_of(engine).state_dict()
    embed = state["embed.weight"]
    for batch in (1, 3, 64):
        reached = min(cfg.body.n_routed_experts, batch * cfg.body.n_activated_experts)
        unreached = sum(
            t.numel() * t.element_size()
            for n, t in state.items()
            if ".ffn.experts." in n and int(n.split(".ffn.experts.")[1].split(".")[0]) >= reached
        )
        unread = (embed.shape[0] - batch) * embed[0].numel() * embed.element_size()
        want = decode_bytes(engine, batch, 40) - unreached - unread
        assert cases.decode_floor_bytes(engine, batch, 40) == want


def test_inter_token_gaps_are_summarised() -> None:
    from benchmarks.suites import _itl_summary

    got = _itl_summary({"itls": [[0.005, 0.02], [0.001]]})
    assert got["time_in_gaps_over_10ms"] == pytest.approx(20 / 26)
    assert got["itl_p10_p50_p90_p99_ms"][1] == pytest.approx(5.0)


def test_the_runner_names_its_suites() -> None:
    from benchmarks import run
    from benchmarks.suites import SUITES

    assert run.parse_suites("all") == [n for n, s in SUITES.items() if s.in_all]
    assert run.parse_suites("dspark,kernels") == ["dspark", "kernels"]
    with pytest.raises(SystemExit, match="unknown suite"):
        run.parse_suites("kernels,nope")


def _result(suite: str, date: str, heads: list[dict], **extra) -> dict:
    return {
        "suite": suite,
        "date": f"{date}T10:00:00+00:00",
        "command": f"python -m benchmarks.run --suite {suite}",
        "env": {"device": "NVIDIA H200"},
        "rows": [],
        "headline": heads,
        **extra,
    }


def test_the_table_writes_the_rows_it_read(tmp_path: Path) -> None:
    """The newest result of each suite (dated folders before ``seed/``; tiny runs never),
    rendered between the markers and parsed back; the rest of the document untouched; a
    second run changes nothing; ``--check`` sees a stale table."""
    from benchmarks import table

    res = tmp_path / "results"
    files = {
        "2026-12-05/kernels.json": _result(
            "kernels",
            "2026-12-05",
            [
                {"what": "`k`, a | b", "value": 36.21, "unit": "us", "comparison": "3.7x floor"},
                {"what": "x", "value": 1.584, "unit": "x", "comparison": "vs plain"},
            ],
        ),
        "seed/kernels.json": _result("kernels", "2026-12-01", [{"what": "old"}]),
        "seed/dspark.json": _result(
            "dspark",
            "2026-12-02",
            [
                {
                    "what": "seeded",
                    "value": 2675,
                    "unit": "tok/s",
                    "comparison": "c",
                    "date": "2026-11-30",
                    "command": "bench throughput",
                    "source": "benchmarks/HISTORY.md, 'a section'",
                }
            ],
        ),
        "2026-12-06/dspark.json": _result(
            "dspark", "2026-12-06", [{"what": "tiny"}], options={"tiny": True}
        ),
    }
    for name, data in files.items():
        (res / name).parent.mkdir(parents=True, exist_ok=True)
        (res / name).write_text(json.dumps(data))
    doc = tmp_path / "B.md"
    before, after = "# B\n\nintro\n\n", "\n\nafter the table\n"
    doc.write_text(f"{before}{table.BEGIN}\nstale\n{table.END}{after}")
    assert table.main(["--results", str(res), "--doc", str(doc), "--check"]) == 1
    assert table.main(["--results", str(res), "--doc", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith(before + table.BEGIN) and text.endswith(table.END + after)
    got = table.parse(text)
    assert [r["What"] for r in got] == ["`k`, a | b", "x", "seeded"]
    assert [r["Number"] for r in got] == ["36.2 us", "1.58x", "2,675 tok/s"]
    assert got[0]["Date"] == "2026-12-05" and got[0]["Device"] == "NVIDIA H200"
    assert got[0]["Command"] == "`python -m benchmarks.run --suite kernels`"
    assert got[0]["Source"].endswith("results/2026-12-05/kernels.json")
    assert (
        got[2]["Date"] == "2026-11-30" and got[2]["Source"] == "benchmarks/HISTORY.md, 'a section'"
    )
    assert got == table.rows(res)
    assert table.main(["--results", str(res), "--doc", str(doc), "--check"]) == 0
    table.main(["--results", str(res), "--doc", str(doc)])
    assert doc.read_text() == text


def test_benchmarks_md_holds_the_table_of_the_committed_results() -> None:
    from benchmarks import table

    assert table.main(["--check"]) == 0, "run python -m benchmarks.table"


@pytest.mark.triton
def test_the_step_census_counts_every_layer_of_a_decode_step() -> None:
    """``step_kernels.py``'s CPU mode on the bundled model (the CUDA code path in Triton's
    interpreter, one decode step at bs 1): its three tallies agree, every launch has a part
    and a call site in engramrt, every layer has attention, mHC and MoE launches, the Engram
    ones only its Engram layers, and the step's own parts are there."""
    from benchmarks import cases
    from benchmarks.step_kernels import census

    device = "cuda" if torch.cuda.is_available() else "cpu"
    c = census(cases.BUNDLED_MODEL, device, [1], prompt=24)[1]
    cfg = json.loads((Path(cases.BUNDLED_MODEL) / "config.json").read_text())["text_config"]
    layers = range(cfg["num_hidden_layers"])
    assert c.total == sum(c.sites.values()) == sum(c.ops.values()) > 10 * len(layers)
    if device == "cpu":  # an op a launch; and Triton's launcher is Triton's again
        from triton.runtime import interpreter

        assert len(c.recorded) == c.total
        assert interpreter.InterpretedFunction.run.__qualname__ == "InterpretedFunction.run"
    by_layer = Counter()
    for (layer, _), n in c.parts.items():
        by_layer[layer] += n
    assert set(by_layer) == {*layers, None} and sum(by_layer.values()) == c.total
    for layer in layers:
        mine = {p.split(".")[0] for (la, p) in c.parts if la == layer}
        want = {"attn", "mhc", "moe"} | ({"engram"} if layer in cfg["engram_layer_ids"] else set())
        assert mine - {"norm"} == want, layer
    assert {"tokens", "hash", "embed", "head.proj", "sampler"} <= {
        p for la, p in c.parts if la is None
    }
    assert not any(p in ("other", "unattributed") for _, p in c.parts)
    assert c.ops["triton:_sparse_attention_kernel"] == len(layers)
    # a decode step's window latents reach the ring in their rope launch (no copy of their own)
    assert [c.parts[layer, "attn.kv"] for layer in layers] == [1] * len(layers)
    assert all(site.split(" <- ")[0].rsplit(":", 1)[1].isdigit() for site, _ in c.sites)
