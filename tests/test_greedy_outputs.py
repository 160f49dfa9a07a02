"""benchmarks/greedy_outputs.py compare: any token difference fails; logprob gaps only with
--atol; NaN always fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "greedy_outputs.py"


def _run(tmp_path: Path, a: dict, b: dict, *flags: str) -> subprocess.CompletedProcess:
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    cmd = [sys.executable, str(SCRIPT), "compare", str(pa), str(pb), *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def _outputs(tokens: list[list[str]], lps: list[list[float]]) -> dict:
    outs = [
        {"text": "".join(t), "tokens": t, "logprobs": lp} for t, lp in zip(tokens, lps, strict=True)
    ]
    return {"prompts": ["p"] * len(outs), "batched": outs, "alone": outs}


@pytest.mark.slow
def test_compare(tmp_path: Path) -> None:
    base = _outputs([["a", "b"], ["c"]], [[-1.0, -2.0], [-0.5]])
    assert _run(tmp_path, base, base).returncode == 0
    drift = _outputs([["a", "b"], ["c"]], [[-1.0, -2.01], [-0.5]])
    assert _run(tmp_path, base, drift).returncode == 0
    assert _run(tmp_path, base, drift, "--atol", "0.001").returncode == 1
    other = _outputs([["a", "x"], ["c"]], [[-1.0, -2.0], [-0.5]])
    res = _run(tmp_path, base, other)
    assert res.returncode == 1 and "DIFFER" in res.stdout
    nan = _outputs([["a", "b"], ["c"]], [[-1.0, float("nan")], [-0.5]])
    assert _run(tmp_path, base, nan).returncode == 1
