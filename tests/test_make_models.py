"""The measurement models' script: the tiny preset round-trips through the loader and runs; the
1B and 4B presets have the sizes their names promise, the big-table one tables beyond a GPU; the
tables are streamed to a file the safetensors reader reads, chunk by chunk."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.make_models import preset_config
from engramrt.models import model_config
from engramrt.runner.batch import StepBatch
from engramrt.runner.stage import StageRunner


@pytest.mark.slow
def test_tiny_preset_loads_and_runs(tmp_path: Path) -> None:
    script = Path(__file__).parents[1] / "benchmarks" / "make_models.py"
    subprocess.run(
        [
            sys.executable,
            str(script),
            "--preset",
            "tiny",
            "--out",
            str(tmp_path),
            "--device",
            "cpu",
        ],
        check=True,
    )
    s = StageRunner.load(tmp_path, dtype="float32")
    logits = s.compute(StepBatch([0, 40, 41, 42], [0], [4], [0]))
    assert logits.shape == (4, s.model.cfg.vocab_size) and bool(logits.isfinite().all())
    assert s.model.layers["0"].engram.embed.scale is not None  # fp8 tables


@pytest.mark.parametrize(("preset", "low", "high"), [("1b", 0.7e9, 1.3e9), ("4b", 3.3e9, 4.6e9)])
def test_preset_sizes(preset: str, low: float, high: float) -> None:
    c = model_config(preset_config(preset))
    d, e, hc = c.hidden_size, c.engram, c.hc_mult
    g = c.body  # the GQA family's own fields
    q, kv = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    dense = c.num_layers * (2 * d * q + 2 * d * kv + 3 * d * g.intermediate_size)
    dense += e.num_layers * (hc + 1) * d * e.n_hash_cols * e.head_dim + 2 * c.vocab_size * d
    assert low < dense < high
    table_gib = [rows * (e.head_dim + e.head_dim // 32) / 2**30 for rows in e.num_embeddings]
    assert e.num_layers == 2 and e.n_hash_cols == 24 and e.head_dim == 256
    assert all(1 < g < 8 for g in table_gib)  # "realistic tables of a few GB"


def test_big_table_preset_holds_more_than_a_gpu() -> None:
    e = model_config(preset_config("4b-bigtables")).engram
    gib = sum(rows * (e.head_dim + e.head_dim // 32) for rows in e.num_embeddings) / 2**30
    assert 55 < gib < 100


def test_tables_are_streamed_in_chunks(tmp_path: Path, monkeypatch) -> None:
    """Written a few rows at a time (chunks that do not divide the rows): the standard reader
    finds every table with its shape and dtype, fp8 bytes of magnitude ~1 (exponent 6..8),
    scales of 2**0, and the chunks are not copies of each other."""
    import torch
    from safetensors import safe_open

    from benchmarks import make_models

    monkeypatch.setattr(make_models, "CHUNK_ROWS", 37)
    raw = preset_config("tiny")
    f = tmp_path / "t.safetensors"
    shapes = make_models.write_tables(raw, f, "cpu")
    e = model_config(raw).engram
    assert len(shapes) == 2 * e.num_layers
    with safe_open(f, framework="pt") as st:
        assert sorted(st.keys()) == sorted(shapes)
        for name, shape in shapes.items():
            t = st.get_tensor(name)
            assert list(t.shape) == shape
            b = t.view(torch.uint8).int()
            if name.endswith("scale"):
                assert t.dtype == torch.float8_e8m0fnu and bool((b == 127).all())
            else:
                assert t.dtype == torch.float8_e4m3fn
                exp = (b >> 3) & 15
                assert bool(((exp >= 6) & (exp <= 8)).all())
                assert not torch.equal(b[:37], b[37:74])
