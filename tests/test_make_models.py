"""The measurement models' script: the tiny preset round-trips through the loader and runs; the
1B and 4B presets have the sizes their names promise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.make_models import preset_config
from engramrt.config import model_config
from engramrt.runner.batch import StepBatch
from engramrt.runner.stage import StageRunner


@pytest.mark.slow
def test_tiny_preset_loads_and_runs(tmp_path: Path) -> None:
    script = Path(__file__).parents[1] / "benchmarks" / "make_models.py"
    subprocess.run([sys.executable, str(script), "--preset", "tiny", "--out", str(tmp_path),
                    "--device", "cpu"], check=True)  # fmt: skip
    s = StageRunner.load(tmp_path, dtype="float32")
    logits = s.step(StepBatch([0, 40, 41, 42], [0], [4], [0]))
    assert logits.shape == (4, s.model.cfg.vocab_size) and bool(logits.isfinite().all())
    assert s.model.layers["0"].engram.embed.scale is not None  # fp8 tables


@pytest.mark.parametrize(("preset", "low", "high"), [("1b", 0.7e9, 1.3e9), ("4b", 3.3e9, 4.6e9)])
def test_preset_sizes(preset: str, low: float, high: float) -> None:
    c = model_config(preset_config(preset))
    d, e, hc = c.hidden_size, c.engram, c.hc_mult
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    dense = c.num_layers * (2 * d * q + 2 * d * kv + 3 * d * c.intermediate_size)
    dense += e.num_layers * (hc + 1) * d * e.n_hash_cols * e.head_dim + 2 * c.vocab_size * d
    assert low < dense < high
    table_gib = [rows * (e.head_dim + e.head_dim // 32) / 2**30 for rows in e.num_embeddings]
    assert e.num_layers == 2 and e.n_hash_cols == 24 and e.head_dim == 256
    assert all(1 < g < 8 for g in table_gib)  # "realistic tables of a few GB"
