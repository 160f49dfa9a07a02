"""`engramrt bench throughput`: both modes run and report, and the decode byte count equals an
independent count from the config."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.cli import main
from engramrt.commands.bench_throughput import add_arguments, decode_bytes, local_engine


def latency_argv(batch: int, output_len: int) -> list[str]:
    """``bench throughput``'s latency mode on the GQA fixture, on the CPU."""
    model = ["--model", str(GQA_MODEL_DIR), "--device", "cpu"]
    lens = ["--input-len", "8", "--output-len", str(output_len)]
    return ["bench", "throughput", *model, "--batch-size", str(batch), *lens]


def test_throughput_mode(capsys: pytest.CaptureFixture) -> None:
    argv = [
        "bench",
        "throughput",
        "--model",
        str(GQA_MODEL_DIR),
        "--device",
        "cpu",
        "--num-prompts",
        "6",
        "--min-input-len",
        "4",
        "--max-input-len",
        "30",
        "--min-output-len",
        "2",
        "--max-output-len",
        "9",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "6 requests" in out and "Output token throughput (tok/s):" in out


def test_latency_mode_reports_bandwidth(capsys: pytest.CaptureFixture) -> None:
    argv = latency_argv(3, 5)
    assert main(argv) == 0
    out = capsys.readouterr().out
    for key in ("Decode tokens/s:", "Bytes per decode step (MB):", "Achieved bandwidth (GB/s):"):
        assert key in out
    assert "3 requests, 24 prompt + 15 generated tokens" in out


def test_profile_and_output_json(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """--profile runs the requests again under the profiler and prints a step's costliest
    operators (kernels on a GPU); --output-json saves what was printed, the profile too."""
    out = tmp_path / "r.json"
    argv = [
        *latency_argv(2, 3),
        "--profile",
        "--output-json",
        str(out),
    ]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "engine steps under torch.profiler" in text and "operator" in text
    saved = json.loads(out.read_text())
    assert saved["requests"] == 2 and saved["output_tokens"] == 6
    assert saved["profile"]["steps"] >= 3 and saved["profile"]["top"][0]["ms_a_step"] > 0


def test_decode_bytes_match_a_count_from_the_config() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(
        ["--model", str(GQA_MODEL_DIR), "--device", "cpu", "--num-gpu-blocks-override", "64"]
    )
    engine = local_engine(args, 64)
    c = engine.pipeline.runner.model.cfg
    d, e, hc = c.hidden_size, c.engram, c.hc_mult
    g = c.body  # the GQA family's own fields
    q, kv = g.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    mix = (2 + hc) * hc
    w = engine.pipeline.runner.model.dtype.itemsize  # the dtype it runs in (float32 on a CPU)
    weights = w * (
        2 * c.vocab_size * d
        + d
        + c.num_layers * (2 * d * q + 2 * d * kv + 2 * d + 3 * d * g.intermediate_size)
        + e.num_layers * ((hc + 1) * d * e.n_hash_cols * e.head_dim + 2 * hc * d)
    )
    fp32 = 4 * c.num_layers * 2 * (mix * hc * d + mix + 3)
    batch, context = 5, 40
    kv_bytes = batch * context * c.num_layers * 2 * kv * w
    rows = batch * e.num_layers * e.n_hash_cols * (e.head_dim + e.head_dim // 32)  # fp8 + e8m0
    assert decode_bytes(engine, batch, context) == weights + fp32 + kv_bytes + rows


def test_tensor_parallel_ranks_run_the_benchmark() -> None:
    """With -tp 2 the driver's engine runs the same requests over two ranks (spawned)."""
    import subprocess
    import sys

    argv = [
        *latency_argv(3, 5),
        "-tp",
        "2",
    ]
    run = subprocess.run(
        [sys.executable, "-m", "engramrt", *argv], capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stderr
    assert "PP 1 x TP 2): 3 requests, 24 prompt + 15 generated tokens" in run.stdout


def test_on_a_cpu_engines_compute_in_float32_unless_told() -> None:
    """The bundled config says bfloat16; an engine built on a CPU without --dtype computes in
    float32 (``checkpoint.default_dtype``), with --dtype in what it says."""
    from engramrt.config import load_json
    from engramrt.models import model_config

    assert model_config(load_json(GQA_MODEL_DIR)).torch_dtype == "bfloat16"
    for flags, want in (([], torch.float32), (["--dtype", "bfloat16"], torch.bfloat16)):
        p = argparse.ArgumentParser()
        add_arguments(p)
        args = p.parse_args(
            [
                "--model",
                str(GQA_MODEL_DIR),
                "--device",
                "cpu",
                "--num-gpu-blocks-override",
                "8",
                *flags,
            ]
        )
        assert local_engine(args, 64).pipeline.runner.model.dtype == want, flags
