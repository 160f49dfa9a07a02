"""The stored-format kernel compiled for Hopper (sm_90) on a machine without a GPU: each of its
modes through Triton's whole pipeline to a cubin, on wgmma, with nothing in local memory. The
interpreter runs the kernels' arithmetic but neither Triton's typing nor its lowering: the
values mode (V4.1's ``wo_a``) once passed every interpreter test and did not compile."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.triton
triton = pytest.importorskip("triton")

HELPER = Path(__file__).parents[1] / "support" / "hopper_compile.py"
MODES = {  # the launches a V4.1 decode step makes, at v41-wide's shapes
    "FP8 codes (wq_b)": {"fp4": False, "n": 32768, "k": 1280},
    "FP8 values, 8 feature groups (wo_a)": {"fp4": False, "n": 8192, "k": 4096, "values": True,
                                            "groups": 8},
    "FP4 grouped, rows gathered (experts.w13)": {"fp4": True, "n": 4608, "k": 5120,
                                                 "grouped": True},
    "FP4 grouped, the combine added (experts.w2)": {"fp4": True, "n": 5120, "k": 2304,
                                                    "grouped": True, "add": True, "bm": 64},
}  # fmt: skip


def test_every_mode_compiles_for_hopper_on_wgmma_without_local_memory() -> None:
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not ptxas.exists():
        pytest.skip("this Triton ships no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[2]), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, str(HELPER), *map(json.dumps, MODES.values())],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    reports = [json.loads(line) for line in run.stdout.splitlines()]
    assert len(reports) == len(MODES)
    for name, report in zip(MODES, reports, strict=True):
        assert report["wgmma"] > 0, (name, report)
        assert report["local"] == 0, (name, report)  # no spills
        assert report["registers"] <= 255, (name, report)
