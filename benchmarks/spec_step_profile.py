"""Where a decode step's time goes, with and without speculation: one latency run of ``engramrt
bench throughput`` (the same flags) under the torch profiler, reported per engine step as wall
time against the summed time of the GPU kernels (graph replays included), with the costliest
kernels. A step whose wall time is well above its kernels' is host- or launch-bound.

    python benchmarks/spec_step_profile.py --model DIR --batch-size 1 --input-len 128
        --output-len 64 --prompt-kind repeat [--speculative-config JSON] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from torch.profiler import ProfilerActivity, profile

from engramrt.commands import bench_throughput as bt
from engramrt.engine.engine import Engine


def warm_engine(args: argparse.Namespace) -> tuple[Engine, list[list[int]], list[int]]:
    """The latency run's engine (``bench throughput``'s flags) after a warm-up request, its
    prompts, and ``[steps]``: the engine steps counted from here on."""
    n = args.batch_size or 1
    engine = bt.local_engine(args, args.input_len + args.output_len)
    prompts = bt.random_prompts(
        random.Random(args.seed), [args.input_len] * n, engine.vocab_size, args.prompt_kind
    )
    bt._run(engine, prompts[:1], [2])  # warm-up
    steps, step = [0], engine.step

    def counted():
        steps[0] += 1
        return step()

    engine.step = counted
    return engine, prompts, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bt.add_arguments(ap)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--trace", type=Path, help="also write the chrome trace (gzip: .json.gz)")
    args = ap.parse_args()
    n = args.batch_size or 1
    engine, prompts, steps = warm_engine(args)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        bt._run(engine, prompts, [args.output_len] * n)
        wall = time.perf_counter() - t
    if args.trace:  # the timeline: where the GPU idles between steps, and why
        prof.export_chrome_trace(str(args.trace))
    kernels = [
        e
        for e in prof.key_averages()
        if e.device_time_total > 0
        and e.count
        and not e.key.startswith(("aten::", "cuda", "Optimizer"))
    ]
    kernels.sort(key=lambda e: -e.self_device_time_total)
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    stats = engine.stats()
    row = {
        "speculative_config": args.speculative_config,
        "batch": n,
        "steps": steps[0],
        "wall_ms_a_step": 1e3 * wall / steps[0],
        "kernel_ms_a_step": gpu_ms / steps[0],
        "verify_runs": stats["spec_decode_num_drafts"],
        "accepted": stats["spec_decode_num_accepted_tokens"],
        "top_kernels": [
            (
                e.key[:70],
                round(e.count / steps[0], 1),
                round(e.self_device_time_total / 1e3 / steps[0], 3),
            )
            for e in kernels[:12]
        ],
    }
    print(
        f"{args.speculative_config or 'plain'}: {steps[0]} steps, "
        f"{row['wall_ms_a_step']:.3f} ms a step, kernels {row['kernel_ms_a_step']:.3f} ms a step "
        f"({row['verify_runs']} verify runs, {row['accepted']} drafts accepted)"
    )
    for name, calls, ms in row["top_kernels"]:
        print(f"    {ms:8.3f} ms  {calls:6.1f}x  {name}")
    if args.out:
        args.out.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
