"""Where a training step of the bundled model goes (``engramrt.bundled.train``'s own step).

    python benchmarks/train_step.py [--device cuda] [--batch 256] [--length 128] [--steps 3]
        [--deterministic 0,1] [--out results.json]

Windows come from the generated documents (the text does not change a step's cost). For each
setting: the step's wall time (median after two warm-up steps), the ATen operators
one step runs (forward, backward and AdamW: launch-bound training is their count times a
launch), the host-device synchronisations among them, and on a GPU the kernels' summed time
(the step's floor if launches cost nothing) with the ten costliest kernels.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from engramrt.bundled import train as T

SYNCS = (
    "cudaStreamSynchronize",
    "cudaDeviceSynchronize",
    "cudaMemcpyAsync",
    "aten::item",
    "aten::_local_scalar_dense",
)


def measure(device: str, batch: int, length: int, steps: int, deterministic: bool) -> dict:
    with T.training_mode(deterministic):
        return _measure(device, batch, length, steps, deterministic)


def _measure(device: str, batch: int, length: int, steps: int, deterministic: bool) -> dict:
    runner = T.build(T.SEED, device)
    token_docs = T.tokenized(runner, T.DEFAULT_MODEL_DIR, T.corpus(T.SEED, pydoc=False).train)
    params = T.trainable(runner)
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)
    rng = random.Random(0)
    gen = T.batches(token_docs, runner.model.cfg.eos_token_id, length, batch, T.SEED)
    sync = torch.cuda.synchronize if device.startswith("cuda") else lambda: None

    def step() -> None:
        windows = next(gen)
        T.step(runner, opt, params, windows, T.prefill_ends(windows, runner, rng))
        sync()

    for _ in range(2):
        step()
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device != "cpu" else [])
    with profile(activities=acts) as prof:
        step()
    events = prof.key_averages()
    ops = sum(e.count for e in events if e.key.startswith("aten::"))
    syncs = {e.key: e.count for e in events if e.key in SYNCS}
    kernels = sorted(
        (
            e
            for e in events
            if e.device_time_total > 0 and e.count and not e.key.startswith(("aten::", "cuda"))
        ),
        key=lambda e: -e.self_device_time_total,
    )
    gpu_ms = sum(e.self_device_time_total for e in kernels) / 1e3
    return {
        "device": device,
        "batch": batch,
        "length": length,
        "deterministic": deterministic,
        "step_ms": statistics.median(times) * 1e3,
        "aten_ops": ops,
        "syncs": syncs,
        "kernel_ms": gpu_ms,
        "kernels": sum(e.count for e in kernels),
        "top_kernels": [
            (e.key[:80], e.count, round(e.self_device_time_total / 1e3, 2)) for e in kernels[:10]
        ],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--batch", default="256", help="windows a step, comma-separated")
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--deterministic", default="1", help="0, 1 or both: 0,1")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    rows = []
    flags = [v == "1" for v in args.deterministic.split(",")]
    for det, batch in itertools.product(flags, map(int, args.batch.split(","))):
        r = measure(args.device, batch, args.length, args.steps, det)
        rows.append(r)
        print(
            f"{args.device} batch {batch} x {args.length}, deterministic {det}: "
            f"{r['step_ms']:.0f} ms a step, {r['aten_ops']} ATen ops, "
            f"{r['kernels']} kernels summing {r['kernel_ms']:.0f} ms; syncs {r['syncs']}",
            flush=True,
        )
        for k in r["top_kernels"]:
            print("   ", k)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
