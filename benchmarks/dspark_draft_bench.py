"""DSpark's draft pass on its own (eager), everything after the sampler of a decode step
replayed from its CUDA graph (acceptance, kept samples, the draft pass, its drafts written back:
``engramrt.runner.verify``), and a decode step of the same batch for scale (the draft pass is one
stage against the backbone's layers).

    python benchmarks/dspark_draft_bench.py --model /tmp/mv41-wide --batches 1,16 [--iters 50]

Each figure is the median of ``--iters`` timed calls after warm-up calls, CUDA events around
each (wall time on the CPU); JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engramrt.models.deepseek_v41 import dspark
from engramrt.runner.batch import StepBatch
from engramrt.runner.stage import StageRunner


def timed(fn, iters: int, cuda: bool) -> float:
    """Median milliseconds of ``fn()`` over ``iters`` calls, after two warm-up calls."""
    for _ in range(2):
        fn()
    out = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            out.append(start.elapsed_time(end))
        else:
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sizes = [int(b) for b in args.batches.split(",")]
    cuda = args.device == "cuda"
    slots, block = max(sizes), 16
    per = -(-(args.prompt + 8) // block)
    runner = StageRunner.load(
        args.model,
        num_slots=slots,
        max_len=args.prompt + 64,
        device=args.device,
        dtype=args.dtype,
        dspark=True,
        num_blocks=0,
    )
    runner.allocate_kv(slots, args.prompt + 64, block, slots * per, slack=5)
    runner.speculate(5)
    if cuda:
        runner.capture_graphs(slots, 64)
    tokens = [3 + i % 900 for i in range(args.prompt)]
    runner.compute(
        StepBatch(
            tokens * slots,
            list(range(slots)),
            [args.prompt] * slots,
            [0] * slots,
            new_blocks=[list(range(s * per, (s + 1) * per)) for s in range(slots)],
        )
    )
    rows = []
    for b in sizes:
        batch = StepBatch([5] * b, list(range(b)), [1] * b, [args.prompt] * b)
        ends = torch.full((b,), args.prompt, device=args.device)  # each run's last position
        where = torch.arange(b, device=args.device)
        bonus = torch.full((b,), 7, device=args.device)
        row = {
            "batch": b,
            "draft_eager_ms": timed(
                lambda: dspark.draft(runner.model, runner.kv, ends, where, bonus), args.iters, cuda
            ),
            "decode_step_ms": timed(lambda: runner.compute(batch), args.iters, cuda),
        }
        if runner.verifier.graphs:  # the whole after-sampler work of a decode step, replayed
            after = StepBatch(None, list(range(b)), [1] * b, [args.prompt] * b)
            samples = torch.full((b,), 7, device=args.device)
            row["after_graph_ms"] = timed(
                lambda: runner.verifier.after(after, samples), args.iters, cuda
            )
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
