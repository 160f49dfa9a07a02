"""Where the host's time goes in a decode step, without a profiler (CUPTI slows each graph
launch by ~1 us a node): one latency run of ``engramrt bench throughput`` (the same flags) with
the engine's and stage's step functions timed (inclusive, so nested ones overlap), reported in
ms a step beside the step's wall time, and the GPU time of the stage's forward, sampler and
verifier (CUDA events around each; summed over every step of the run, the eager prefill's
included, so the forward's is above a decode graph's). Under overlap scheduling a host whose
launches, sampler and bookkeeping take longer than the GPU's step sets the pace; one that
waits for the step in flight does not. ``--timeline`` shows which.

    python benchmarks/host_step_times.py --model DIR --batch-size 1 --input-len 128
        --output-len 64 --prompt-kind repeat [--speculative-config JSON] [--out r.json]
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import time
from collections import Counter
from pathlib import Path

import torch

from benchmarks.spec_step_profile import warm_engine
from benchmarks.step_kernels import module_ranges
from engramrt.commands import bench_throughput as bt
from engramrt.runner.batch import StepBatch

TIMED = [
    "torch.cuda.CUDAGraph.replay",
    "engramrt.engine.engine.Engine._launch",
    "engramrt.engine.scheduler.Scheduler.schedule",
    "engramrt.runner.stage.StageRunner.launch",
    "engramrt.runner.stage.StageRunner.compute",
    "engramrt.model.context.ForwardContext.for_runs",
    "engramrt.runner.sampler.Sampler.launch",
    "engramrt.runner.verify.Verifier.after",
    "engramrt.engine.engine.Engine._apply",
    "engramrt.runner.batch.DeviceResult.wait",
]


def time_calls(names: list[str]) -> tuple[Counter, Counter]:
    """Wrap each ``module.Class.method`` with a timer: (seconds, calls) by name."""
    secs, calls = Counter(), Counter()
    for name in names:
        mod, cls, meth = name.rsplit(".", 2)
        owner = getattr(importlib.import_module(mod), cls)
        fn = getattr(owner, meth)

        def timed(*a, _fn=fn, _name=name, **kw):
            t = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                secs[_name] += time.perf_counter() - t
                calls[_name] += 1

        setattr(owner, meth, functools.wraps(fn)(timed))
    return secs, calls


GPU_TIMED = [
    "engramrt.runner.stage.StageRunner.compute",
    "engramrt.runner.sampler.Sampler.launch",
    "engramrt.runner.verify.Verifier.after",
]


def time_gpu(names: list[str]) -> dict[str, list]:
    """Wrap each ``module.Class.method`` with CUDA events on the current stream before and after
    it: the GPU time of what it queued (exact while the GPU is behind the host, as under overlap
    scheduling of a GPU-bound step), by name."""
    pairs: dict[str, list] = {}
    for name in names:
        mod, cls, meth = name.rsplit(".", 2)
        owner = getattr(importlib.import_module(mod), cls)
        fn = getattr(owner, meth)

        def timed(*a, _fn=fn, _name=name, **kw):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            try:
                return _fn(*a, **kw)
            finally:
                end.record()
                pairs.setdefault(_name, []).append((start, end))

        setattr(owner, meth, functools.wraps(fn)(timed))
    return pairs


TIMELINE = [
    "engramrt.engine.engine.Engine._launch",
    "engramrt.engine.engine.Engine._apply",
    "engramrt.runner.stage.StageRunner.compute",
    "torch.cuda.CUDAGraph.replay",
    "engramrt.runner.sampler.Sampler.launch",
    "engramrt.runner.verify.Verifier.after",
    "engramrt.runner.batch.DeviceResult.wait",
]


def record_timeline(names: list[str]) -> list[tuple[str, float, torch.cuda.Event]]:
    """Wrap each ``module.Class.method`` to note, as it is entered and left, the host's clock and
    a CUDA event on the current stream (reached once the GPU has done all queued before it)."""
    marks: list[tuple[str, float, torch.cuda.Event]] = []

    def mark(label: str) -> None:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        marks.append((label, time.perf_counter(), e))

    for name in names:
        mod, cls, meth = name.rsplit(".", 2)
        owner = getattr(importlib.import_module(mod), cls)
        fn = getattr(owner, meth)
        short = f"{cls}.{meth}"

        def timed(*a, _fn=fn, _short=short, **kw):
            mark(_short + " >")
            try:
                return _fn(*a, **kw)
            finally:
                mark(_short + " <")

        setattr(owner, meth, functools.wraps(fn)(timed))
    torch.cuda.synchronize()
    mark("base")
    torch.cuda.synchronize()
    return marks


def print_timeline(marks: list, last: int) -> None:
    """The last ``last`` marks: host ms and GPU ms since the base mark (taken on an idle GPU, so
    the two clocks start together); where the GPU reaches a mark well after the host set it, the
    GPU was busy; where the two are level, the GPU waited for the host."""
    _, h0, e0 = marks[0]
    for label, h, e in marks[-last:]:
        gpu = e0.elapsed_time(e)
        print(
            f"    host {1e3 * (h - h0):9.3f}  gpu {gpu:9.3f}  lead {gpu - 1e3 * (h - h0):7.3f}  "
            f"{label}"
        )


def replay_ms(fn, reps: int = 100) -> float:
    """GPU ms of one replay of ``fn`` captured in a graph of its own."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


@torch.inference_mode()
def after_graph_parts(engine) -> dict[str, float]:
    """The verifier's after-sampler work at bs 1 in graphs of its own: all of it (``_run``, as
    the engine replays it), and the draft pass alone (``propose``). It writes into slot 0's
    token row, rejected count and history: run it after the timed run only."""
    v = engine.pipeline.runner.verifier
    if v is None:
        return {}
    dev = v.rejected.device
    one = torch.ones(1, dtype=torch.int64, device=dev)
    x = v._inputs(StepBatch(None, [0], [1 + v.k], [10], drafts=[v.k], final=[1]), 1, v.k).to(dev)
    samples = torch.zeros(1 + v.k, dtype=torch.int64, device=dev)
    return {
        "after_ms": replay_ms(lambda: v._run(x, samples, v.k)),
        "propose_ms": replay_ms(lambda: v.propose(one * 10, one * 0, one * 5)),
    }


@torch.inference_mode()
def draft_kernels(engine) -> dict[str, int]:
    """CUDA kernels the after-sampler work launches eagerly at bs 1, by the module that launched
    them (each DSpark stage's children, the draft pass outside them, and ``_run``'s bookkeeping
    outside the draft pass): every kernel is a node of the captured graph, ~1 us each."""
    from torch.profiler import ProfilerActivity, profile, record_function

    v = engine.pipeline.runner.verifier
    model = engine.pipeline.runner.model
    if v is None:
        return {}
    mods = [("_run", None), ("propose", None)]
    if model.mtp is not None:
        mods += [
            (f"mtp.{i}.{n}", m) for i, st in enumerate(model.mtp) for n, m in st.named_children()
        ]
    dev = v.rejected.device
    x = v._inputs(StepBatch(None, [0], [1 + v.k], [10], drafts=[v.k], final=[1]), 1, v.k).to(dev)
    samples = torch.zeros(1 + v.k, dtype=torch.int64, device=dev)
    propose = v.propose

    def timed_propose(*a):
        with record_function("propose"):
            return propose(*a)

    v.propose = timed_propose
    v._run(x, samples, v.k)  # warm
    sync = torch.cuda.synchronize if dev.type == "cuda" else lambda: None
    sync()
    with module_ranges(mods[2:]):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function("_run"):
                v._run(x, samples, v.k)
            sync()
    v.propose = propose

    def kernels(e) -> int:
        return len(e.kernels) + sum(kernels(c) for c in e.cpu_children)

    counts: dict[str, int] = {}
    for e in prof.events():
        if e.name in dict(mods):
            counts[e.name] = counts.get(e.name, 0) + kernels(e)
    return counts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    bt.add_arguments(ap)
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--timeline",
        type=int,
        default=0,
        help="instead of the totals, print the last N marks of the run's timeline",
    )
    args = ap.parse_args()
    n = args.batch_size or 1
    engine, prompts, steps = warm_engine(args)
    if args.timeline:
        marks = record_timeline(TIMELINE)
        bt._run(engine, prompts, [args.output_len] * n)
        torch.cuda.synchronize()
        print(args.speculative_config or "plain")
        print_timeline(marks, args.timeline)
        return
    secs, calls = time_calls(TIMED)
    pairs = time_gpu(GPU_TIMED)
    torch.cuda.synchronize()
    t = time.perf_counter()
    bt._run(engine, prompts, [args.output_len] * n)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t
    per = {
        ".".join(k.rsplit(".", 2)[-2:]): (round(1e3 * secs[k] / steps[0], 3), calls[k])
        for k in TIMED
    }
    gpu = {
        ".".join(k.rsplit(".", 2)[-2:]): round(sum(a.elapsed_time(b) for a, b in v) / steps[0], 3)
        for k, v in pairs.items()
    }
    row = {
        "speculative_config": args.speculative_config,
        "batch": n,
        "steps": steps[0],
        "wall_ms_a_step": 1e3 * wall / steps[0],
        "host_ms_a_step": per,
        "gpu_ms_a_step": gpu,
    }
    print(
        f"{args.speculative_config or 'plain'}: {steps[0]} steps, "
        f"{row['wall_ms_a_step']:.3f} ms a step"
    )
    for name, (ms, c) in per.items():
        print(f"    {ms:8.3f} ms a step  {c:6d} calls  {name}")
    row["isolated"] = after_graph_parts(engine)
    row["after_kernels"] = draft_kernels(engine)
    print("    kernels after the sampler, eagerly, by module (nested):", row["after_kernels"])
    for name, ms in row["isolated"].items():
        print(f"    {ms:8.3f} ms on the GPU, in a graph of its own: {name}")
    for name, ms in gpu.items():
        print(f"    {ms:8.3f} ms a step on the GPU  {name}")
    if args.out:
        args.out.write_text(json.dumps(row, indent=1))


if __name__ == "__main__":
    main()
