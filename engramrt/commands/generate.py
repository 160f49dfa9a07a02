"""``engramrt generate``: prefill + decode of one prompt, on one process or a pipeline of stages."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from engramrt.bundled import resolve_model_dir
from engramrt.commands.flags import (
    add_device_flags,
    add_dist_flags,
    add_engram_memory_flags,
    add_model_flag,
    options_from_args,
    resolve_device,
)
from engramrt.config import ModelConfig
from engramrt.engine.build import EngineOptions, build_stage, check
from engramrt.engine.engine import Engine
from engramrt.engine.request import SamplingParams, check_context_length
from engramrt.model.trace import EngramTrace, EngramUpdateStats, fanout
from engramrt.parallel.launch import launch
from engramrt.prompts import PromptEncoder


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS), "length" or "error" (logits not finite; logged)
    seconds: float


def generate(
    engine: Engine,
    prompts: PromptEncoder,
    prompt: str,
    max_tokens: int = 32,
    params: SamplingParams | None = None,
) -> Generation:
    """Greedy (the default) or sampled completion of ``prompt``: one request through the
    engine (the same scheduling and sampling as ``serve``); the pipeline's last stage samples.
    The EOS that ends it is not part of the output."""
    params = params or SamplingParams(temperature=0.0)
    params = replace(params, max_tokens=max_tokens)
    cfg = engine.pipeline.runner.model.cfg
    prompt_ids = prompt_tokens(prompts, cfg, prompt)
    start = time.perf_counter()
    engine.add_request("0", prompt_ids, params)
    out, finish = [], "length"
    while engine.has_work():
        for o in engine.step():
            out += o.new_token_ids
            finish = o.finish_reason or finish
    if finish == "stop" and out[-1:] == [cfg.eos_token_id]:
        out.pop()
    seconds = time.perf_counter() - start
    return Generation(prompt_ids, out, prompts.tokenizer.decode(out), finish, seconds)


def prompt_tokens(prompts: PromptEncoder, cfg: ModelConfig, prompt: str) -> list[int]:
    """The prompt's ids as the tokenizer config says (the engine checks them and the lengths
    when the request is built)."""
    ids = prompts.text(prompt)
    if not ids:
        raise ValueError("the prompt has no tokens")
    if max(ids) >= cfg.vocab_size:
        raise ValueError(
            f"the prompt's token ids {sorted({t for t in ids if t >= cfg.vocab_size})[:8]} lie "
            f"past the model's vocab_size {cfg.vocab_size} (the tokenizer has "
            f"{prompts.tokenizer.get_vocab_size(with_added_tokens=True)} tokens)"
        )
    return ids


@dataclass
class GenerateOptions(EngineOptions):
    """One request, eagerly: no warm-up, no graphs, a cache of one context."""

    prompt: str = ""
    max_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    trace_path: str | None = None
    engram_stats: bool = False
    max_num_seqs: int = 1
    enforce_eager: bool = True
    warm_up: bool = False

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            seed=self.seed,
        )


def run_generate(opts: GenerateOptions) -> None:
    """Everything that can be checked is checked before any stage starts."""
    cfg, max_len = check(opts)
    opts.params.validate(cfg.vocab_size, cfg.eos_token_id)
    if opts.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {opts.max_tokens}")
    ids = prompt_tokens(PromptEncoder.load(opts.model_dir), cfg, opts.prompt)
    check_context_length(len(ids), opts.max_tokens, max_len)
    launch(opts.dist, _worker, opts)


def _worker(rank: int, world: int, opts: GenerateOptions) -> None:
    pipe, engine = build_stage(opts, rank, world)
    runner = pipe.runner
    leader = pipe.tp.rank == 0  # a stage's trace and statistics: its leader's (all agree)
    if opts.trace_path and pipe.is_driver:
        Path(opts.trace_path).write_text("")  # before any stage can have written
    trace = EngramTrace(opts.trace_path, rank) if opts.trace_path and leader else None
    stats = EngramUpdateStats() if opts.engram_stats and leader else None
    runner.tracer = fanout(trace, stats)
    if engine is not None:
        try:
            prompts = PromptEncoder.load(opts.model_dir, runner.tokenizer)
            out = generate(engine, prompts, opts.prompt, opts.max_tokens, opts.params)
        finally:
            pipe.stop()
        print(out.text, flush=True)
        n = len(out.token_ids)
        print(
            f"[{len(out.prompt_ids)} prompt + {n} generated tokens, "
            f"finish_reason={out.finish_reason}, {n / out.seconds:.1f} tok/s on "
            f"{runner.device}, {world} stage(s) {opts.partition} x TP {pipe.tp.size}]",
            file=sys.stderr,
        )
    else:
        pipe.serve()
    for layer, row in (stats.summary() if stats else {}).items():
        print(
            f"[engram layer {layer} (stage {rank}): update RMS {row['update_rms']:.4f} on a "
            f"stream of RMS {row['stream_rms']:.4f}, {100 * row['changed_frac']:.2f}% of "
            "elements changed]",
            file=sys.stderr,
            flush=True,
        )


# --------------------------------------------------------------------------- the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flag(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    add_device_flags(p)
    add_engram_memory_flags(p)
    p.add_argument(
        "--engram-stats", action="store_true", help="print each Engram's update RMS and reach"
    )
    p.add_argument("--engram-trace", metavar="PATH", help="JSON lines of stage/Engram checksums")
    p.add_argument(
        "--speculative-config", help="n-gram or DSpark drafts, as on serve (vLLM's JSON)"
    )
    add_dist_flags(p)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    model_dir = resolve_model_dir(args.model)
    opts = options_from_args(
        args,
        model_dir,
        device=device,
        cls=GenerateOptions,
        prompt=args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        trace_path=args.engram_trace,
        engram_stats=args.engram_stats,
    )
    run_generate(opts)
    return 0
