"""``engramrt bench throughput``: the engine in-process, no HTTP.

Throughput mode follows nano-vllm's protocol (256 requests, input and output lengths uniform in
100-1024, random token ids, EOS ignored) and prints tokens/s. Latency mode (``--batch-size``)
runs one batch of equal requests and reports decode tokens/s and the memory traffic a decode step
must cause (every weight once, the batch's KV cache, the Engram rows it gathers) as achieved GB/s.
With ``-tp``/``-pp`` the engine drives its ranks as ``serve`` does; the bytes are rank 0's (its
layers, its slices): the traffic per GPU. ``--profile`` runs the same requests again under
torch.profiler and prints where a step's time goes; ``--output-json`` saves the numbers.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from engramrt.commands.flags import options_from_args
from engramrt.engine.build import EngineOptions, build_stage
from engramrt.engine.engine import Engine
from engramrt.engine.request import SamplingParams


def add_arguments(p: argparse.ArgumentParser) -> None:
    from engramrt.commands.flags import (
        add_dist_flags,
        add_engram_memory_flags,
        add_memory_flags,
        add_scheduling_flags,
    )

    p.add_argument("--model", help="model directory (default: the bundled model)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available")
    p.add_argument("--dtype", choices=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=256)
    p.add_argument("--min-input-len", type=int, default=100)
    p.add_argument("--max-input-len", type=int, default=1024)
    p.add_argument("--min-output-len", type=int, default=100)
    p.add_argument("--max-output-len", type=int, default=1024)
    p.add_argument("--batch-size", type=int, help="latency mode: one batch of this many requests")
    p.add_argument("--input-len", type=int, default=128, help="latency mode")
    p.add_argument("--output-len", type=int, default=128, help="latency mode")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks-override", type=int)
    add_memory_flags(p)
    add_scheduling_flags(p)
    add_engram_memory_flags(p)
    add_dist_flags(p)
    p.add_argument(
        "--prompt-kind",
        choices=["random", "repeat"],
        default="random",
        help="repeat: a random 16-token phrase repeated to the input length (a workload where "
        "n-gram drafts can be right)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--profile",
        action="store_true",
        help="run the requests again under torch.profiler: a step's wall time against its GPU "
        "kernels' time, and the costliest kernels (operators on a CPU); the profiler slows the "
        "host, so its wall times run high",
    )
    p.add_argument("--output-json", help="also write the results to this JSON file")


def options(args: argparse.Namespace, max_len: int) -> EngineOptions:
    """The engine these flags ask for, sized for requests of ``max_len`` tokens (no prefix
    caching: random prompts share nothing, and a benchmark must not reuse its own warm-up)."""
    from engramrt.bundled import resolve_model_dir
    from engramrt.commands.flags import resolve_device

    return options_from_args(
        args,
        resolve_model_dir(args.model),
        device=resolve_device(args.device),
        max_model_len=max_len,
        enable_prefix_caching=False,
    )


def local_engine(args: argparse.Namespace, max_len: int) -> Engine:
    """The engine of ``options`` with every stage in this process (the benchmarks' entry)."""
    return build_stage(options(args, max_len))[1]


def _run(engine: Engine, prompts: list[list[int]], outputs: list[int]) -> tuple[float, float, int]:
    """Seconds until every request has its first token, and until all are done; engine steps."""
    for i, (p, n) in enumerate(zip(prompts, outputs, strict=True)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
    start, first, started, steps = time.perf_counter(), None, set(), 0
    while engine.has_work():
        steps += 1
        for out in engine.step():
            started.add(out.request_id)
        if first is None and len(started) == len(prompts):
            first = time.perf_counter()
    end = time.perf_counter()
    return (first or end) - start, end - start, steps


def decode_bytes(engine: Engine, batch: int, context: int) -> int:
    """What one decode step must read: every weight but the Engram tables, the batch's K/V up to
    ``context`` tokens, and the Engram rows of the batch's tokens."""
    model = engine.pipeline.runner.model  # rank 0's layers and slices
    cfg = model.cfg
    weights = sum(
        t.numel() * t.element_size() for n, t in model.held_tensors() if ".engram.embed." not in n
    )
    kv = batch * cfg.family.decode_read_bytes(model, context)
    rows = 0
    for i in model.engram_layer_ids:
        engram = model.layers[str(i)].engram
        table = engram.embed.weight
        row = engram.head_dim * table.element_size()
        row += engram.head_dim // 32 if table.element_size() == 1 else 0  # e8m0 scales
        rows += (engram.col_span[1] - engram.col_span[0]) * row
    return weights + kv + batch * rows


def random_prompts(
    rng: random.Random, lens: list[int], vocab: int, kind: str = "random"
) -> list[list[int]]:
    special = 6  # the bundled tokenizer's special tokens come first
    if kind == "repeat":
        phrases = [[rng.randrange(special, vocab) for _ in range(16)] for _ in lens]
        return [(p * -(-n // 16))[:n] for p, n in zip(phrases, lens, strict=True)]
    return [[rng.randrange(special, vocab) for _ in range(n)] for n in lens]


def measure(engine: Engine, prompts: list[list[int]], out_lens: list[int]) -> dict[str, float]:
    """One timed run (after a two-token warm-up): throughput, and the decode rate of a batch of
    equal requests (``decode_*``: the steps after every request's first token)."""
    _run(engine, prompts[:1], [2])  # warm-up (kernel compilation, allocator)
    prefill_s, total_s, _ = _run(engine, prompts, out_lens)
    total_in, total_out = sum(map(len, prompts)), sum(out_lens)
    res = {
        "requests": len(prompts),
        "prompt_tokens": total_in,
        "output_tokens": total_out,
        "total_s": total_s,
        "prefill_s": prefill_s,
        "output_tok_s": total_out / total_s,
        "total_tok_s": (total_in + total_out) / total_s,
    }
    steps = max(out_lens[0] - 1, 1)
    step_bytes = decode_bytes(engine, len(prompts), len(prompts[0]) + out_lens[0] // 2)
    decode_s = max(total_s - prefill_s, 1e-9)
    res.update(
        decode_tok_s=len(prompts) * steps / decode_s,
        decode_step_ms=1e3 * decode_s / steps,
        step_bytes=step_bytes,
        achieved_gb_s=step_bytes * steps / decode_s / 1e9,
    )
    return res


def profile_run(
    engine: Engine, prompts: list[list[int]], out_lens: list[int], top: int = 15
) -> dict:
    """The requests run again under torch.profiler: a step's wall time against the summed time
    of its GPU kernels (graph replays included; on a CPU its operators' own time), and the
    ``top`` costliest by name, each with its calls and ms a step."""
    from torch.profiler import ProfilerActivity, profile

    cuda = engine.pipeline.runner.device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]
    with profile(activities=activities) as prof:
        _, wall, steps = _run(engine, prompts, out_lens)
    if cuda:  # kernels: what ran on the GPU, not the operators that launched it
        costs = [
            (e.key, e.count, e.self_device_time_total)
            for e in prof.key_averages()
            if e.self_device_time_total > 0 and not e.key.startswith(("aten::", "cuda"))
        ]
    else:
        costs = [(e.key, e.count, e.self_cpu_time_total) for e in prof.key_averages()]
    costs.sort(key=lambda c: -c[2])
    steps = max(steps, 1)
    return {
        "steps": steps,
        "wall_ms_a_step": 1e3 * wall / steps,
        "kernel_ms_a_step": sum(c[2] for c in costs) / 1e3 / steps if cuda else None,
        "top": [
            {"name": name, "calls_a_step": n / steps, "ms_a_step": us / 1e3 / steps}
            for name, n, us in costs[:top]
        ],
    }


def format_profile(prof: dict) -> str:
    kernels = prof["kernel_ms_a_step"]
    what = "kernel" if kernels is not None else "operator"
    lines = [
        f"Profile ({prof['steps']} engine steps under torch.profiler): a step "
        f"{prof['wall_ms_a_step']:.3f} ms wall"
        + (f", its GPU kernels {kernels:.3f} ms" if kernels is not None else ""),
        f"{'ms a step':>10} {'calls a step':>13}  {what}",
    ]
    for t in prof["top"]:
        lines.append(f"{t['ms_a_step']:>10.3f} {t['calls_a_step']:>13.1f}  {t['name'][:90]}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    rng = random.Random(args.seed)
    if args.batch_size:
        prompts_n, in_lens = args.batch_size, [args.input_len] * args.batch_size
        out_lens = [args.output_len] * args.batch_size
    else:
        prompts_n = args.num_prompts
        in_lens = [rng.randint(args.min_input_len, args.max_input_len) for _ in range(prompts_n)]
        out_lens = [rng.randint(args.min_output_len, args.max_output_len) for _ in range(prompts_n)]
    if min(in_lens + out_lens, default=0) < 1:
        raise ValueError("input and output lengths must be >= 1")
    from engramrt.parallel.launch import launch

    opts = options(args, max(i + o for i, o in zip(in_lens, out_lens, strict=True)))
    launch(opts.dist, _worker, opts, args, rng, in_lens, out_lens)
    return 0


def _worker(rank: int, world: int, opts, args, rng, in_lens, out_lens) -> None:
    pipe, engine = build_stage(opts, rank, world)
    if engine is None:
        pipe.serve()
        return
    try:
        prompts = random_prompts(rng, in_lens, engine.vocab_size, args.prompt_kind)
        r = measure(engine, prompts, out_lens)
        prof = profile_run(engine, prompts, out_lens) if args.profile else None
    finally:
        pipe.stop()
    prompts_n = len(in_lens)
    print(
        f"engramrt bench throughput ({Path(str(engine.pipeline.runner.device))}, "
        f"PP {opts.dist.pp_size} x TP {opts.dist.tp_size}): {prompts_n} requests, "
        f"{r['prompt_tokens']} prompt + {r['output_tokens']} generated tokens"
    )
    print(f"Total time (s): {r['total_s']:.2f}")
    print(f"Throughput (requests/s): {prompts_n / r['total_s']:.2f}")
    print(f"Output token throughput (tok/s): {r['output_tok_s']:.2f}")
    print(f"Total token throughput (tok/s): {r['total_tok_s']:.2f}")
    if args.batch_size:
        print(f"Prefill time (s): {r['prefill_s']:.3f}")
        print(f"Decode tokens/s: {r['decode_tok_s']:.2f}")
        print(f"Decode step (ms): {r['decode_step_ms']:.3f}")
        print(f"Bytes per decode step (MB): {r['step_bytes'] / 1e6:.2f}")
        print(f"Achieved bandwidth (GB/s): {r['achieved_gb_s']:.2f}")
    stats = engine.stats()
    if stats["spec_decode_num_drafts"]:
        drafted, taken = (
            stats["spec_decode_num_draft_tokens"],
            stats["spec_decode_num_accepted_tokens"],
        )
        runs = stats["spec_decode_num_drafts"]
        per_pos = [n / runs for n in stats["spec_decode_num_accepted_tokens_per_pos"]]
        print(
            f"Speculative drafts: {drafted} tokens in {runs} runs, {taken} accepted "
            f"({100 * taken / drafted:.1f}%); {1 + taken / runs:.2f} tokens a verify step; "
            f"accepted at each position: {' '.join(f'{a:.2f}' for a in per_pos)}"
        )
    if prof is not None:
        print(format_profile(prof))
    if args.output_json:
        out = {
            "model": str(args.model or "bundled"),
            "batch_size": args.batch_size,
            **r,
            "profile": prof,
        }
        Path(args.output_json).write_text(json.dumps({**out, "engine_stats": stats}, indent=1))
