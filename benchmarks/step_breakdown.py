"""Where a bs-1 CUDA-graph decode step's time goes: the wall time of ``engine.step`` (synchronised
around each step) against the GPU time of the graph replay and of the sampler (CUDA events), and
the host time of the pieces before the replay. The gap between the wall time and the GPU time is
what overlap scheduling can hide.

    python benchmarks/step_breakdown.py --model /tmp/m4b [--steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

from benchmarks.gpu_runner import engine_for
from engramrt.engine.request import SamplingParams
from engramrt.model.context import ForwardContext
from engramrt.runner import graphs as graphs_mod
from engramrt.runner.batch import DeviceResult


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, default=60)
    args = ap.parse_args()
    engine = engine_for(args.model, 1024, "cuda")
    runner = engine.pipeline.runner
    host: dict[str, list[float]] = {}
    events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def timed(name, fn):
        def wrapped(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            host.setdefault(name, []).append(time.perf_counter() - t0)
            return out

        return wrapped

    def on_gpu(name, fn):
        def wrapped(*a, **k):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*a, **k)
            end.record()
            events.append((name, start, end))
            return out

        return wrapped

    replay = graphs_mod.StepGraphs.replay
    graphs_mod.StepGraphs.replay = timed("replay_call", on_gpu("graph", replay))
    sampler = runner.sampler  # the step launches it; the host waits in DeviceResult.wait
    sampler.launch = timed("sampler_launch", on_gpu("sampler", sampler.launch))
    pending_wait = DeviceResult.wait
    DeviceResult.wait = timed("wait_for_tokens", pending_wait)
    ForwardContext.for_runs = classmethod(timed("step_buffer", ForwardContext.for_runs.__func__))
    runner.hasher.validate = timed("validate_ids", runner.hasher.validate)
    rng = random.Random(0)
    prompt = [rng.randrange(engine.vocab_size) for _ in range(512)]
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0, ignore_eos=True)
    engine.add_request("r", prompt, params)
    while not any(o.new_token_ids for o in engine.step()):
        pass
    host.clear()
    events.clear()
    walls = []
    for _ in range(args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.step()
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    gpu: dict[str, list[float]] = {}
    for name, start, end in events:
        gpu.setdefault(name, []).append(start.elapsed_time(end))
    res = {"step_wall_ms": 1e3 * statistics.median(walls)}
    res |= {f"gpu_{k}_ms": statistics.median(v) for k, v in gpu.items()}
    res |= {f"host_{k}_ms": 1e3 * statistics.median(v) for k, v in host.items()}
    print(json.dumps({k: round(v, 3) for k, v in res.items()}))
    with open(os.path.join(os.environ.get("OUT", "."), "step_breakdown.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
