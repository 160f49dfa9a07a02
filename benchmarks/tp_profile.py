"""The all-reduce share of a tensor-parallel decode step, from a profile: every rank of one TP
group steps the same batch (CUDA graphs, as serving does); rank 0 profiles the steps and
sums the NCCL kernels' GPU time against all kernels' and against the step's wall time.

    torchrun --standalone --nproc-per-node 2 benchmarks/tp_profile.py --model /tmp/m4b

With one process the group has one rank: the collectives go through torch's NCCL process
group, but NCCL launches no kernel for one rank (the profile shows none), so the figures are
the step's own.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from engramrt import tensor_parallel
from engramrt.runner.batch import StepBatch
from engramrt.runner.stage import StageRunner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--json", help="write the figures here (rank 0)")
    args = ap.parse_args()
    rank = int(os.environ.get("RANK", 0))
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl")
    world = dist.get_world_size()
    tp = (
        tensor_parallel.join(rank, world, world)
        if world > 1
        else tensor_parallel.TensorParallel(0, 1, dist.group.WORLD, 0)
    )
    bs, steps = args.batch_size, args.steps
    runner = StageRunner.load(
        args.model, bs + 1, args.input_len + 3 * steps + 8, "cuda", args.dtype, tp=tp
    )
    runner.capture_graphs(bs)
    rng = random.Random(0)
    slots, vocab = list(range(1, bs + 1)), runner.model.cfg.vocab_size
    prompt = [rng.randrange(10, vocab) for _ in range(bs * args.input_len)]
    first = StepBatch(prompt, slots, [args.input_len] * bs, [0] * bs)
    logits = runner.compute(first, last_only=True)
    pos = [args.input_len] * bs

    def decode(n: int) -> float:
        nonlocal logits, pos
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(n):
            nxt = logits.argmax(-1).tolist()  # the leader's tokens: identical on every rank
            logits = runner.compute(StepBatch(nxt, slots, [1] * bs, pos))
            pos = [p + 1 for p in pos]
        torch.cuda.synchronize()
        return (time.perf_counter() - start) / n

    decode(steps)  # warm-up
    wall = decode(steps)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        decode(steps)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels) / steps / 1e3  # us -> ms a step
    nccl = sum(e.device_time for e in kernels if "nccl" in e.name.lower()) / steps / 1e3
    calls = sum("nccl" in e.name.lower() for e in kernels) / steps
    if rank == 0:
        ms = wall * 1e3
        out = {
            "tp": world,
            "batch_size": bs,
            "step_ms": ms,
            "kernel_ms": total,
            "nccl_ms": nccl,
            "nccl_kernels_per_step": calls,
            "nccl_share_of_step": nccl / ms,
            "nccl_share_of_kernels": nccl / max(total, 1e-9),
        }
        print(json.dumps(out))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
