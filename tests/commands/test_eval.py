"""``engramrt eval``: task files, exact-match and loglikelihood scoring against a stub server
whose answers are known, the A/B table, and arms that start real servers (the Engram-off
ablation runs no Engram layer)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
import uvicorn
from fastapi import FastAPI

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.cli import build_parser
from engramrt.commands import evaluate
from engramrt.commands.generate import GenerateOptions, generate
from engramrt.engine.build import build_stage
from engramrt.prompts import PromptEncoder
from engramrt.runner.batch import StepBatch
from engramrt.runner.stage import StageRunner
from tests.support.server_fixture import free_port


def _stub_app() -> FastAPI:
    """Exact match: "yes" for prompts holding "?y", else "no". Echo: one token per character,
    logprob -1 each, except the characters of "best", -0.1 each."""
    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: dict) -> dict:
        prompt = body["prompt"]
        if not body.get("echo"):
            return {"choices": [{"text": " yes" if "?y" in prompt else "no"}]}
        best = prompt.endswith("best")
        lps = [-0.1 if best and i >= len(prompt) - 4 else -1.0 for i in range(len(prompt))]
        lps[0] = None  # the first token has no logprob
        logprobs = {
            "tokens": list(prompt),
            "token_logprobs": lps,
            "text_offset": list(range(len(prompt))),
        }
        return {"choices": [{"text": prompt, "logprobs": logprobs}]}

    return app


@pytest.fixture(scope="module")
def stub() -> str:
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(_stub_app(), port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def _write(path, rows) -> str:
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


def test_scores_against_known_answers(stub, tmp_path, capsys) -> None:
    rows = [
        {"prompt": "a?y", "answer": "yes"},  # right (stripped)
        {"prompt": "b?n", "answer": "no"},  # right
        {"prompt": "c?y", "answer": "no"},  # wrong
        {"prompt": "Q: ", "choices": ["bad", "best", "worse"], "answer": 1},  # right: -0.4
        {"prompt": "Q: ", "choices": ["best", "ok"], "answer": "ok"},  # wrong: best wins
    ]
    args = build_parser().parse_args(
        [
            "eval",
            _write(tmp_path / "t.jsonl", rows),
            "--base-url",
            stub,
            "--json",
            "--concurrency",
            "2",
        ]
    )
    assert args.func(args) == 0
    (arm,) = json.loads(capsys.readouterr().out)
    assert [r["correct"] for r in arm["results"]] == [True, True, False, True, False]
    assert arm["accuracy"] == pytest.approx(3 / 5)
    assert [r["picked"] for r in arm["results"]][3:] == ["best", "best"]
    assert arm["arm"] == f"remote {stub}"  # not "engram on": what it serves is not known here


def test_a_dead_base_url_is_one_line_naming_it(tmp_path, capsys) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    args = build_parser().parse_args(
        ["eval", _write(tmp_path / "t.jsonl", [{"prompt": "a", "answer": "b"}]), "--base-url", url]
    )
    assert args.func(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and url in err and "cannot reach" in err, err


def test_children_start_whatever_folder_they_start_from(tmp_path) -> None:
    """A folder holding a directory named ``engramrt`` (the parent of a clone) cannot shadow
    the installed package in a child ``engramrt`` process; a plain ``python -m`` there would."""
    import subprocess
    import sys

    from engramrt.commands.child import engramrt_command

    (tmp_path / "engramrt").mkdir()
    plain = subprocess.run(
        [sys.executable, "-m", "engramrt", "--version"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert plain.returncode != 0  # the shadowing this guards against is real
    ours = subprocess.run(
        engramrt_command("--version"), cwd=tmp_path, capture_output=True, text=True
    )
    assert ours.returncode == 0, ours.stderr


def test_a_token_across_the_prompt_boundary_belongs_to_the_choice() -> None:
    """ "Capital: " + "Paris" tokenises as "Capital", ":", " Paris": the last token starts in
    the prompt's trailing space but holds the choice, so it is scored."""
    text = "Capital: Paris"
    lps = {"token_logprobs": [None, -2.0, -0.5], "text_offset": [0, 7, 8]}
    assert evaluate.choice_loglikelihood("Capital: ", lps, text) == -0.5
    assert evaluate.choice_loglikelihood("Capital:", lps, text) == -0.5
    assert evaluate.choice_loglikelihood("Capital", lps, text) == -2.5


def test_bad_task_files_name_the_line(tmp_path) -> None:
    with pytest.raises(ValueError, match=":2:"):
        evaluate.load_tasks(
            _write(tmp_path / "a.jsonl", [{"prompt": "x", "answer": "y"}, {"prompt": "x"}])
        )
    with pytest.raises(ValueError, match="not one of the choices"):
        evaluate.load_tasks(
            _write(tmp_path / "b.jsonl", [{"prompt": "x", "choices": ["a"], "answer": "b"}])
        )


def test_table_compares_arms_item_by_item() -> None:
    def arm(name, picks, right):
        results = [{"picked": p, "correct": c} for p, c in zip(picks, right, strict=True)]
        return {
            "arm": name,
            "items": 3,
            "correct": sum(right),
            "accuracy": sum(right) / 3,
            "results": results,
        }

    text = evaluate.table([arm("on", "abc", [1, 1, 0]), arm("off", "abd", [1, 0, 0])])
    assert "| on | 66.7% | 2/3 | +0.0% | 3/3 |" in text
    assert "| off | 33.3% | 1/3 | -33.3% | 2/3 |" in text


def test_engram_off_runs_no_engram_layer() -> None:
    """The ablation: no Engram layer runs (the counter stays empty) and the output changes."""
    on = StageRunner.load(GQA_MODEL_DIR, 1, 64, "cpu", "float32")
    off = StageRunner.load(GQA_MODEL_DIR, 1, 64, "cpu", "float32")
    off.model.disable_engram()
    a, b = (r.compute(StepBatch([5, 6, 7, 8], [0], [4], [0], new_blocks=[[0]])) for r in (on, off))
    assert set(on.engram_ran) == set(on.model.engram_layer_ids) and not off.engram_ran
    assert not torch.equal(a, b)


def test_an_arms_assignments_become_its_servers_environment(stub, tmp_path, monkeypatch) -> None:
    started = []

    class Recorder:
        def __init__(self, model, flags, env=None):
            started.append((flags, env))
            self.url = stub

        def close(self) -> None:
            pass

    monkeypatch.setattr(evaluate, "LocalServer", Recorder)
    tasks = _write(tmp_path / "t.jsonl", [{"prompt": "q?y", "answer": "yes"}])
    args = build_parser().parse_args(
        [
            "eval",
            tasks,
            "--ab",
            "plain=-pp 2",
            "skip=ENGRAMRT_CHECK_PP_FAULT=skip-entry-engram -pp 2",
        ]
    )
    assert args.func(args) == 0
    assert started == [
        (["-pp", "2"], {}),
        (["-pp", "2"], {"ENGRAMRT_CHECK_PP_FAULT": "skip-entry-engram"}),
    ]


def test_the_stage_entry_fault_reaches_served_stages(monkeypatch, capsys) -> None:
    """With the fault asked for, a later stage that starts on an Engram layer computes as if
    that Engram were skipped, while its counter says it ran (the bug, made on purpose), and
    says so on stderr; the first stage and an unasked-for run are untouched."""
    from engramrt.parallel.faults import FAULT_ENV, inject_stage_faults

    model = GQA_MODEL_DIR

    def stage(layers: list[int]) -> StageRunner:  # the default model's layer 1 is an Engram's
        return StageRunner.load(model, 1, 64, "cpu", "float32", layers)

    plain, faulty, skipped = stage([1]), stage([1]), stage([1])
    skipped.model.disable_engram()  # the oracle: this stage with its Engram skipped openly
    assert not inject_stage_faults(faulty, 1)  # not asked for
    monkeypatch.setenv(FAULT_ENV, "skip-entry-engram")
    assert not inject_stage_faults(plain, 0) and inject_stage_faults(faulty, 1)
    assert "FAULT INJECTED" in capsys.readouterr().err
    batch = StepBatch([5, 6, 7, 8], [0], [4], [0], new_blocks=[[0]])
    carry = stage([0]).compute(batch)
    out = {
        name: r.compute(batch, carry).x
        for name, r in (("plain", plain), ("faulty", faulty), ("skipped", skipped))
    }
    assert torch.equal(out["faulty"], out["skipped"])
    assert not torch.equal(out["faulty"], out["plain"])
    assert faulty.engram_ran[1] == 1 and not skipped.engram_ran


@pytest.mark.slow
def test_ab_arms_start_their_servers(tmp_path, capsys) -> None:
    """Answers taken from the bundled model's own greedy completions (``generate``, not the
    server) for half the items and wrong for the rest: the Engram-on arm scores exactly half;
    the table has the off arm beside it."""
    model = GQA_MODEL_DIR
    opts = GenerateOptions(model, [4], max_model_len=128, dtype="float32")
    engine = build_stage(opts)[1]
    prompts = PromptEncoder.load(model, engine.tokenizer)
    rows = []
    for i, text in enumerate(["The quick brown fox", "Hello there", "In a garden", "Rivers"]):
        out = generate(engine, prompts, text, max_tokens=6).text
        rows.append({"prompt": text, "answer": out if i % 2 == 0 else out + " x", "stop": []})
    tasks = _write(tmp_path / "t.jsonl", rows)
    args = build_parser().parse_args(
        [
            "eval",
            tasks,
            "--model",
            str(model),
            "--max-tokens",
            "6",
            "--json",
            "--ab",
            "on=--device cpu --dtype float32",
            "off=--device cpu --dtype float32 --engram off",
        ]
    )
    assert args.func(args) == 0
    on, off = json.loads(capsys.readouterr().out)
    assert on["accuracy"] == 0.5 and [r["correct"] for r in on["results"]] == [1, 0, 1, 0]
    assert off["arm"] == "off" and off["items"] == 4
