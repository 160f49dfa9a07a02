"""What a prompt chunk costs the decode rows that share its step: the forward of a step of B
decode rows (context C each) with and without a chunk of c prompt tokens beside them, replayed
from CUDA graphs and run eagerly, in one process. The ratio mixed / pure decode is what
``--long-prefill-token-threshold`` bounds.

    python benchmarks/mixed_step.py --model /tmp/m1b --out mixed.json [--rows 64] [--context 512]

Times are the stage's forward (``StageRunner.compute``, logits at each run's last token), GPU
time between CUDA events around each call, median of 20 after 3 warm-ups; sampling excluded.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics

import torch

from engramrt.commands.bench_throughput import add_arguments, local_engine
from engramrt.runner.batch import StepBatch
from engramrt.runner.stage import StageRunner


def step_ms(runner: StageRunner, batch: StepBatch, reps: int = 20) -> float:
    """The same step again and again: its K/V rows are rewritten in place, so nothing grows."""
    times = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        runner.compute(batch, last_only=True)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


@contextlib.contextmanager
def eager(runner: StageRunner):
    graphs, runner.graphs = runner.graphs, None
    try:
        yield
    finally:
        runner.graphs = graphs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", type=int, default=64, help="decode rows")
    ap.add_argument("--context", type=int, default=512, help="each decode row's context")
    ap.add_argument("--chunks", type=int, nargs="+", default=[16, 64, 128, 256, 512, 1024, 1920])
    a = ap.parse_args()
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(
        [
            "--model",
            a.model,
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "--max-num-seqs",
            "128",
            "--max-num-batched-tokens",
            "2048",
        ]
    )
    runner = local_engine(args, 2048).pipeline.runner
    b, ctx = a.rows, a.context
    tables = runner.slots.blocks  # slot s on its own fixed blocks (the warm-up left scratch)
    tables.set(list(range(b + 1)), None, [tables.fixed(s) for s in range(b + 1)])
    decode = StepBatch([5] * b, list(range(b)), [1] * b, [ctx] * b)
    res = {"rows": b, "context": ctx, "decode_graph_ms": step_ms(runner, decode)}
    with eager(runner):
        res["decode_eager_ms"] = step_ms(runner, decode)
    res["mixed"] = []
    for c in a.chunks:  # a new request's first chunk (slot b) beside the decode rows
        batch = StepBatch([5] * (b + c), list(range(b + 1)), [1] * b + [c], [ctx] * b + [0])
        row = {"chunk": c, "tokens": b + c, "graph_ms": step_ms(runner, batch)}
        with eager(runner):
            row["eager_ms"] = step_ms(runner, batch)
        row["graph_over_decode"] = row["graph_ms"] / res["decode_graph_ms"]
        res["mixed"].append(row)
        print(json.dumps(row), flush=True)
    print(json.dumps({k: v for k, v in res.items() if k != "mixed"}), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
