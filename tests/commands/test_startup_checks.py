"""Hostile configs and flags are one-line errors naming the field or flag and its limit, exit 2,
before anything large is allocated (``engine.build.check``, ``commands.serve.check_serve``):
never a numpy traceback, minutes of building a model that cannot load, or a server that can
only answer 400."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engramrt.bundled import DEFAULT_MODEL_DIR, GQA_MODEL_DIR
from engramrt.cli import main
from tests.support.poisoned import edited_model, poison


def _model(tmp_path: Path, **text_config) -> str:
    """The bundled model with some of its config's fields replaced (weights linked, not copied)."""
    out = tmp_path / "m"
    out.mkdir()
    for f in Path(GQA_MODEL_DIR).iterdir():
        if f.is_file() and f.name != "config.json":
            (out / f.name).symlink_to(f)
    cfg = json.loads((Path(GQA_MODEL_DIR) / "config.json").read_text())
    cfg["text_config"].update(text_config)
    (out / "config.json").write_text(json.dumps(cfg))
    return str(out)


def _bigger_tokenizer(tmp_path: Path) -> str:
    """A tokenizer with 40 tokens more than the model's vocabulary (added tokens)."""
    out = Path(_model(tmp_path))
    tok = json.loads((Path(GQA_MODEL_DIR) / "tokenizer.json").read_text())
    size = json.loads((out / "config.json").read_text())["text_config"]["vocab_size"]
    tok["added_tokens"] += [
        {
            "id": size + i,
            "content": f"<extra_{i}>",
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i in range(40)
    ]
    (out / "tokenizer.json").unlink()
    (out / "tokenizer.json").write_text(json.dumps(tok))
    return str(out)


CASES = [
    (
        "positions",
        lambda t: [_model(t, max_position_embeddings=10**12)],
        ["max_position_embeddings", "--max-num-seqs", "GiB"],
    ),
    (
        "layers",
        lambda t: [_model(t, num_hidden_layers=100000)],
        ["num_hidden_layers", "100000", "stores 4 layers"],
    ),
    ("max_num_seqs", lambda t: ["--max-num-seqs", "1000000000"], ["--max-num-seqs", "GiB"]),
    ("port", lambda t: ["--port", "99999"], ["--port", "65535"]),
    ("step_timeout", lambda t: ["--step-timeout", "0"], ["--step-timeout", "> 0"]),
    ("blocks", lambda t: ["--num-gpu-blocks-override", "0"], ["--num-gpu-blocks-override"]),
    ("tokenizer", lambda t: [_bigger_tokenizer(t)], ["tokenizer", "vocab_size", "1064", "1024"]),
    (
        "generation-config-json",
        lambda t: ["--override-generation-config", "{max_new_tokens: 4}"],
        ["--override-generation-config is not JSON"],
    ),
    (
        "generation-config-key",
        lambda t: ["--override-generation-config", '{"max_new_tokens": 4, "do_sample": true}'],
        ["--override-generation-config", "unknown key 'do_sample'"],
    ),
    (
        "generation-config-value",
        lambda t: ["--override-generation-config", '{"top_p": 2}'],
        ["--override-generation-config", "top_p", "1"],
    ),
    (
        "dspark",
        lambda t: [
            str(GQA_MODEL_DIR),
            "--speculative-config",
            '{"method": "dspark", "num_speculative_tokens": 2}',
        ],
        ["dspark", "with DSpark stages"],
    ),
]


@pytest.mark.parametrize(("argv", "needles"), [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_configs_and_flags_are_one_line_errors(tmp_path, capsys, argv, needles) -> None:
    args = argv(tmp_path)
    if args and not args[0].startswith("-"):
        args = ["serve", *args, "--device", "cpu"]
    else:
        args = ["serve", str(GQA_MODEL_DIR), "--device", "cpu", *args]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, (needle, err)


REPO = Path(__file__).resolve().parents[2]


def _cli(*args: str) -> subprocess.CompletedProcess:
    """``engramrt ARGS`` as a user runs it: a fresh process of this checkout's code."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "engramrt", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=300,
    )


def _one_line_error(run: subprocess.CompletedProcess, *needles: str) -> None:
    assert run.returncode == 2, run.stderr
    err = run.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in err, (needle, err)


COMMANDS = {
    "generate": lambda m: ["generate", "--model", m, "--prompt", "hi", "--device", "cpu"],
    "check-pp": lambda m: ["check-pp", "--model", m, "--device", "cpu"],
    "serve": lambda m: ["serve", m, "--device", "cpu", "--port", "0"],
    "eval": lambda m: [
        "eval",
        "--model",
        m,
        str(Path(GQA_MODEL_DIR) / "tasks" / "arithmetic.jsonl"),
    ],
}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_garbage_tokenizer_is_one_line_naming_the_file(tmp_path, command) -> None:
    """The tokenizers library's bare ``Exception: Model missing`` was a traceback, exit 1."""
    model = Path(_model(tmp_path))
    (model / "tokenizer.json").unlink()
    (model / "tokenizer.json").write_text('{"version": "1.0"}')
    _one_line_error(
        _cli(*COMMANDS[command](str(model))), f"{model / 'tokenizer.json'}", "Model missing"
    )


@pytest.mark.parametrize(
    ("command", "model", "tp", "rule"),
    [
        ("serve", GQA_MODEL_DIR, "3", "num_attention_heads (4)"),
        ("generate", GQA_MODEL_DIR, "4", "the FFN's intermediate size"),
        ("serve", DEFAULT_MODEL_DIR, "3", "o_groups (2)"),
    ],
    ids=["gqa-heads", "gqa-ffn", "v41-groups"],
)
def test_a_tensor_parallel_size_the_model_cannot_split_is_refused_before_any_rank_starts(
    tmp_path, command, model, tp, rule
) -> None:
    """It was an error from every rank once they had started and loaded (12.7 s for -tp 3):
    now one line naming the rule, and no rank's output."""
    if "FFN" in rule:  # 4 query heads and 2 KV heads split 4 ways; 10 FFN features do not
        model = _model(tmp_path, intermediate_size=10)
    run = _cli(*COMMANDS[command](str(model)), "-tp", tp)
    _one_line_error(run, f"--tensor-parallel-size {tp} must divide", rule)


@pytest.mark.parametrize(
    ("fields", "needles", "command"),
    [
        ({"eos_token_id": 1024}, ["'eos_token_id' is 1024", "vocab_size"], "serve"),
        ({"eos_token_id": [1, -1]}, ["'eos_token_id' is -1"], "generate"),
        ({"bos_token_id": 5000}, ["'bos_token_id' is 5000"], "generate"),
        ({"torch_dtype": "bfloat61"}, ["'torch_dtype'", "'bfloat61'"], "serve"),
        ({"dtype": "half"}, ["'dtype'", "'half'"], "generate"),
    ],
    ids=["eos", "eos-list", "bos", "torch_dtype", "dtype"],
)
def test_config_values_the_model_cannot_use_are_one_line_errors(
    tmp_path, fields, needles, command
) -> None:
    """Each of these started the model without a word."""
    model = _model(tmp_path, **fields)
    if "dtype" in fields:  # newer transformers' spelling alone
        cfg = json.loads(Path(model, "config.json").read_text())
        del cfg["text_config"]["torch_dtype"]
        Path(model, "config.json").write_text(json.dumps(cfg))
    _one_line_error(_cli(*COMMANDS[command](model)), *needles)


def test_a_float8_storage_dtype_runs_in_bfloat16_with_a_warning(tmp_path) -> None:
    """A quantised checkpoint may declare its stored dtype: read as bfloat16, and said so."""
    model = _model(tmp_path, torch_dtype="float8_e4m3fn")
    run = _cli(*COMMANDS["generate"](model), "--max-tokens", "1")
    assert run.returncode == 0, run.stderr
    assert (
        "engramrt: warning: config field 'torch_dtype' is 'float8_e4m3fn', a storage dtype: "
        "using bfloat16" in run.stderr.splitlines()
    ), run.stderr


def test_help_says_what_the_flags_do(capsys) -> None:
    """``--speculative-config`` takes DSpark too; ``--stage-timeout`` watches the engine at
    any -pp; ``benchmarks/make_models.py --help`` describes every option."""
    for command in ("serve", "generate"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = " ".join(capsys.readouterr().out.split())
        assert '"method": "dspark"' in text or "DSpark" in text, command
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "with -pp > 1:" not in text and "no heartbeat" in text
    assert "4 times the longest step so far" in text  # a slow step is no hang (--step-timeout)
    run = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "make_models.py"), "--help"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert run.returncode == 0, run.stderr
    text = " ".join(run.stdout.split())
    for described in (
        "} the model: tiny, pp8",
        "--out OUT the model directory",
        "--device DEVICE where the random weights are drawn",
        "--max-shard-bytes MAX_SHARD_BYTES the largest safetensors shard",
    ):
        assert described in text, (described, run.stdout)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_a_nan_in_a_norm_weight_is_one_line_naming_the_tensor(tmp_path, command) -> None:
    """The model once loaded and served empty text with finish reason 'length'."""
    name = "layers.2.ffn_norm.weight"
    model = edited_model(tmp_path / "m", poison(name, 7))
    _one_line_error(_cli(*COMMANDS[command](str(model))), name, "non-finite", "index 7")
