"""Issue 7's measurements on one model, in one process (one load): the H200's two ceilings, decode
at bs 1 with CUDA graphs and eagerly, decode at bs 16/64/256 with a per-step profile split,
offline throughput as is and with the Engram hash + gather replaced by zero rows, and an 8k-token
prefill against the matmul rate.

    python benchmarks/gpu_runner.py --model /tmp/m1b --out m1b.json [--quick]

The split comes from torch.profiler over eager decode steps: the GPU time of the kernels each
component launched (record_function ranges put on the modules by hooks, here only), so it sums
GPU work, not launch gaps.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.hash_bench import copy_bandwidth_gbs, median_us
from engramrt.commands.bench_throughput import add_arguments, measure, random_prompts

try:
    from engramrt.commands.bench_throughput import local_engine
except ImportError:  # a tree from before issue 31, measured by engine_core_ab.sh

    def local_engine(args: argparse.Namespace, max_len: int) -> Engine:
        from engramrt.commands.bench_throughput import _options
        from engramrt.commands.serve import build_stage

        return build_stage(_options(args, max_len))[1]


from engramrt.engine.engine import Engine
from engramrt.engine.request import SamplingParams

ACTIVITIES = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])]
LABELS = ("engram_hash", "engram", "attention", "ffn", "block", "head", "sample", "step")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def matmul_tflops(device: str, n: int = 8192) -> float:
    """Measured ceiling: bf16 [n, n] @ [n, n] on random data, median of 10 after 3 warm-ups."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    us = median_us(lambda: a @ b, device, reps=10)
    return 2 * n**3 / us / 1e6


def engine_for(model: str, max_len: int, device: str, *flags: str) -> Engine:
    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(
        [
            "--model",
            model,
            "--device",
            device,
            "--max-num-seqs",
            "256",
            "--max-num-batched-tokens",
            "8192",
            *flags,
        ]
    )
    return local_engine(args, max_len)


@contextlib.contextmanager
def eager(engine: Engine):
    runner = engine.pipeline.runner
    graphs, runner.graphs = runner.graphs, None
    try:
        yield
    finally:
        runner.graphs = graphs


def recapture(engine: Engine) -> None:
    runner = engine.pipeline.runner
    if runner.graphs is None:
        return
    runner.graphs = None
    gc.collect()
    torch.cuda.empty_cache()
    runner.capture_graphs(256)


def latency(engine: Engine, bs: int, inp: int, out: int, seed: int = 0) -> dict:
    rng = random.Random(seed)
    return measure(engine, random_prompts(rng, [inp] * bs, engine.vocab_size), [out] * bs)


def _wrap(obj, attr: str, label: str) -> None:
    fn = getattr(obj, attr)

    def wrapped(*a, **k):
        with record_function(label):
            return fn(*a, **k)

    setattr(obj, attr, wrapped)


def _hooks(module: torch.nn.Module, label: str) -> list:
    stack = []

    def pre(m, a):
        rf = record_function(label)
        rf.__enter__()
        stack.append(rf)

    def post(m, a, o):
        stack.pop().__exit__(None, None, None)

    return [module.register_forward_pre_hook(pre), module.register_forward_hook(post)]


def profile_split(engine: Engine, bs: int, inp: int, steps: int = 6) -> dict:
    """ms of GPU kernel time per eager decode step, by component."""
    runner = engine.pipeline.runner
    rng = random.Random(bs)
    for i, p in enumerate(random_prompts(rng, [inp] * bs, engine.vocab_size)):
        engine.add_request(
            f"p{i}", p, SamplingParams(max_tokens=steps + 4, temperature=0, ignore_eos=True)
        )
    started = set()
    while len(started) < bs:  # prefill (chunked) until every request has its first token
        started |= {o.request_id for o in engine.step()}
    handles = []
    for block in runner.model.layers.values():
        handles += _hooks(block, "block") + _hooks(block.attn, "attention")
        handles += _hooks(block.ffn, "ffn")
        if block.engram is not None:
            handles += _hooks(block.engram, "engram")
    wrapped = [
        (runner.hasher, "decode", "engram_hash"),
        (runner.model, "logits", "head"),
        (runner.sampler, "launch", "sample"),
    ]
    saved = [obj.__dict__.get(attr) for obj, attr, _ in wrapped]
    for obj, attr, label in wrapped:
        _wrap(obj, attr, label)
    try:
        with eager(engine):
            engine.step()  # warm
            sync()
            with profile(activities=ACTIVITIES) as prof:
                for _ in range(steps):
                    with record_function("step"):
                        engine.step()
                sync()
    finally:
        for h in handles:
            h.remove()
        for (obj, attr, _), was in zip(wrapped, saved, strict=True):
            if was is None:  # a method of the class: drop the instance's wrapper
                obj.__dict__.pop(attr, None)
            else:  # an attribute of the instance: put it back
                setattr(obj, attr, was)
    while engine.has_work():
        engine.step()
    ms, host = dict.fromkeys(LABELS, 0.0), dict.fromkeys(LABELS, 0.0)
    for e in prof.events():
        if e.name in ms and e.device_type == torch.autograd.DeviceType.CPU:
            ms[e.name] += e.device_time_total / 1e3 / steps
            host[e.name] += e.cpu_time_total / 1e3 / steps
    ms["mhc_and_norms"] = ms["block"] - ms["engram"] - ms["attention"] - ms["ffn"]
    ms["host_ms"] = host  # CPU time in each range (launch and Python cost)
    # every kernel by name: Triton's launches may escape the ranges above, their names do not
    kernels = {
        a.key: a.self_device_time_total / 1e3 / steps
        for a in prof.key_averages()
        # LABELS: the ranges' own GPU-side annotations
        if a.device_type == torch.autograd.DeviceType.CUDA and a.key not in LABELS
    }
    ms["kernels_total"] = sum(kernels.values())
    ms["kernels"] = dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:25])
    return ms


@contextlib.contextmanager
def zero_engram(engine: Engine):
    """Inside: hash ids and gathered rows are zeros (no hashing, no table reads, no history)."""
    runner = engine.pipeline.runner
    e = runner.model.cfg.engram

    def no_ids(tokens, *a, **k):
        return torch.zeros(
            tokens.numel(), e.num_layers, e.n_hash_cols, dtype=torch.int64, device=tokens.device
        )

    runner.hasher.decode = runner.hasher.extend = no_ids
    for block in runner.model.layers.values():
        if block.engram is not None:
            table = block.engram.embed

            def no_rows(ids, table=table):
                return torch.zeros(
                    ids.shape[0],
                    ids.shape[-1] * table.dim,
                    dtype=table.out_dtype,
                    device=ids.device,
                )

            block.engram.lookup = no_rows
    recapture(engine)
    try:
        yield
    finally:
        for obj in (runner.hasher, *(b.engram for b in runner.model.layers.values())):
            if obj is not None:  # the instance attributes set above hid the class's methods
                for attr in ("decode", "extend", "lookup"):
                    obj.__dict__.pop(attr, None)
        recapture(engine)


def prefill_flops(engine: Engine, tokens: int) -> float:
    model = engine.pipeline.runner.model
    cfg = model.cfg
    matmul = sum(
        p.numel()
        for n, p in model.named_parameters()
        if p.dim() == 2 and not n.startswith("embed.")
    )
    attn = (
        2 * 2 * cfg.num_layers * cfg.body.num_heads * cfg.body.head_dim * tokens * (tokens + 1) / 2
    )
    return 2 * matmul * tokens + attn


def save(path: str, res: dict) -> None:
    """After every measurement: a run cut short keeps what it measured."""
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    ap.add_argument("--device", default="cuda", help="cpu: try the script, numbers mean nothing")
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        help="overlap host and GPU (default: the engine's, on)",
    )
    args = ap.parse_args()
    dev = args.device
    name = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    res: dict = {"device": name, "torch": torch.__version__}
    if dev == "cuda":
        res["copy_gb_s"] = copy_bandwidth_gbs(dev)
    res["matmul_tflops"] = matmul_tflops(dev, 8192 if dev == "cuda" else 512)
    t0 = time.perf_counter()
    flags = (
        []
        if args.async_scheduling is None
        else ["--async-scheduling" if args.async_scheduling else "--no-async-scheduling"]
    )
    engine = engine_for(args.model, args.max_len, dev, *flags)
    res["async_scheduling"] = engine.overlap
    res["load_s"] = time.perf_counter() - t0
    res["kv_blocks"] = engine.cfg.num_blocks
    save(args.out, res)
    inp, out = (64, 16) if args.quick else (512, 128)
    res["bs1_graph"] = latency(engine, 1, inp, out)
    with eager(engine):
        res["bs1_eager"] = latency(engine, 1, inp, out)
    res["bs1_split"] = profile_split(engine, 1, inp)
    save(args.out, res)
    for bs in (16, 64) if args.quick else (16, 64, 256):
        res[f"bs{bs}_graph"] = latency(engine, bs, inp, out)
        res[f"bs{bs}_split"] = profile_split(engine, bs, inp)
        save(args.out, res)
    rng = random.Random(0)
    n = 16 if args.quick else 256
    ins = [rng.randint(100, 1024) for _ in range(n)]
    outs = [rng.randint(100, 1024) for _ in range(n)]
    if args.quick:
        ins, outs = [i // 8 for i in ins], [o // 8 for o in outs]
    prompts = random_prompts(rng, ins, engine.vocab_size)
    # a whole untimed pass first (kernel variants compiled on first use), then as is, zero rows
    # and as is again, alternated
    res["offline_warmup"] = measure(engine, prompts, outs)
    res["offline"] = measure(engine, prompts, outs)
    save(args.out, res)
    with zero_engram(engine):
        res["offline_zero_engram"] = measure(engine, prompts, outs)
    res["offline_again"] = measure(engine, prompts, outs)
    save(args.out, res)
    long = args.max_len - 2  # the warm-up asks two tokens of the same prompt
    prompt = random_prompts(random.Random(1), [long], engine.vocab_size)
    s = measure(engine, prompt, [1])["prefill_s"]
    tflops = prefill_flops(engine, long) / s / 1e12
    res["prefill_long"] = {"tokens": long, "s": s, "tok_s": long / s, "tflops": tflops}
    save(args.out, res)
    print(json.dumps({k: v for k, v in res.items() if not isinstance(v, dict)}))
    for k, v in res.items():
        if isinstance(v, dict):
            print(k, {a: round(b, 3) if isinstance(b, float) else b for a, b in v.items()})


if __name__ == "__main__":
    main()
