"""The named suites ``python -m benchmarks.run`` runs: each measures one thing a user asks about
(a decode step, a prefill, serving under load, speculation) on a preset model, with the
comparison that makes the number readable measured in the same run (the byte floor at the copy
rate, the matmul rate, the same engine without the feature), and records it in a ``Record``.

Engines are the ones ``engramrt bench throughput`` builds from its flags (the JSON keeps them);
the models are ``benchmarks/make_models.py``'s presets, written once under ``--models``.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import cases, kernels
from benchmarks.common import Record, ceilings
from benchmarks.table import fmt


@dataclass
class Context:
    """How a suite runs: the device, the tiny sizes of a CPU smoke run, where presets live, a
    model that replaces the suite's preset."""

    device: str
    tiny: bool = False
    check: bool = False
    models: Path = Path("/tmp/engramrt-models")
    model: Path | None = None

    def preset(self, name: str, tiny_model: Path) -> Path:
        if self.model is not None:
            return self.model
        if self.tiny:
            return tiny_model
        print(f"preset {name} under {self.models} (written once)", flush=True)
        return cases.ensure_preset(name, self.models, self.device)


@dataclass(frozen=True)
class Suite:
    name: str
    about: str
    run: Callable[[Record, Context], bool]
    timeout_s: int  # its limit in a run of several suites (``--suite all``: ten minutes)
    needs: tuple[str, ...] = ()  # Python packages besides the engine's
    in_all: bool = True


def free() -> None:
    """Give the GPU memory of engines the caller has dropped (CUDA graph pools included) back."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# =========================================================================== kernels


def kernel_suite(rec: Record, ctx: Context) -> bool:
    check_only = ctx.check or ctx.tiny or ctx.device != "cuda"
    return kernels.run(rec, ctx.device, check_only=check_only)


# =========================================================================== decode


def decode(
    rec: Record,
    ctx: Context,
    model: Path,
    label: str,
    batches: tuple[int, ...],
    in_len: int,
    out_len: int,
    engram_cost: bool = True,
) -> bool:
    """Decode steps of ``batches`` equal requests (``bench throughput``'s latency mode: CUDA
    graphs, overlap scheduling) against their byte floor; ``engram_cost``: at the first and the
    last batch size also an engine with every Engram layer skipped, measured between two runs
    of the first."""
    ceil = ceilings(ctx.device)
    rec["ceilings"] = ceil
    bw = ceil["copy_gbs"]
    flags = ["--max-num-seqs", str(max(batches)), "--max-num-batched-tokens", "8192"]
    if engram_cost and ctx.device == "cuda":  # two engines side by side
        flags += ["--kv-cache-memory-bytes", str(8 * 2**30)]
    args = cases.engine_args(model, ctx.device, *flags)
    rec["engine"] = {"model": str(model), "flags": flags, "input_len": in_len, "out": out_len}
    eng = cases.engine(args, in_len + out_len)
    off = cases.engine(args, in_len + out_len, engram=False) if engram_cost else None
    context = in_len + out_len // 2  # the mean context of the decode steps
    graphs = ", CUDA graphs" if ctx.device == "cuda" else ""
    for bs in batches:
        prompts = cases.random_prompts(bs, [in_len] * bs, eng.vocab_size)
        r = cases.measure(eng, prompts, [out_len] * bs)
        floor = cases.decode_floor_bytes(eng, bs, context)
        floor_ms = floor / (bw * 1e6)
        row = {
            "batch": bs,
            "step_ms": r["decode_step_ms"],
            "decode_tok_s": r["decode_tok_s"],
            "prefill_s": r["prefill_s"],
            "floor_bytes": floor,
            "floor_ms": floor_ms,
            "x_floor": r["decode_step_ms"] / floor_ms,
            "of_copy": floor_ms / r["decode_step_ms"],
            "bench_throughput_bytes": r["step_bytes"],
        }
        if off is not None and bs in (batches[0], batches[-1]):
            skipped = cases.measure(off, prompts, [out_len] * bs)["decode_step_ms"]
            again = cases.measure(eng, prompts, [out_len] * bs)["decode_step_ms"]
            on = (row["step_ms"] + again) / 2
            row["engram"] = {"on": [row["step_ms"], again], "skipped": skipped}
            row["engram_cost"] = on / skipped - 1
        rec.row(**row)
        cost = f", Engram {row['engram_cost']:+.1%}" if "engram_cost" in row else ""
        print(
            f"{label} bs {bs}: {fmt(row['step_ms'])} ms a step, floor {fmt(floor_ms)} ms "
            f"({row['x_floor']:.1f}x, {row['of_copy']:.0%} of copy){cost}",
            flush=True,
        )
        if bs in (batches[0], batches[-1]):
            engram = (
                f"; every Engram layer skipped: {fmt(row['engram']['skipped'])} ms (the "
                f"Engram {row['engram_cost']:+.1%} of a step)"
                if "engram_cost" in row
                else ""
            )
            rec.headline(
                f"{label} decode step, bs {bs} ({in_len} in, {out_len} out{graphs})",
                row["step_ms"],
                "ms",
                f"{row['x_floor']:.1f}x its byte floor of {fmt(floor_ms)} ms ({floor / 1e9:.2f} "
                f"GB at {fmt(bw)} GB/s copy){engram}",
            )
    prompts = cases.random_prompts(7, [in_len], eng.vocab_size)
    rec["profile_bs1"] = cases.profile(eng, prompts, [min(out_len, 32)])
    del eng, off
    free()
    return True


def torch_path_step(
    rec: Record,
    model: Path,
    device: str,
    flags: list[str],
    label: str,
    in_len: int,
    bs: int,
    out_len: int,
) -> None:
    """The same decode steps with every Triton kernel off (the torch path the kernels are
    tested against; eager: its host syncs cannot be captured), beside the kernels' step."""
    with cases.torch_path():
        args = cases.engine_args(model, device, *flags, "--enforce-eager")
        eng = cases.engine(args, in_len + out_len)
        prompts = cases.random_prompts(bs, [in_len] * bs, eng.vocab_size)
        step = cases.measure(eng, prompts, [out_len] * bs)["decode_step_ms"]
        del eng
        free()
    kernels = next(r["step_ms"] for r in rec["rows"] if r["batch"] == bs)
    rec["torch_path"] = {"batch": bs, "out_len": out_len, "step_ms": step}
    print(f"{label} bs {bs}, the torch path (eager): {fmt(step)} ms a step", flush=True)
    rec.headline(
        f"{label} decode step, bs {bs}, the torch path (eager, no kernels)",
        step,
        "ms",
        f"{step / kernels:.1f}x the kernels' step of {fmt(kernels)} ms (CUDA graphs)",
    )


def _label(ctx: Context, preset: str, tiny: str) -> str:
    if ctx.model is not None:
        return ctx.model.name
    return tiny if ctx.tiny else preset


def gqa_decode(rec: Record, ctx: Context) -> bool:
    model = ctx.preset("4b", cases.GQA_MODEL)
    sizes = ((1, 2), 8, 4) if ctx.tiny else ((1, 16, 64), 512, 128)
    return decode(rec, ctx, model, _label(ctx, "4B GQA", "tiny GQA"), *sizes, engram_cost=False)


def v41_decode(rec: Record, ctx: Context) -> bool:
    model = ctx.preset("v41-wide", cases.BUNDLED_MODEL)
    sizes = ((1, 2), 8, 4) if ctx.tiny else ((1, 16, 64), 512, 128)
    label = _label(ctx, "v41-wide", "tiny V4.1")
    ok = decode(rec, ctx, model, label, *sizes)
    if ctx.device == "cuda":  # (a CPU's census: benchmarks/step_kernels.py, its own test)
        launches(rec, ctx, model, label)
        if not ctx.tiny:  # (on a CPU every path is the torch path)
            torch_path_step(rec, model, ctx.device, rec["engine"]["flags"], label, sizes[1], 1, 16)
    return ok


def launches(rec: Record, ctx: Context, model: Path, label: str) -> None:
    """A bs-1 decode step's launches, by layer and part (``benchmarks/step_kernels.py``)."""
    from benchmarks.step_kernels import census

    c = census(model, ctx.device, [1])[1]
    layers: dict[int, int] = {}
    for (layer, _), n in c.parts.items():
        if layer is not None:
            layers[layer] = layers.get(layer, 0) + n
    parts: dict[str, int] = {}
    for (_, part), n in c.parts.items():
        parts[part] = parts.get(part, 0) + n
    rec["launches_bs1"] = {"step": c.total, "by_layer": layers, "by_part": parts}
    most = max(layers.values(), default=0)
    print(f"{label} bs 1: {c.total} launches a step, at most {most} a layer", flush=True)
    rec.headline(
        f"{label} decode step, bs 1: launches",
        c.total,
        "launches",
        f"{most} in its busiest layer, {sum(layers.values()) / max(1, len(layers)):.0f} a layer "
        f"on average, {c.total - sum(layers.values())} outside the layers",
    )


# =========================================================================== prefill


def v41_prefill(rec: Record, ctx: Context) -> bool:
    """One prompt prefilled from position 0 in one step, its FLOPs over the bf16 and FP8 matmul
    rates measured in the same run (the best of three runs)."""
    model = ctx.preset("v41-wide", cases.BUNDLED_MODEL)
    tokens = 8 if ctx.tiny else 8192
    ceil = ceilings(ctx.device, fp8=True)
    rec["ceilings"] = ceil
    flags = ["--max-num-seqs", "1", "--max-num-batched-tokens", str(tokens)]
    rec["engine"] = {"model": str(model), "flags": flags, "tokens": tokens}
    eng = cases.engine(cases.engine_args(model, ctx.device, *flags), tokens + 2)
    flops = cases.prefill_flops(eng, tokens)
    times = []
    for seed in range(3):
        prompt = cases.random_prompts(seed, [tokens], eng.vocab_size)
        times.append(cases.measure(eng, prompt, [1])["prefill_s"])
    best = min(times)
    tflops = flops / best / 1e12
    row = rec.row(
        tokens=tokens,
        seconds=times,
        tok_s=tokens / best,
        flops=flops,
        tflops=tflops,
        of_matmul=tflops / ceil["matmul_tflops"],
        of_fp8_matmul=tflops / ceil["fp8_matmul_tflops"] if ceil["fp8_matmul_tflops"] else None,
    )
    fp8 = (
        f", {row['of_fp8_matmul']:.1%} of FP8's ({fmt(ceil['fp8_matmul_tflops'])})"
        if row["of_fp8_matmul"]
        else ""
    )
    comparison = (
        f"{fmt(tflops)} TFLOP/s = {row['of_matmul']:.1%} of the bf16 matmul rate "
        f"({fmt(ceil['matmul_tflops'])} TFLOP/s){fp8}; {fmt(tokens / best)} tok/s"
    )
    print(f"prefill of {tokens} tokens: {fmt(best * 1e3)} ms, {comparison}", flush=True)
    label = _label(ctx, "v41-wide", "tiny V4.1")
    rec.headline(f"{label} prefill, one {tokens:,}-token prompt", best * 1e3, "ms", comparison)
    rec["profile"] = cases.profile(eng, cases.random_prompts(9, [tokens], eng.vocab_size), [1])
    del eng
    free()
    return True


# =========================================================================== speculation


def dspark(rec: Record, ctx: Context) -> bool:
    """DSpark on the trained bundled model: acceptance on held-out text and decode tokens/s
    with and without it, the same prompts through both engines (as ``dspark_accept`` did);
    at the largest batch, how many outputs equal plain decoding's under ``--batch-invariant``."""
    model = ctx.model or cases.BUNDLED_MODEL
    k = 5
    sizes = (2,) if ctx.tiny else (1, 16)
    per_kind, max_tokens = (1, 3) if ctx.tiny else (8, 48)
    spec = json.dumps({"method": "dspark", "num_speculative_tokens": k})
    arms = (("plain", None), ("dspark", spec))

    def build(cfg: str | None, *extra: str) -> Any:
        flags = ["--max-num-seqs", str(max(sizes)), *extra]
        flags += ["--kv-cache-memory-bytes", str(2**30)] if ctx.device == "cuda" else []
        flags += ["--speculative-config", cfg] if cfg else []
        return cases.engine(cases.engine_args(model, ctx.device, *flags), 512)

    engines = {name: build(cfg) for name, cfg in arms}
    prompts = cases.held_out_prompts(model, engines["plain"].tokenizer, per_kind)
    prompts = prompts[:2] if ctx.tiny else prompts
    rec["engine"] = {"model": str(model), "k": k, "prompts": len(prompts), "max_tokens": max_tokens}
    for engine in engines.values():  # first-use compilations
        cases.greedy(engine, prompts[:2], 4)
    for bs in sizes:
        row: dict[str, Any] = {"batch": bs, "prompts": len(prompts), "k": k}
        outputs = {}
        for name, engine in engines.items():
            before = dict(engine.stats())
            secs = count = steps = 0.0
            outputs[name] = []
            for lo in range(0, len(prompts), bs):  # batches of bs requests, one after another
                o, s, n, st = cases.greedy(engine, prompts[lo : lo + bs], max_tokens)
                outputs[name] += o
                secs, count, steps = secs + s, count + n, steps + st
            row[f"{name}_tok_s"] = count / secs if secs else None
            row[f"{name}_ms_a_step"] = 1e3 * secs / steps if steps else None
            row[f"{name}_tokens_a_step"] = count / steps if steps else None
            if name == "dspark":
                st = engine.stats()
                runs = st["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
                took = (
                    st["spec_decode_num_accepted_tokens"]
                    - before["spec_decode_num_accepted_tokens"]
                )
                key = "spec_decode_num_accepted_tokens_per_pos"
                per = max(runs, 1)
                row["verify_runs"] = runs
                row["tokens_per_verify"] = 1 + took / per
                row["accepted_per_pos"] = [
                    round((a - b) / per, 3) for a, b in zip(st[key], before[key], strict=True)
                ]
        row["speedup"] = (
            row["dspark_tok_s"] / row["plain_tok_s"]
            if row["dspark_tok_s"] and row["plain_tok_s"]
            else None
        )
        row["same_outputs"] = sum(
            a == b for a, b in zip(outputs["plain"], outputs["dspark"], strict=True)
        )
        rec.row(**row)
        print(json.dumps(row), flush=True)
        if row["speedup"]:
            rec.headline(
                f"DSpark (K = {k}) on the bundled model, bs {bs}, {len(prompts)} held-out prompts",
                row["speedup"],
                "x",
                f"{fmt(row['dspark_tok_s'])} against {fmt(row['plain_tok_s'])} tok/s without "
                f"speculation; {row['tokens_per_verify']:.2f} tokens a verify step; outputs "
                f"equal to plain decoding {row['same_outputs']}/{len(prompts)}",
            )
    engines.clear()
    free()
    # the largest batch again under --batch-invariant (a process-wide switch: one arm's engines
    # at a time), in CUDA graphs and eagerly as the GPU tests run, and each request alone by
    # plain decoding: equal outputs are the flag's promise (a plain batch that parts from its
    # requests alone is a decode step's variance, not DSpark's)
    bs = max(sizes)
    for eager in (False, True) if ctx.device == "cuda" else (True,):
        outputs = {}
        for name, cfg in arms:
            engine = build(cfg, "--batch-invariant", *(["--enforce-eager"] if eager else []))
            for size in (bs, 1) if name == "plain" else (bs,):
                outputs[name, size] = [
                    o
                    for lo in range(0, len(prompts), size)
                    for o in cases.greedy(engine, prompts[lo : lo + size], max_tokens)[0]
                ]
            del engine
            free()

        def equal(a: tuple[str, int], b: tuple[str, int]) -> int:
            return sum(x == y for x, y in zip(outputs[a], outputs[b], strict=True))

        same = equal(("plain", bs), ("dspark", bs))
        alone = {name: equal((name, bs), ("plain", 1)) for name, _ in arms}
        how = "eagerly" if eager else "in CUDA graphs"
        rec.row(
            batch=bs,
            prompts=len(prompts),
            batch_invariant=True,
            graphs=not eager,
            same_outputs=same,
            plain_equal_alone=alone["plain"],
            dspark_equal_alone=alone["dspark"],
        )
        print(
            f"--batch-invariant, {how}: {same}/{len(prompts)} equal; alone equal: plain "
            f"{alone['plain']}, DSpark {alone['dspark']}",
            flush=True,
        )
        rec.headline(
            f"DSpark (K = {k}) on the bundled model under --batch-invariant, bs {bs}, {how}",
            same,
            f"of {len(prompts)} outputs",
            f"equal to plain decoding under the same flag, the same prompts; equal to each "
            f"request decoded alone: plain {alone['plain']}, DSpark {alone['dspark']}",
        )
    cases.batch_invariant_off()
    return True


def spec_verify(rec: Record, ctx: Context) -> bool:
    """A verify step's cost against a plain step at bs 1 (random weights: nearly nothing is
    accepted, so each step is the verify step's cost): n-gram drafts on the 4B preset, n-gram
    and DSpark drafts on ``v41-wide``; each arm an engine of its own, one after the other."""
    in_len, out_len = (8, 4) if ctx.tiny else (128, 64)
    ngram = json.dumps({"method": "ngram", "num_speculative_tokens": 4})
    dspark_cfg = json.dumps({"method": "dspark", "num_speculative_tokens": 5})
    plans = [
        (
            _label(ctx, "4B GQA", "tiny GQA"),
            ctx.preset("4b", cases.GQA_MODEL),
            {"n-gram K = 4": ngram},
        ),
        (
            _label(ctx, "v41-wide", "tiny V4.1"),
            ctx.preset("v41-wide", cases.BUNDLED_MODEL),
            {"n-gram K = 4": ngram, "DSpark K = 5": dspark_cfg},
        ),
    ]
    if ctx.model is not None:  # one model: its arms
        plans = plans[1:]
    for label, model, arms in plans:
        steps = {}
        for arm, cfg in {"plain": None, **arms}.items():
            flags = ["--max-num-seqs", "1"]
            flags += ["--speculative-config", cfg] if cfg else []
            if ctx.device == "cuda":  # engines one after the other: none needs the whole GPU
                flags += ["--kv-cache-memory-bytes", str(8 * 2**30)]
            eng = cases.engine(cases.engine_args(model, ctx.device, *flags), in_len + out_len)
            prompts = cases.random_prompts(0, [in_len], eng.vocab_size, "repeat")
            r = cases.measure(eng, prompts, [out_len])
            stats = eng.stats()
            steps[arm] = r["decode_step_ms"]
            rec.row(
                model=label,
                arm=arm,
                step_ms=r["decode_step_ms"],
                vs_plain=r["decode_step_ms"] / steps["plain"],
                drafted=stats["spec_decode_num_draft_tokens"],
                accepted=stats["spec_decode_num_accepted_tokens"],
            )
            print(f"{label} {arm}: {fmt(r['decode_step_ms'])} ms a step", flush=True)
            del eng
            free()
            if cfg:
                rec.headline(
                    f"{label} verify step, {arm}, bs 1 (random weights)",
                    steps[arm] / steps["plain"],
                    "x",
                    f"{fmt(steps[arm])} ms against a plain decode step's {fmt(steps['plain'])} "
                    "ms, the same prompt",
                )
    return True


# =========================================================================== serving


def _http(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _healthy(port: int, proc: subprocess.Popen, wait_s: float) -> bool:
    end = time.monotonic() + wait_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            return False
        try:
            _http(f"http://127.0.0.1:{port}/health", 2.0)
            return True
        except OSError:
            time.sleep(0.5)
    return False


def _compilations(port: int) -> float | None:
    """The server's count of Triton kernel variants compiled (its /metrics)."""
    try:
        text = _http(f"http://127.0.0.1:{port}/metrics")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("engramrt:triton_compilations_total"):
            return float(line.split()[-1])
    return None


def _itl_summary(result: dict[str, Any]) -> dict[str, Any]:
    """What a median hides: the inter-token gaps' percentiles and the share of the streaming
    time spent in gaps over 10 ms."""
    gaps = sorted(x * 1e3 for req in result.get("itls", []) for x in req)
    if not gaps:
        return {}
    q = statistics.quantiles(gaps, n=100, method="inclusive") if len(gaps) > 1 else gaps * 99
    return {
        "itl_p10_p50_p90_p99_ms": [round(q[i - 1], 3) for i in (10, 50, 90, 99)],
        "time_in_gaps_over_10ms": sum(g for g in gaps if g > 10) / sum(gaps),
    }


def _bench_serve(port: int, conc: int, prompts: int, in_len: int, out_len: int, tmp: Path):
    name = f"c{conc}-{prompts}.json"
    flags = {
        "--port": port,
        "--num-prompts": prompts,
        "--random-input-len": in_len,
        "--random-output-len": out_len,
        "--max-concurrency": conc,
        "--result-dir": tmp,
        "--result-filename": name,
    }
    cmd = [sys.executable, "-m", "engramrt", "bench", "serve", "--ignore-eos", "--disable-tqdm"]
    cmd += ["--save-result", *(str(x) for kv in flags.items() for x in kv)]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=300)
    return json.loads((tmp / name).read_text())


def _offline_lengths(n: int, tiny: bool) -> tuple[list[int], list[int]]:
    """nano-vllm's protocol: input and output lengths uniform in 100-1024 (4-16 / 2-4 tiny)."""
    rng = random.Random(0)
    lo, hi, out_lo, out_hi = (4, 16, 2, 4) if tiny else (100, 1024, 100, 1024)
    return [rng.randint(lo, hi) for _ in range(n)], [rng.randint(out_lo, out_hi) for _ in range(n)]


def serving(rec: Record, ctx: Context) -> bool:
    """``engramrt bench throughput`` (offline: random lengths; and one batch of 1 and of the
    highest concurrency, 512 in / 128 out), then ``engramrt serve`` of the same model under
    ``engramrt bench serve`` at concurrency 1, 16 and 64 with the same lengths: each level's
    tokens/s, TTFT and TPOT against the engine's own decode step measured first."""
    model = ctx.preset("v41-wide", cases.GQA_MODEL)  # tiny: the faster fixture on a CPU
    label = _label(ctx, "v41-wide", "tiny GQA")
    levels = (1, 2) if ctx.tiny else (1, 16, 64)
    top = max(levels)
    in_len, out_len = (16, 4) if ctx.tiny else (512, 128)
    max_len = 256 if ctx.tiny else 2048
    offline_n = 4 if ctx.tiny else 64
    flags = ["--max-num-seqs", str(top)]
    if ctx.device == "cuda":  # a budget of its own: whatever it keeps, the server fits beside it
        flags += ["--kv-cache-memory-bytes", str(16 * 2**30)]
    eng = cases.engine(cases.engine_args(model, ctx.device, *flags), max_len)
    ins, outs = _offline_lengths(offline_n, ctx.tiny)
    offline = cases.measure(eng, cases.random_prompts(2, ins, eng.vocab_size), outs)
    rec.row(kind="offline", **offline)
    lat = {}
    for bs in (1, top):
        prompts = cases.random_prompts(3, [in_len] * bs, eng.vocab_size)
        lat[bs] = cases.measure(eng, prompts, [out_len] * bs)
        rec.row(kind="latency", batch=bs, **lat[bs])
    print(
        f"offline: {fmt(offline['output_tok_s'])} output tok/s; bs 1 step "
        f"{fmt(lat[1]['decode_step_ms'])} ms; bs {top} step {fmt(lat[top]['decode_step_ms'])} ms",
        flush=True,
    )
    rec.headline(
        f"`bench throughput` of {label}, {offline_n} requests of {min(ins)}-{max(ins)} tokens in",
        offline["output_tok_s"],
        "tok/s",
        f"output tokens; the same engine decodes a batch of {top} at "
        f"{fmt(lat[top]['decode_tok_s'])} tok/s ({fmt(lat[top]['decode_step_ms'])} ms a step)",
    )
    del eng
    free()
    missing = [m for m in ("fastapi", "uvicorn", "httpx") if importlib.util.find_spec(m) is None]
    if missing:
        rec["serve"] = f"not run: {', '.join(missing)} not installed"
        print(rec["serve"], flush=True)
        return True
    port = 8400 + os.getpid() % 500
    serve = [sys.executable, "-m", "engramrt", "serve", str(model), "--port", str(port)]
    serve += ["--device", ctx.device, "--max-num-seqs", str(max(2 * top, 16))]
    serve += ["--max-model-len", str(max_len)]
    if ctx.device == "cuda":
        serve += ["--dtype", "bfloat16", "--kv-cache-memory-bytes", str(16 * 2**30)]
    tmp = Path(tempfile.mkdtemp(prefix="engramrt-serve-"))
    started = time.perf_counter()
    with open(tmp / "serve.log", "w") as log:
        proc = subprocess.Popen(serve, stdout=log, stderr=subprocess.STDOUT)
        try:
            return _serve_levels(rec, ctx, proc, port, tmp, lat, label, started)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
            rec["serve_command"] = serve
            shutil.rmtree(tmp, ignore_errors=True)


def _serve_levels(rec, ctx, proc, port, tmp, lat, label, started) -> bool:
    levels = (1, 2) if ctx.tiny else (1, 16, 64)
    top = max(levels)
    in_len, out_len = (16, 4) if ctx.tiny else (512, 128)
    if not _healthy(port, proc, 600):
        rec["serve"] = "the server did not start: " + (tmp / "serve.log").read_text()[-2000:]
        print(rec["serve"], flush=True)
        return False
    compiled = {"start-up": _compilations(port)}
    up = time.perf_counter() - started
    _bench_serve(port, top, 2 * top, in_len, out_len, tmp)  # a warm-up run
    compiled["after a warm-up run"] = _compilations(port)
    for c in levels:
        n = 16 if c == 1 and not ctx.tiny else 4 * c
        res = _bench_serve(port, c, n, in_len, out_len, tmp)
        keep = {k: v for k, v in res.items() if not isinstance(v, list)}
        row = rec.row(kind="serve", concurrency=c, **keep, **_itl_summary(res))
        step = lat[1 if c == 1 else top]
        print(
            f"serve c = {c}: {fmt(row['output_throughput'])} tok/s, median TTFT "
            f"{fmt(row['median_ttft_ms'])} ms, TPOT {fmt(row['median_tpot_ms'])} ms",
            flush=True,
        )
        if c in (1, top):
            rec.headline(
                f"`engramrt serve` of {label}, concurrency {c} ({in_len} in, {out_len} out)",
                row["output_throughput"],
                "tok/s",
                f"median TPOT {fmt(row['median_tpot_ms'])} ms = "
                f"{row['median_tpot_ms'] / step['decode_step_ms']:.2f}x the engine's bs-"
                f"{1 if c == 1 else top} decode step ({fmt(step['decode_step_ms'])} ms); median "
                f"TTFT {fmt(row['median_ttft_ms'])} ms",
            )
    compiled["after the runs"] = _compilations(port)
    rec["serve"] = {"start_up_s": up, "compilations": compiled}
    return True


SUITES: dict[str, Suite] = {
    s.name: s
    for s in (
        Suite(
            "kernels",
            "each Triton kernel against its torch path and its floor",
            kernel_suite,
            180,
        ),
        Suite(
            "gqa-decode",
            "the 4B GQA preset's decode step at bs 1/16/64 against its byte floor",
            gqa_decode,
            180,
        ),
        Suite(
            "v41-decode",
            "v41-wide's decode step at bs 1/16/64 against its byte floor; the Engram's cost",
            v41_decode,
            200,
        ),
        Suite(
            "v41-prefill",
            "one 8,192-token v41-wide prefill against the bf16 and FP8 matmul rates",
            v41_prefill,
            100,
        ),
        Suite(
            "dspark",
            "DSpark's acceptance and speed-up on the trained bundled model, bs 1 and 16",
            dspark,
            120,
        ),
        Suite(
            "serving",
            "bench throughput, then serve + bench serve at c = 1/16/64 on v41-wide",
            serving,
            240,
            needs=("fastapi", "uvicorn"),
        ),
        Suite(
            "spec-verify",
            "verify steps against plain ones at bs 1: the 4B with n-gram drafts, v41-wide with "
            "n-gram and DSpark drafts",
            spec_verify,
            200,
            in_all=False,
        ),
    )
}
