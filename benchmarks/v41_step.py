"""The first V4.1 numbers (issue 33): the torch path's decode step at bs 1 and 64 against its
byte floor, a 4k-token prefill, and greedy agreement between CPU float32 and GPU bfloat16.

    python benchmarks/v41_step.py --model /tmp/v41w --out v41w.json [--agree-tokens 8]

The floor of a decode step is the bytes it must read once (every attention weight as stored, the
routed experts the batch reaches and the shared one, norms, mixes, the Engram rows and the head;
the caches are small next to them) over the copy bandwidth measured in the same run. The torch
path dequantises every FP8/FP4 weight on each use, so it is far above that floor: issue 34's
kernels read the weights as stored.

``--prefill N`` also counts the prefill's FLOPs (every linear a token passes, the routed experts
its top-k reaches, attention over its window and picks, the indexer's scores over every entry it
sees) against the matmul rates measured in the same run (bf16 ``torch.mm`` and FP8
``torch._scaled_mm`` at the prefill's size), and ``--profile`` profiles it too. ``--engram-cost``
ends with the decode steps from graphs with the Engram on, every Engram layer skipped
(``--engram off``) and on again: the Engram's end-to-end cost.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import time

import torch

from benchmarks.hash_bench import copy_bandwidth_gbs
from engramrt.kernels import FORCE_TORCH_ENV
from engramrt.models.deepseek_v41.config import REINDEX, SOURCE
from engramrt.models.deepseek_v41.quant import StoredLinear
from engramrt.runner.batch import StepBatch
from engramrt.runner.stage import StageRunner

BLOCK = 16


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def weight_bytes(runner: StageRunner, experts: int) -> int:
    """Bytes a decode step reads from the weights when each layer's tokens reach ``experts``
    routed experts: everything but the unreached experts and the embedding (one row a token)."""
    model, total = runner.model, 0
    for name, t in model.state_dict().items():
        if ".engram.embed." in name or name.startswith("embed."):
            continue
        if ".ffn.experts." in name and int(name.split(".ffn.experts.")[1].split(".")[0]) >= experts:
            continue  # the unreached experts (which ones does not change the count)
        total += t.numel() * t.element_size()
    return total


class Session:
    """Requests in slots on a runner, stepped by hand (each slot on its own blocks)."""

    def __init__(self, runner: StageRunner, slots: int, max_len: int):
        self.runner, self.per = runner, -(-max_len // BLOCK)
        runner.allocate_kv(slots, max_len, BLOCK, slots * self.per)
        self.pos: dict[int, int] = {}

    def step(self, runs: dict[int, list[int]]) -> list[int]:
        slots = list(runs)
        starts = [self.pos.get(s, 0) for s in slots]
        lens = [len(runs[s]) for s in slots]
        new = [
            list(range(s * self.per + -(-p // BLOCK), s * self.per + -(-(p + n) // BLOCK)))
            for s, p, n in zip(slots, starts, lens, strict=True)
        ]
        have = [-(-p // BLOCK) for p in starts]
        tokens = [t for s in slots for t in runs[s]]
        batch = StepBatch(tokens, slots, lens, starts, new_blocks=new, block_starts=have)
        out = self.runner.run(batch)
        for s, n in zip(slots, lens, strict=True):
            self.pos[s] = self.pos.get(s, 0) + n
        return out.tokens


def prompt(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, min(vocab, 1000)) for _ in range(n)]


def prefilled(
    runner: StageRunner, bs: int, context: int, steps: int, graphs: bool
) -> tuple[Session, dict[int, int]]:
    """``bs`` requests each prefilled with ``context`` tokens, room for ``steps`` more, and each
    one's next token; ``graphs``: decode graphs captured after the prefill."""
    vocab = runner.model.cfg.vocab_size
    s = Session(runner, bs, context + steps + 4)
    last = {b: s.step({b: prompt(context, b, vocab)})[0] for b in range(bs)}
    if graphs:
        runner.capture_graphs(bs)
    return s, last


def decode_ms(
    runner: StageRunner, bs: int, context: int, steps: int, graphs: bool = False
) -> list[float]:
    """Per-step wall times of ``steps`` decode steps of ``bs`` requests after a prefill of
    ``context`` tokens each (the first two steps are warm-up); ``graphs``: replayed from CUDA
    graphs captured after the prefill."""
    s, last = prefilled(runner, bs, context, steps, graphs)
    times = []
    for _ in range(steps + 2):
        sync()
        t0 = time.perf_counter()
        out = s.step({b: [last[b]] for b in range(bs)})
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
        last = dict(enumerate(out))
    runner.graphs = None
    return times[2:]


def profile_decode(runner: StageRunner, bs: int, context: int, path: str) -> None:
    """One warmed decode step replayed from its CUDA graph under torch.profiler (CUPTI sees the
    kernels inside a graph): its kernels by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    s, last = prefilled(runner, bs, context, 4, graphs=True)
    last = dict(enumerate(s.step({b: [last[b]] for b in range(bs)})))
    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        s.step({b: [last[b]] for b in range(bs)})
        sync()
    table = prof.key_averages()
    with open(path, "w") as f:
        f.write(table.table(sort_by="cuda_time_total", row_limit=40) + "\n")
        f.write(table.table(sort_by="cpu_time_total", row_limit=40) + "\n")
    runner.graphs = None


def prefill_flops(runner: StageRunner, tokens: int) -> float:
    """FLOPs of one prefill of ``tokens``: 2 x inputs x outputs a linear and a token (a routed
    expert's times the share of tokens that reach it), 4 x head_dim a query head and a row it
    attends (scores and values; window and picks), 2 x the indexer's heads x dim a visible
    entry (a token at position p sees p // ratio)."""
    v = runner.model.cfg.v41
    share = v.n_activated_experts / v.n_routed_experts
    total = 0.0
    for name, mod in runner.model.named_modules():
        if isinstance(mod, StoredLinear):
            out, inp = mod.weight.shape[0], mod.weight.shape[1] * (2 if mod.fp4 else 1)
        elif isinstance(mod, torch.nn.Linear):
            out, inp = mod.weight.shape
        else:
            continue
        if name == "head" or name.endswith(".head"):
            continue  # logits at the last token only
        total += 2 * out * inp * tokens * (share if ".experts." in name else 1)
    attended = sum(
        min(v.window_size, p + 1) + (min(v.index_topk, (p + 1) // r.ratio) if r.ratio else 0)
        for r in (v.roles[i] for i in runner.model.layer_ids)
        for p in range(tokens)
    )
    total += 4 * v.head_dim * v.n_heads * attended
    scanned = sum(
        tokens * tokens / (2 * r.ratio)
        for r in (v.roles[i] for i in runner.model.layer_ids)
        if r.kind in (SOURCE, REINDEX)
    )
    return total + 2 * v.index_n_heads * v.index_head_dim * scanned


def matmul_tflops(tokens: int, dim: int, device: str) -> dict[str, float]:
    """Measured matmul rates at a prefill's size: bf16 ``torch.mm`` and FP8 (E4M3)
    ``torch._scaled_mm`` of [tokens, dim] x [dim, dim]."""
    from benchmarks.hash_bench import median_us

    a = torch.randn(tokens, dim, device=device, dtype=torch.bfloat16)
    b = torch.randn(dim, dim, device=device, dtype=torch.bfloat16)
    flops = 2 * tokens * dim * dim
    rates = {"bf16": flops / median_us(lambda: a @ b, device) / 1e6}
    a8, b8 = a.to(torch.float8_e4m3fn), b.t().contiguous().to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    rates["fp8"] = (
        flops
        / median_us(lambda: torch._scaled_mm(a8, b8, one, one, out_dtype=torch.bfloat16), device)
        / 1e6
    )
    return rates


def profile_prefill(runner: StageRunner, tokens: int, path: str) -> None:
    """One warmed prefill under torch.profiler: its kernels by GPU time."""
    from torch.profiler import ProfilerActivity, profile

    prefill_ms(runner, tokens, reps=0)
    s = Session(runner, 1, tokens + 1)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        s.step({0: prompt(tokens, 7, runner.model.cfg.vocab_size)})
        sync()
    with open(path, "w") as f:
        f.write(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40) + "\n")


def prefill_ms(runner: StageRunner, tokens: int, reps: int = 2) -> list[float]:
    times = []
    for r in range(reps + 1):
        s = Session(runner, 1, tokens + 1)
        sync()
        t0 = time.perf_counter()
        s.step({0: prompt(tokens, 100 + r, runner.model.cfg.vocab_size)})
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return times[1:]


def greedy(runner: StageRunner, tokens: list[int], n: int) -> list[int]:
    s = Session(runner, 1, len(tokens) + n + 1)
    out = s.step({0: tokens})
    for _ in range(n - 1):
        out += s.step({0: out[-1:]})
    return out


def forced(runner: StageRunner, tokens: list[int]) -> torch.Tensor:
    """fp32 logits at every position of one prefill of ``tokens`` (teacher forcing)."""
    s = Session(runner, 1, len(tokens) + 1)
    batch = StepBatch(tokens, [0], [len(tokens)], [0], new_blocks=[list(range(s.per))])
    return s.runner.compute(batch).float().cpu()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=256, help="prompt tokens of each decoding row")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--agree-prompts", type=int, default=4)
    ap.add_argument("--agree-tokens", type=int, default=32)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--torch-too", action="store_true", help="decode on the torch path as well")
    ap.add_argument(
        "--engram-cost", action="store_true", help="decode again with every Engram layer skipped"
    )
    ap.add_argument("--engram-steps", type=int, default=30, help="decode steps an Engram arm")
    ap.add_argument(
        "--profile",
        help="write a torch.profiler table of one decode step per "
        "batch size here (where the step's time goes: kernels or the host)",
    )
    args = ap.parse_args()
    report: dict = {"model": args.model}
    gpu = StageRunner.load(args.model, 64, None, args.device, "bfloat16", num_blocks=0)
    cfg = gpu.model.cfg
    report["copy_gbs"] = bw = copy_bandwidth_gbs(args.device)
    stored = sum(
        m.weight.numel() + m.scale.numel()
        for m in gpu.model.modules()
        if isinstance(m, StoredLinear)
    )
    report["stored_linear_bytes"] = stored
    report["decode"] = {}
    for bs in map(int, args.batches.split(",")):
        reached = min(cfg.body.n_routed_experts, bs * cfg.body.n_activated_experts)
        floor_ms = weight_bytes(gpu, reached) / (bw * 1e9) * 1e3
        row = report["decode"][bs] = {"floor_ms": floor_ms, "experts_reached": reached}
        paths = ("graphs", "kernels", "torch") if args.torch_too else ("graphs", "kernels")
        for path in paths:
            if path == "torch":  # every kernel's torch reference (engramrt.kernels.use_triton)
                os.environ[FORCE_TORCH_ENV] = "1"
            times = decode_ms(gpu, bs, args.context, args.steps, graphs=path == "graphs")
            os.environ.pop(FORCE_TORCH_ENV, None)
            med = statistics.median(times)
            gbs = floor_ms / med * bw  # the weight bytes a step must read, over its time
            row[path] = {"ms": times, "median_ms": med, "x_floor": med / floor_ms, "gbs": gbs}
            print(
                f"decode bs {bs} ({path}): {med:.2f} ms a step, floor {floor_ms:.2f} ms "
                f"({med / floor_ms:.1f}x, {gbs:.0f} GB/s = {gbs / bw:.1%} of copy)",
                flush=True,
            )
        if args.profile:
            profile_decode(gpu, bs, args.context, f"{args.profile}-bs{bs}.txt")
    if args.prefill:
        times = prefill_ms(gpu, args.prefill)
        flops = prefill_flops(gpu, args.prefill)
        rates = matmul_tflops(args.prefill, cfg.hidden_size, args.device)
        got = flops / min(times) / 1e9
        report["prefill"] = {
            "tokens": args.prefill,
            "ms": times,
            "flops": flops,
            "tflops": got,
            "matmul_tflops": rates,
        }
        print(
            f"prefill {args.prefill}: {min(times):.0f} ms "
            f"({args.prefill / min(times) * 1e3:.0f} tok/s); {flops / 1e12:.1f} TFLOP, "
            f"{got:.1f} TFLOP/s = {got / rates['bf16']:.1%} of bf16 mm "
            f"({rates['bf16']:.0f}), {got / rates['fp8']:.1%} of FP8 mm "
            f"({rates['fp8']:.0f})",
            flush=True,
        )
        if args.profile:
            profile_prefill(gpu, args.prefill, f"{args.profile}-prefill.txt")
    # greedy agreement: GPU bf16 against CPU fp32 on the same prompts
    cpu = StageRunner.load(args.model, 1, None, "cpu", "float32", num_blocks=0)
    rows = []
    for i in range(args.agree_prompts):
        p = prompt(48, 1000 + i, cfg.vocab_size)
        a, b = greedy(gpu, p, args.agree_tokens), greedy(cpu, p, args.agree_tokens)
        same = next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        # the same tokens (prompt + CPU's greedy ones) through both: per-position agreement
        ref, got = forced(cpu, p + b), forced(gpu, p + b)
        top = (ref.argmax(-1) == got.argmax(-1)).float().mean().item()
        rel = ((got - ref).norm(dim=-1) / ref.norm(dim=-1)).median().item()
        rows.append(
            {
                "gpu_bf16": a,
                "cpu_fp32": b,
                "identical_prefix": same,
                "forced_top1_agreement": top,
                "forced_median_rel_err": rel,
            }
        )
        print(
            f"prompt {i}: {same}/{len(a)} greedy tokens identical before the first "
            f"difference; teacher-forced top-1 agreement {top:.1%}, median relative logit "
            f"error {rel:.3f}",
            flush=True,
        )
    report["agreement"] = rows
    if args.engram_cost:  # on, off, on again: graphs captured anew each time
        for bs in map(int, args.batches.split(",")):
            runs = {}
            for arm in ("on", "off", "on again"):
                gpu.model.disable_engram(arm == "off")
                runs[arm] = statistics.median(
                    decode_ms(gpu, bs, args.context, args.engram_steps, graphs=True)
                )
            report["decode"][bs]["engram"] = runs
            on = (runs["on"] + runs["on again"]) / 2
            print(
                f"decode bs {bs} (graphs): Engram on {runs['on']:.2f} / {runs['on again']:.2f} "
                f"ms, every Engram layer skipped {runs['off']:.2f} ms: the Engram costs "
                f"{on / runs['off'] - 1:.1%} of a step",
                flush=True,
            )
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
