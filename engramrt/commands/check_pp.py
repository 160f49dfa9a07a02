"""``engramrt check-pp``: the same prompts with PP = 1 and with every partition of the layers
into N stages; any logit or greedy-token difference, or an Engram layer that did not run exactly
once per step on the stage that owns it, is a failure (exit code 1).

Each partition is fed the PP = 1 run's greedy tokens, so one mismatch cannot cascade and the
logits of every step are compared like for like. A stage that raises fails its partition, with
the error in the table, and the check goes on with the next one.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from engramrt import tensor_parallel
from engramrt.bundled import resolve_model_dir
from engramrt.commands.flags import DEVICES, DTYPES, add_dist_flags, add_model_flag, dist_config
from engramrt.config import load_json
from engramrt.models import model_config
from engramrt.parallel.faults import inject_stage_faults
from engramrt.parallel.launch import DistConfig, launch, stage_device
from engramrt.parallel.partition import (
    all_partitions,
    parse_partition,
    resolve_partition,
    stage_layers,
)
from engramrt.parallel.pipeline import Pipeline
from engramrt.prompts import PromptEncoder
from engramrt.runner.batch import StepBatch, StepResult
from engramrt.runner.carry import Carry
from engramrt.runner.stage import StageRunner
from engramrt.tensor_parallel import TensorParallel

DEFAULT_PROMPTS = [
    "The Engram hashes every token of this prompt.",
    "A pipeline stage may begin on an Engram layer.",
    "Hi",
]
# Test-only: ``STAGE@PARTITION`` (``1@2,2``) makes that stage raise at the first decode step of
# that partition, ``STAGE@PARTITION@load`` while it loads.
RAISE_ENV = "ENGRAMRT_CHECK_PP_RAISE"


def choose_partitions(
    num_layers: int,
    stages: int,
    engram_layers: list[int],
    limit: int | None,
    cuts: list[int] | None = None,
):
    """All partitions (with ``cuts``, a V4.1 model's legal cuts: those whose stages all start
    at one), or at most ``limit`` of them, those in which a later stage starts on an Engram
    layer first."""
    every = all_partitions(num_layers, stages)
    if cuts is not None:
        every = [p for p in every if all(sum(p[:r]) in cuts for r in range(1, stages))]
        if not every:
            raise ValueError(
                f"this V4.1 model has no partition into {stages} stages: a stage "
                f"may start only before layers {cuts}"
            )
    if limit is None or limit >= len(every):
        return every

    def entry_on_engram(parts: list[int]) -> bool:
        return any(sum(parts[:r]) in engram_layers for r in range(1, stages))

    must = [p for p in every if entry_on_engram(p)]
    rest = [p for p in every if not entry_on_engram(p)]
    return (must + rest)[:limit]


@dataclass
class CheckOptions:
    model_dir: Path
    stages: int = 2
    max_partitions: int | None = None
    partition: list[int] | None = None  # exactly this one (``--pp-layer-partition``)
    prompts: list[str] = field(default_factory=lambda: list(DEFAULT_PROMPTS))
    decode_steps: int = 8
    dtype: str = "float32"
    atol: float = 0.0
    rtol: float | None = None  # default: 0 at TP = 1 (bitwise), 1e-5 under TP (sums reorder)
    enforce_eager: bool = False  # on CUDA, decode steps replay CUDA graphs unless this is set
    dist: DistConfig = field(default_factory=DistConfig)


def check_pp(opts: CheckOptions) -> dict | None:
    """Run the check; the report (also what the table is printed from), on rank 0 only."""
    cfg = model_config(load_json(opts.model_dir))
    if not 1 <= opts.stages <= cfg.num_layers:
        raise ValueError(f"--stages must lie in [1, {cfg.num_layers}], got {opts.stages}")
    if opts.partition is not None:  # exactly this one, or the error generate and serve give
        text = ",".join(map(str, opts.partition))
        parts = resolve_partition(cfg.num_layers, opts.stages, text)
        for rank in range(opts.stages):
            cfg.family.check_stage(cfg, stage_layers(parts, rank))
        partitions = [parts]
    else:
        cuts = cfg.family.legal_cuts(cfg)
        partitions = choose_partitions(
            cfg.num_layers, opts.stages, list(cfg.engram.layer_ids), opts.max_partitions, cuts
        )
    encoder = PromptEncoder.load(opts.model_dir)
    prompts = [encoder.text(p) for p in opts.prompts]
    if opts.decode_steps < 0 or not all(prompts):
        raise ValueError("--decode-steps must be >= 0 and every prompt must have tokens")
    longest = max(len(p) for p in prompts) + opts.decode_steps
    if longest > cfg.max_position_embeddings:
        raise ValueError(
            f"the longest prompt plus --decode-steps is {longest} tokens, over the model's "
            f"{cfg.max_position_embeddings}"
        )
    opts.dist.pp_size = opts.stages
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "report.json"
        launch(opts.dist, _worker, opts, partitions, prompts, str(out))
        if not out.exists():  # a torchrun rank other than 0: rank 0 reports
            return None
        report = json.loads(out.read_text())
    report["ok"] = all(r["ok"] for r in report["partitions"])
    return report


def _scenario(pipe: Pipeline, prompts: list[list[int]], steps: int, forced: list | None):
    """Prefill all prompts in one batch, then ``steps`` decode steps; logits of every step."""
    slots = list(range(len(prompts)))
    res = pipe.step(
        StepBatch(
            [t for p in prompts for t in p],
            slots,
            [len(p) for p in prompts],
            [0] * len(prompts),
            return_logits=True,
        )
    )
    logits, tokens = [res.logits], [res.tokens]
    lengths = [len(p) for p in prompts]
    for k in range(steps):
        feed = forced[k] if forced is not None else tokens[-1]
        res = pipe.step(StepBatch(feed, slots, [1] * len(prompts), lengths, return_logits=True))
        lengths = [n + 1 for n in lengths]
        logits.append(res.logits)
        tokens.append(res.tokens)
    return logits, tokens


def _runner(
    opts: CheckOptions, layers: list[int], num_slots: int, tp: TensorParallel | None = None
) -> StageRunner:
    runner = StageRunner.load(
        opts.model_dir,
        num_slots,
        device=stage_device(opts.dist),
        dtype=opts.dtype,
        layer_ids=layers,
        tp=tp,
    )
    if runner.device.type == "cuda" and not opts.enforce_eager:
        runner.capture_graphs(num_slots)
    return runner


class ContainedStage:
    """One stage of one partition that survives its own exception: the first one is kept as the
    partition's failure, and from then on the stage answers every step with zeros of the shapes
    the next stage (or rank 0) expects, so every message still matches, no stage is left
    waiting, and the partition runs to its end. Everything but ``run`` is the runner's."""

    def __init__(self, runner: StageRunner):
        self.runner, self.error = runner, None

    def __getattr__(self, name: str):
        return getattr(self.runner, name)

    def compute(self, batch: StepBatch, carry: Carry | None = None, **kw):
        """A TP follower's step (its output stays on the rank)."""
        if self.error is None:
            try:
                return self.runner.compute(batch, carry, **kw)
            except Exception as exc:  # noqa: BLE001 - reported in the partition's row
                self.error = _error(exc)
        return None

    def run(self, batch: StepBatch, carry: Carry | None = None) -> Carry | StepResult:
        if self.error is None:
            try:
                return self.runner.run(batch, carry)
            except Exception as exc:  # noqa: BLE001 - reported in the partition's row
                self.error = _error(exc)
        r, t = self.runner, batch.num_tokens
        if not r.is_last:
            return Carry.empty(r.model, t, torch.zeros)
        rows = t if batch.full_logits else len(batch.slots)  # what ``run`` hands the sampler
        return r.sampler(torch.zeros(rows, r.model.cfg.vocab_size, device=r.device), batch)


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"


def _load_stage(opts: CheckOptions, parts: list[int], rank: int, n: int) -> ContainedStage:
    """This rank's stage of partition ``parts``, with the test-only faults."""
    stage, _, rest = os.environ.get(RAISE_ENV, "").partition("@")
    partition, _, point = rest.partition("@")
    fault = stage == str(rank) and partition == ",".join(map(str, parts))
    if fault and point == "load":
        raise RuntimeError(f"injected fault ({RAISE_ENV}) loading stage {rank}")
    runner = _runner(opts, stage_layers(parts, rank), n)
    inject_stage_faults(runner, rank)
    if fault:  # the second step (the first decode) raises
        step, calls = runner.compute, []

        def failing(batch: StepBatch, carry: Carry | None = None, **kw):
            calls.append(batch)
            if len(calls) == 2:
                raise RuntimeError(f"injected fault ({RAISE_ENV}) on stage {rank}")
            return step(batch, carry, **kw)

        runner.compute = failing
    return ContainedStage(runner)


def _worker(rank, world, opts: CheckOptions, partitions, prompts, out_path: str) -> None:
    """``rank``: this process's stage; with TP each stage is ``tp`` ranks, and the reference
    is one process without TP (on the driver)."""
    tp = tensor_parallel.current()
    n = len(prompts)
    driver = rank == 0 and tp.rank == 0
    if driver:
        full = _runner(opts, list(range(sum(partitions[0]))), n, tensor_parallel.SINGLE)
        ref_logits, ref_tokens = _scenario(Pipeline(full), prompts, opts.decode_steps, None)
    rows = []
    for parts in partitions:
        stage, error = None, None
        try:
            stage = _load_stage(opts, parts, rank, n)
        except Exception as exc:  # noqa: BLE001 - a stage that cannot load fails the partition
            error = _error(exc)
        loaded = _all_ranks(error)  # the pipeline runs only if every rank loaded
        if all(e is None for e in loaded):
            pipe = Pipeline(stage, rank, world)
            if driver:
                try:
                    logits, tokens = _scenario(pipe, prompts, opts.decode_steps, ref_tokens)
                finally:
                    pipe.stop()
            else:
                pipe.serve()
            error = stage.error
        per_rank = _to_rank0(driver, (stage.engram_ran if stage else Counter(), error))
        if driver:
            errors = [
                f"{_where(r, tp.size)}: {e}" for r, (_, e) in enumerate(per_rank) if e is not None
            ]
            if errors:
                rows.append(_failed(parts, "; ".join(errors)))
            else:
                ran = [r for r, _ in per_rank[:: tp.size]]  # each stage's leader
                rows.append(_compare(opts, parts, ran, logits, tokens, ref_logits, ref_tokens))
    if driver:
        report = {"stages": world, "tensor_parallel_size": tp.size, "partitions": rows}
        Path(out_path).write_text(json.dumps(report))


def _where(rank: int, tp: int) -> str:
    return f"stage {rank // tp}" + (f" (TP rank {rank % tp})" if tp > 1 else "")


def _all_ranks(value):
    """``value`` of every rank, on every rank."""
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def _to_rank0(driver: bool, value):
    """``value`` of every rank, on rank 0 (None elsewhere)."""
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size() if driver else None
    dist.gather_object(value, out, dst=0)
    return out


def _failed(parts: list[int], error: str) -> dict:
    return {
        "partition": parts,
        "engram_layers_by_stage": None,
        "engram_runs_ok": None,
        "max_abs_dlogit": None,
        "greedy_tokens_identical": None,
        "flip_gap": None,
        "ok": False,
        "error": error,
    }


def _compare(opts, parts, per_stage, logits, tokens, ref_logits, ref_tokens) -> dict:
    steps = len(ref_logits)
    pairs = list(zip(logits, ref_logits, strict=True))
    delta = max(float((a - b).abs().max()) for a, b in pairs)
    rtol = opts.rtol if opts.rtol is not None else (1e-5 if opts.dist.tp_size > 1 else 0.0)
    # relative to the step's largest logit: a logit near 0 has no scale of its own
    close = all(
        float((a - b).abs().max()) <= opts.atol + rtol * float(b.abs().max()) for a, b in pairs
    )
    cfg = model_config(load_json(opts.model_dir))
    expected = [
        [layer for layer in stage_layers(parts, r) if layer in cfg.engram.layer_ids] * steps
        for r in range(len(parts))
    ]
    ran_ok = [Counter(ran) == Counter(exp) for ran, exp in zip(per_stage, expected, strict=True)]
    same_tokens = tokens == ref_tokens
    return {
        "partition": parts,
        "engram_layers_by_stage": [sorted(set(r)) for r in per_stage],
        "engram_runs_ok": all(ran_ok),
        "max_abs_dlogit": delta,
        "greedy_tokens_identical": same_tokens,
        "flip_gap": _flip_gap(tokens, ref_tokens, ref_logits),
        "ok": all(ran_ok) and same_tokens and close,
        "error": None,
    }


def _flip_gap(tokens, ref_tokens, ref_logits) -> float | None:
    """Where a greedy token differs (the inputs are the reference's), the largest gap between
    the two tokens' reference logits: a flip within ``max_abs_dlogit`` is a near-tie that
    rounding decided, a larger one is a wrong logit. None when no token differs."""
    gaps = [
        float(ref[row, want] - ref[row, got])
        for step, ref in enumerate(ref_logits)
        for row, (got, want) in enumerate(zip(tokens[step], ref_tokens[step], strict=True))
        if got != want
    ]
    return max(gaps) if gaps else None


def format_report(report: dict) -> str:
    lines = [
        f"{'partition':<14} {'Engram layers ran, by stage':<30} {'max |dlogit|':>13} "
        f"{'greedy tokens':>14}  result",
    ]
    for r in report["partitions"]:
        parts = ",".join(map(str, r["partition"]))
        if r["error"] is not None:
            lines.append(f"{parts:<14} {'-':<30} {'-':>13} {'-':>14}  FAILED: {r['error']}")
            continue
        by_stage = " | ".join(
            f"s{i}:{','.join(map(str, layers)) or '-'}"
            for i, layers in enumerate(r["engram_layers_by_stage"])
        )
        lines.append(
            f"{parts:<14} {by_stage:<30} "
            f"{r['max_abs_dlogit']:>13.3g} "
            f"{'identical' if r['greedy_tokens_identical'] else 'DIFFER':>14}  "
            f"{'ok' if r['ok'] else 'MISMATCH'}"
            + (
                f" (tokens flip where the reference's gap is {r['flip_gap']:.3g})"
                if r.get("flip_gap") is not None
                else ""
            )
        )
    failed = sum(r["error"] is not None for r in report["partitions"])
    bad = sum(not r["ok"] for r in report["partitions"]) - failed
    verdict = ", ".join(f"{k} {what}" for k, what in ((bad, "MISMATCH"), (failed, "FAILED")) if k)
    tp = report.get("tensor_parallel_size", 1)
    lines.append(
        f"{len(report['partitions'])} partitions into {report['stages']} stages"
        + (f" x TP {tp}" if tp > 1 else "")
        + ": "
        + (verdict or ("all match TP = 1, PP = 1" if tp > 1 else "all match PP = 1"))
    )
    return "\n".join(lines)


# --------------------------------------------------------------------------- the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flag(p)
    p.add_argument(
        "--stages",
        type=int,
        help="check every partition into this many stages (default 2; also -pp N)",
    )
    p.add_argument("--max-partitions", type=int, help="at most K (entry-on-Engram ones first)")
    p.add_argument("--prompts", metavar="FILE", help="one prompt per line")
    p.add_argument("--decode-steps", type=int, default=8)
    p.add_argument("--device", choices=DEVICES, default="cpu")
    p.add_argument("--dtype", choices=DTYPES, default="float32")
    p.add_argument("--atol", type=float, default=0.0, help="allowed max |dlogit| (default 0)")
    p.add_argument(
        "--rtol",
        type=float,
        help="allowed max |dlogit| relative to the step's largest |logit| (default: 0, bitwise; "
        "1e-5 with "
        "--tensor-parallel-size > 1, whose all-reduces sum in another order)",
    )
    p.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    add_dist_flags(p)


def _asked_partition(args: argparse.Namespace) -> tuple[list[int] | None, int]:
    """(the one partition ``--pp-layer-partition`` names, the stage count): ``--stages``,
    ``-pp`` and the partition name the stages each; any two that disagree are an error, as is
    ``--max-partitions`` beside one partition."""
    partition = parse_partition(args.pp_layer_partition) if args.pp_layer_partition else None
    asked = {
        "--stages": args.stages,
        "--pipeline-parallel-size": args.pipeline_parallel_size
        if args.pipeline_parallel_size != 1
        else None,
        "--pp-layer-partition": None if partition is None else len(partition),
    }
    given = {flag: n for flag, n in asked.items() if n is not None}
    if len(set(given.values())) > 1:
        said = ", ".join(f"{flag} gives {n}" for flag, n in given.items())
        raise ValueError(f"the number of pipeline stages is given twice and disagrees: {said}")
    if partition is not None and args.max_partitions is not None:
        raise ValueError("--max-partitions chooses among partitions: not with --pp-layer-partition")
    return partition, next(iter(given.values()), 2)


def run(args: argparse.Namespace) -> int:
    """Exit code 1 when any partition differs from PP = 1 or failed."""
    device = args.device or "cpu"
    prompts = None
    if args.prompts:
        with open(args.prompts) as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
        if not prompts:
            raise ValueError(f"{args.prompts} holds no prompts (one per line)")
    partition, stages = _asked_partition(args)
    opts = CheckOptions(
        model_dir=resolve_model_dir(args.model),
        stages=stages,
        max_partitions=args.max_partitions,
        partition=partition,
        decode_steps=args.decode_steps,
        dtype=args.dtype,
        atol=args.atol,
        rtol=args.rtol,
        enforce_eager=args.enforce_eager,
        dist=dist_config(args, device),
    )
    if prompts:
        opts.prompts = prompts
    report = check_pp(opts)
    if report is None:
        return 0
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["ok"] else 1
