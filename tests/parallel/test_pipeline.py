"""Pipeline parallelism: partition rules, every partition bitwise equal to PP = 1, the engram
trace, torchrun, and failure behaviour."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.cli import main
from engramrt.commands.check_pp import (
    RAISE_ENV,
    CheckOptions,
    _flip_gap,
    check_pp,
    choose_partitions,
    format_report,
)
from engramrt.parallel.faults import FAULT_ENV
from engramrt.parallel.launch import DistConfig, free_port, launch
from engramrt.parallel.partition import (
    ENV,
    PartitionError,
    all_partitions,
    default_partition,
    resolve_partition,
)
from engramrt.runner.batch import StepBatch
from engramrt.runner.carry import Carry
from engramrt.runner.stage import StageRunner, new_kv_cache
from tests.support.model_factory import make_model, save_model

PROMPTS = ["The Engram hashes every token of this prompt, twice over.", "Hi there", "x"]


def _cli(*args: str, env: dict | None = None, timeout: float = 180) -> subprocess.CompletedProcess:
    """``engramrt COMMAND`` on the GQA fixture (the partitions below are its four layers')."""
    return subprocess.run(
        [sys.executable, "-m", "engramrt", args[0], "--model", str(GQA_MODEL_DIR), *args[1:]],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


# --- partitions ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("layers", "pp", "want"),
    [
        (3, 2, [2, 1]),
        (4, 3, [1, 2, 1]),
        (5, 3, [2, 2, 1]),
        (22, 4, [5, 6, 6, 5]),
        (61, 4, [15, 15, 16, 15]),
        (40, 2, [20, 20]),
        (40, 3, [13, 14, 13]),
        (6, 1, [6]),
    ],
)
def test_default_split_matches_vllm(layers: int, pp: int, want: list[int]) -> None:
    """vLLM's get_pp_indices: remainder to the stages before the last, from the back."""
    assert default_partition(layers, pp) == want == resolve_partition(layers, pp)


@pytest.mark.parametrize(
    ("text", "pp", "rule"),
    [
        ("3,3,3", 2, "one entry per stage"),
        ("3,4", 2, "must sum to num_hidden_layers"),
        ("0,6", 2, "empty stage"),
        ("-1,7", 2, "empty stage"),
        ("3,a", 2, "comma-separated integers"),
        ("3,3,", 2, "comma-separated integers"),
        ("6", 0, "pipeline_parallel_size must be >= 1"),
    ],
)
def test_invalid_partitions_name_the_rule(text: str, pp: int, rule: str) -> None:
    with pytest.raises(PartitionError, match=rule):
        resolve_partition(6, pp, text)


def test_partition_from_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV, "1,5")
    assert resolve_partition(6, 2) == [1, 5]
    assert resolve_partition(6, 2, "4,2") == [4, 2]  # the flag wins
    assert resolve_partition(6, 1) == [6]  # one stage: the pipeline's partition does not apply
    monkeypatch.setenv(ENV, "2,2")
    with pytest.raises(PartitionError, match=r"\[2, 2\] sums to 4 .* 6 layers"):
        resolve_partition(6, 2)
    monkeypatch.delenv(ENV)
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,4")  # vLLM's name works too
    assert resolve_partition(6, 2) == [2, 4]
    monkeypatch.setenv("VLLM_PP_LAYER_PARTITION", "2,x")  # and is validated
    with pytest.raises(PartitionError, match="comma-separated integers"):
        resolve_partition(6, 2)
    monkeypatch.setenv(ENV, "3,3")  # engramrt's own name wins
    assert resolve_partition(6, 2) == [3, 3]


def test_more_stages_than_layers_names_the_rule() -> None:
    with pytest.raises(PartitionError, match="pipeline_parallel_size 8 exceeds the model's 7"):
        resolve_partition(7, 8)


def test_cli_rejects_bad_partition(capsys: pytest.CaptureFixture) -> None:
    code = main(
        [
            "generate",
            "--model",
            str(GQA_MODEL_DIR),
            "--prompt",
            "x",
            "-pp",
            "2",
            "--pp-layer-partition",
            "4,0",
        ]
    )
    assert code == 2 and "empty stage" in capsys.readouterr().err


def test_partition_enumeration_and_selection() -> None:
    every = all_partitions(6, 3)
    assert len(every) == 10 and all(sum(p) == 6 and min(p) >= 1 for p in every)
    assert len({tuple(p) for p in every}) == 10
    entry_on_engram = [p for p in every if p[0] in (1, 4) or p[0] + p[1] in (1, 4)]
    for k in range(1, 12):  # never more than K; the stage-entry-on-Engram ones first
        picked = choose_partitions(6, 3, [1, 4], k)
        assert len(picked) == min(k, 10) and len({tuple(p) for p in picked}) == len(picked)
        if k >= len(every):
            assert picked == every
            continue
        m = min(k, len(entry_on_engram))
        assert all(p in entry_on_engram for p in picked[:m])
        assert all(p in picked for p in entry_on_engram) or k < len(entry_on_engram)


# --- fail closed on every stage --------------------------------------------------------------


def test_later_stage_without_carry_raises() -> None:
    """A later stage handed no stream / lagged pre / hash ids refuses to run."""
    model, _ = make_model(num_hidden_layers=3, engram_layer_ids=[0, 2])
    stage = _stage_of(model, [1, 2])
    session = StageRunner(stage, None, new_kv_cache(stage, 1))
    with pytest.raises(RuntimeError, match="stage starting at layer 1 needs the stream"):
        session.compute(StepBatch(None, [0], [2], [0]))


def _stage_of(model, layers: list[int]):
    from engramrt.model.decoder import EngramMHCModel

    stage = EngramMHCModel(model.cfg, model.dtype, layers)
    stage.load_state_dict(
        {k: v for k, v in model.state_dict().items() if k in stage.state_dict()}, strict=False
    )
    for i in layers:
        if stage.layers[str(i)].engram is not None:
            stage.layers[str(i)].engram.embed = model.layers[str(i)].engram.embed
    return stage


def test_stage_carry_hand_off_is_exact_in_process() -> None:
    """Stages run one after another in one process (no messages) give PP = 1's logits bitwise,
    including a later stage that starts on an Engram layer."""
    from engramrt.engram import load_hasher

    model, _ = make_model(seed=4, num_hidden_layers=4, engram_layer_ids=[1, 2])
    hasher, _ = load_hasher(GQA_MODEL_DIR, 1)
    whole = StageRunner(model, hasher, new_kv_cache(model, 1))
    tokens = [0, 55, 66, 77, 88]
    want = whole.compute(StepBatch(tokens, [0], [5], [0]))
    hasher2, _ = load_hasher(GQA_MODEL_DIR, 1)
    first = StageRunner(_stage_of(model, [0]), hasher2, None)
    second = StageRunner(_stage_of(model, [1, 2, 3]), None, None)
    for s in (first, second):
        s.allocate_kv(1, None, 16, None)
    carry = first.compute(StepBatch(tokens, [0], [5], [0]))
    assert isinstance(carry, Carry) and carry.pre.dtype.is_floating_point
    got = second.compute(StepBatch(None, [0], [5], [0]), carry)
    assert got.equal(want) and second.engram_ran == Counter([1, 2])


# --- every partition == PP = 1, bitwise (multi-process, gloo) --------------------------------


@pytest.fixture(scope="module")
def six_layer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, raw = make_model(seed=5, num_hidden_layers=6, engram_layer_ids=[1, 4])
    return save_model(model, raw, tmp_path_factory.mktemp("six"))


@pytest.mark.slow
@pytest.mark.parametrize("stages", [2, 3])
def test_every_partition_bitwise_equals_pp1(six_layer_dir: Path, stages: int) -> None:
    """6 layers, Engram at {1, 4}: all 2- and 3-stage partitions, prefill + 8 decode steps of
    3 requests of different lengths, logits bitwise equal to PP = 1."""
    report = check_pp(CheckOptions(six_layer_dir, stages=stages, prompts=PROMPTS))
    parts = [r["partition"] for r in report["partitions"]]
    assert parts == all_partitions(6, stages)
    for must in ([1, 5], [4, 2], [1, 3, 2]):
        assert must in parts or len(must) != stages
    for r in report["partitions"]:
        assert r["max_abs_dlogit"] == 0.0 and r["greedy_tokens_identical"] and r["engram_runs_ok"]
    assert report["ok"]


@pytest.mark.slow
def test_engram_at_first_and_last_layer_with_one_layer_stages(tmp_path: Path) -> None:
    model, raw = make_model(seed=6, num_hidden_layers=3, engram_layer_ids=[0, 2])
    model_dir = save_model(model, raw, tmp_path)
    report = check_pp(CheckOptions(model_dir, stages=3, prompts=PROMPTS, decode_steps=3))
    (row,) = report["partitions"]
    assert row["partition"] == [1, 1, 1] and row["engram_layers_by_stage"] == [[0], [], [2]]
    assert report["ok"] and row["max_abs_dlogit"] == 0.0


# --- the check-pp command, and proof that it can fail ----------------------------------------


@pytest.mark.slow
def test_check_pp_checks_exactly_the_partition_it_is_given(tmp_path) -> None:
    """``--pp-layer-partition``: that partition alone, failing where it should; an illegal V4.1
    cut is the one-line error ``generate`` gives; ``-pp`` is honoured; stage counts that
    disagree, and ``--max-partitions`` beside one partition, are refused by name."""
    report = tmp_path / "r.json"
    one = _cli(
        "check-pp", "--pp-layer-partition", "3,1", "--decode-steps", "2", "--json", str(report)
    )
    assert one.returncode == 0, one.stderr
    assert [r["partition"] for r in json.loads(report.read_text())["partitions"]] == [[3, 1]]
    bad = _cli(
        "check-pp",
        *("--pp-layer-partition", "2,2", "--decode-steps", "2"),
        env={FAULT_ENV: "skip-entry-engram"},
    )
    assert bad.returncode == 1 and "2,2" in bad.stdout, bad.stderr
    pp = _cli("check-pp", "-pp", "3", "--max-partitions", "1", "--decode-steps", "1")
    assert pp.returncode == 0 and "1 partitions into 3 stages" in pp.stdout, pp.stderr

    def default_model(*args: str) -> subprocess.CompletedProcess:  # the six-layer V4.1
        cmd = [sys.executable, "-m", "engramrt", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=180)

    illegal = default_model("check-pp", "--pp-layer-partition", "2,4")
    generate = default_model(
        "generate", "--prompt", "hi", "-pp", "2", "--pp-layer-partition", "2,4", "--max-tokens", "1"
    )
    assert illegal.returncode == generate.returncode == 2
    why = [r.stderr.strip().splitlines()[-1].partition("error: ")[2] for r in (illegal, generate)]
    assert why[0] == why[1] and "cannot start or end at layer 2" in why[0]
    for flags, named in [
        (("--stages", "3"), "--stages gives 3"),
        (("-pp", "3"), "--pipeline-parallel-size gives 3"),
        (("--max-partitions", "1"), "--max-partitions"),
    ]:
        refused = _cli("check-pp", "--pp-layer-partition", "2,2", *flags)
        assert refused.returncode == 2 and named in refused.stderr, refused.stderr


@pytest.mark.slow
def test_check_pp_on_default_model_passes_and_catches_a_skipped_engram(tmp_path) -> None:
    good = _cli("check-pp")
    assert good.returncode == 0, good.stderr
    assert "all match PP = 1" in good.stdout and "1,3" in good.stdout
    bad = _cli("check-pp", "--json", str(tmp_path / "r.json"), env={FAULT_ENV: "skip-entry-engram"})
    assert bad.returncode == 1, bad.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert not report["ok"] and [r["partition"] for r in report["partitions"]] == [
        [1, 3],
        [2, 2],
        [3, 1],
    ]
    assert [r["ok"] for r in report["partitions"]] == [False, False, True]
    rows = {line.split()[0]: line for line in bad.stdout.splitlines()[1:-1]}
    assert "MISMATCH" in rows["1,3"] and "MISMATCH" in rows["2,2"]  # stage 1 starts on Engram
    assert rows["3,1"].endswith(" ok")  # no Engram at that stage's entry: nothing skipped


@pytest.mark.parametrize("eps", [0.0, 1e-3, 0.05, 1.0])
def test_flip_gap_bounds_rounding_flips(eps: float) -> None:
    """Greedy tokens of the reference's logits plus noise of at most ``eps`` flip only where
    the reference's two tokens lie within 2 eps; the gap reported is the largest of those
    (brute force over every row), None without flips."""
    g = torch.Generator().manual_seed(int(eps * 1000))
    ref = [torch.randn(5, 40, generator=g) for _ in range(6)]
    noisy = [r + (torch.rand(r.shape, generator=g) * 2 - 1) * eps for r in ref]
    want, got = ([x.argmax(-1).tolist() for x in xs] for xs in (ref, noisy))
    gaps = [
        float(r[i, w[i]] - r[i, o[i]])
        for r, w, o in zip(ref, want, got, strict=True)
        for i in range(5)
        if w[i] != o[i]
    ]
    gap = _flip_gap(got, want, ref)
    assert gap == (max(gaps) if gaps else None)
    assert gap is None or 0 < gap <= 2 * eps
    if eps == 0.0:
        assert gap is None


def test_check_pp_in_process_reports_a_raising_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """One stage, in this process: a stage that raises fails its partition with the error in
    the report and the table, instead of ending the check with a traceback."""
    monkeypatch.setenv(RAISE_ENV, "0@4")
    report = check_pp(CheckOptions(GQA_MODEL_DIR, stages=1, decode_steps=2))
    (row,) = report["partitions"]
    want = f"stage 0: RuntimeError: injected fault ({RAISE_ENV}) on stage 0"
    assert row["partition"] == [4] and row["error"] == want and not report["ok"]
    table = format_report(report).splitlines()
    assert table[1].split() == ["4", "-", "-", "-", "FAILED:", *want.split()]
    assert table[-1] == "1 partitions into 1 stages: 1 FAILED"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stages", "fault", "partitions"),
    [
        (2, "0@2,2", [[1, 3], [2, 2], [3, 1]]),
        (2, "1@2,2", [[1, 3], [2, 2], [3, 1]]),
        (3, "1@1,2,1", [[1, 1, 2], [1, 2, 1], [2, 1, 1]]),
        (2, "1@1,3@load", [[1, 3], [2, 2], [3, 1]]),
    ],
)
def test_check_pp_reports_a_raising_stage_and_goes_on(
    tmp_path: Path, stages: int, fault: str, partitions: list[list[int]]
) -> None:
    """Issue 13: a stage that raises at a decode step of one partition (rank 0, the last stage
    on rank 1, a middle one) or while loading fails that partition with its error, in the table
    and the JSON; the stages still running are not left waiting, the check goes on with the
    next partitions, which pass, and exits 1, with no traceback."""
    stage, failing, *load = fault.split("@")
    out = _cli(
        "check-pp",
        "--stages",
        str(stages),
        "--json",
        str(tmp_path / "r.json"),
        env={RAISE_ENV: fault},
    )
    assert out.returncode == 1, out.stderr
    assert "Traceback" not in out.stdout + out.stderr, out.stderr
    report = json.loads((tmp_path / "r.json").read_text())
    assert [r["partition"] for r in report["partitions"]] == partitions
    where = "loading stage" if load else "on stage"
    want = f"stage {stage}: RuntimeError: injected fault ({RAISE_ENV}) {where} {stage}"
    for r in report["partitions"]:
        bad = ",".join(map(str, r["partition"])) == failing
        assert r["ok"] != bad and r["error"] == (want if bad else None)
        if not bad:
            assert r["max_abs_dlogit"] == 0.0 and r["greedy_tokens_identical"]
    rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:-1]}
    assert rows.pop(failing).endswith(f"FAILED: {want}")
    assert all(line.endswith(" ok") for line in rows.values())
    assert out.stdout.splitlines()[-1] == f"3 partitions into {stages} stages: 1 FAILED"


# --- trace, generate and torchrun ------------------------------------------------------------


@pytest.mark.slow
def test_engram_trace_shows_the_stage_entry_engram(tmp_path: Path) -> None:
    """Partition 1,3 on the GQA fixture: stage 1 starts on Engram layer 1. Every step, each
    Engram layer runs once on its stage; layer 1's input is exactly the received stream, which
    is exactly what stage 0 sent."""
    trace = tmp_path / "trace.jsonl"
    args = ["generate", "--prompt", "The quick brown fox", "--max-tokens", "6", "--device", "cpu"]
    pp = _cli(*args, "-pp", "2", "--pp-layer-partition", "1,3", "--engram-trace", str(trace))
    assert pp.returncode == 0, pp.stderr
    single = _cli(*args)
    assert pp.stdout == single.stdout and pp.stdout.strip()
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    steps = sorted({r["step"] for r in rows})
    assert steps == list(range(6))  # prefill + 5 decode steps
    for step in steps:
        at = {(r["rank"], r["layer"]): r for r in rows if r["step"] == step}
        assert {layer for (_, layer), r in at.items() if "engram_out_sha256" in r} == {1, 2}
        assert [k for k, r in at.items() if "engram_in_sha256" in r] == [(1, 1), (1, 2)]
        entry = at[(1, 1)]
        assert entry["engram_in_sha256"] == entry["stage_entry_sha256"]
        assert entry["stage_entry_sha256"] == at[(0, 0)]["stage_exit_sha256"]
        assert entry["engram_out_sha256"] != entry["engram_in_sha256"]
        assert entry["engram_update_rms"] > 0.1 and entry["engram_changed_frac"] > 0.5


@pytest.mark.slow
@pytest.mark.parametrize("flag", ["-pp", "-tp"])
def test_torchrun_runs_the_same_flags(flag: str) -> None:
    """Two ranks under torchrun: two stages, or one stage of two TP ranks."""
    torchrun = Path(sys.executable).with_name("torchrun")
    run = subprocess.run(
        [
            str(torchrun),
            "--standalone",
            "--nproc-per-node",
            "2",
            "-m",
            "engramrt",
            "generate",
            "--model",
            str(GQA_MODEL_DIR),
            "--prompt",
            "The quick brown fox",
            "--max-tokens",
            "5",
            flag,
            "2",
            "--device",
            "cpu",
            "--dtype",
            "float32",
        ],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert run.returncode == 0, run.stderr
    single = _cli(
        "generate",
        "--prompt",
        "The quick brown fox",
        "--max-tokens",
        "5",
        "--device",
        "cpu",
        "--dtype",
        "float32",
    )
    assert run.stdout == single.stdout


@pytest.mark.slow
def test_a_dead_stage_ends_the_others_quickly() -> None:
    """Two ranks started as torchrun would (no supervising parent); rank 1 dies after one
    step. Rank 0 must exit with an error within seconds, not wait out its 600 s timeout."""
    script = Path(__file__).parents[1] / "support" / "pp_stage_dies.py"
    port = str(free_port())
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "WORLD_SIZE": "2",
        "PYTHONPATH": str(Path(__file__).parents[2]),
    }
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), "600"],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for r in range(2)
    ]
    codes = [p.wait(timeout=120) for p in procs]
    elapsed = time.monotonic() - start
    assert codes[1] == 3 and codes[0] != 0
    assert elapsed < 60


def _threads_of(stage: int, stages: int, out_dir: str) -> None:
    Path(out_dir, str(stage)).write_text(str(torch.get_num_threads()))


@pytest.mark.parametrize("omp", [None, "1"])
def test_spawned_ranks_share_the_cores(omp: str | None, tmp_path: Path, monkeypatch) -> None:
    """Each spawned rank takes cpu_count / world threads (two ranks at the default of all cores
    spin against each other), unless OMP_NUM_THREADS says otherwise."""
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    launch(DistConfig(pp_size=2), _threads_of, str(tmp_path))
    want = int(omp) if omp else max(1, (os.cpu_count() or 1) // 2)
    assert [int((tmp_path / str(s)).read_text()) for s in range(2)] == [want, want]
