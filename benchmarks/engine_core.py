"""Issue 31's engine-side targets on one GPU: a decode step of a large batch against its GPU
kernel time, with overlap scheduling off and on (the default), alternated on one engine.

The kernel time is the profiler's sum of every CUDA kernel of an eager decode step
(``gpu_runner.profile_split``); the step time is ``bench throughput``'s latency mode (CUDA
graphs, the engine's whole loop: scheduling, the step message, sampling, applying the tokens).

    PYTHONPATH=. python benchmarks/engine_core.py --model /tmp/m1b --out OUT/engine_core.json

It imports ``benchmarks.gpu_runner`` and engramrt from ``PYTHONPATH``: run from another
checkout (``engine_core_ab.sh``), it measures that tree.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.gpu_runner import engine_for, latency, profile_split


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda", help="cpu: try the script, numbers mean nothing")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=2, help="off/on pairs, alternated")
    args = ap.parse_args()
    engine = engine_for(args.model, args.input_len + args.output_len + 8, args.device)
    res: dict = {"model": args.model, "input_len": args.input_len, "output_len": args.output_len}
    for bs in args.batch_sizes:
        latency(engine, bs, args.input_len, 4)  # warm-up: compilation, allocator
        split = profile_split(engine, bs, args.input_len)
        row = {"kernel_ms": split["kernels_total"], "off": [], "on": []}
        for _ in range(args.rounds):
            for mode in ("off", "on"):
                engine.overlap = mode == "on"
                r = latency(engine, bs, args.input_len, args.output_len)
                row[mode].append(r["decode_step_ms"])
        engine.overlap = True
        for mode in ("off", "on"):
            best = min(row[mode])
            ratio = best / row["kernel_ms"] if row["kernel_ms"] else float("nan")  # (CPU: none)
            row[f"{mode}_ms"], row[f"{mode}_over_kernels"] = best, ratio
        res[f"bs{bs}"] = row
        print(
            f"bs {bs}: kernels {row['kernel_ms']:.3f} ms; step {row['off_ms']:.3f} ms "
            f"synchronous ({row['off_over_kernels']:.2f}x), {row['on_ms']:.3f} ms overlapped "
            f"({row['on_over_kernels']:.2f}x)",
            flush=True,
        )
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
