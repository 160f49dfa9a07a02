"""``engramrt generate``: prefill + decode of one prompt, on one process or a pipeline of stages."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from engramrt.bundled import resolve_model_dir
from engramrt.commands.flags import (
    add_device_flags,
    add_dist_flags,
    add_engram_memory_flags,
    add_model_flag,
    dist_config,
    engram_table_memory,
    layer_partition,
    resolve_device,
)
from engramrt.config import ModelConfig, load_json, model_config
from engramrt.engine.engine import Engine, EngineConfig
from engramrt.engine.request import SamplingParams
from engramrt.engine.speculative import SpecConfig
from engramrt.model.trace import EngramTrace, EngramUpdateStats, fanout
from engramrt.parallel.launch import DistConfig, launch, stage_device
from engramrt.parallel.partition import stage_layers
from engramrt.parallel.pipeline import Pipeline
from engramrt.prompts import PromptEncoder
from engramrt.runner.batch import SampleRow
from engramrt.runner.stage import StageRunner


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS) or "length"
    seconds: float


def generate(
    pipeline: Pipeline,
    prompts: PromptEncoder,
    prompt: str,
    max_tokens: int = 32,
    sampling: SampleRow | None = None,
    speculative: SpecConfig | None = None,
) -> Generation:
    """Greedy (the default) or sampled completion of ``prompt``: one request through the
    engine (the same scheduling and sampling as ``serve``), the prompt in one step; the
    pipeline's last stage samples. The EOS that ends it is not part of the output."""
    row = sampling or SampleRow()
    runner = pipeline.runner
    cfg, kv = runner.model.cfg, runner.kv
    prompt_ids = prompt_tokens(prompts, cfg, prompt, max_tokens, kv.max_len, row)
    engine = Engine(pipeline, runner.tokenizer, EngineConfig(
        kv.max_len, 1, kv.max_len, kv.block_size, kv.num_blocks, False, cfg.eos_token_id,
        cfg.vocab_size, speculative=speculative,
    ))  # fmt: skip
    params = SamplingParams(max_tokens=max_tokens, temperature=row.temperature, top_p=row.top_p,
                            seed=row.seed)  # fmt: skip
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


def prompt_tokens(
    prompts: PromptEncoder,
    cfg: ModelConfig,
    prompt: str,
    max_tokens: int,
    limit: int,
    row: SampleRow,
) -> list[int]:
    """The prompt's ids as the tokenizer config says, after checking every parameter."""
    row.validate()
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    ids = prompts.text(prompt)
    if not ids:
        raise ValueError("the prompt has no tokens")
    if max(ids) >= cfg.vocab_size:
        raise ValueError(
            f"the prompt's token ids {sorted({t for t in ids if t >= cfg.vocab_size})[:8]} lie "
            f"past the model's vocab_size {cfg.vocab_size} (the tokenizer has "
            f"{prompts.tokenizer.get_vocab_size(with_added_tokens=True)} tokens)"
        )
    if len(ids) + max_tokens - 1 > limit:  # the last sampled token is never fed back
        raise ValueError(
            f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"maximum context length {limit}"
        )
    return ids


@dataclass
class GenerateOptions:
    model_dir: Path
    prompt: str
    partition: list[int]
    max_tokens: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    dtype: str | None = None
    dist: DistConfig = field(default_factory=DistConfig)
    trace_path: str | None = None
    engram_stats: bool = False
    table_memory: str = "auto"  # where the Engram tables live (--engram-table-memory)
    speculative_config: str | None = None  # --speculative-config (JSON)


def run_generate(opts: GenerateOptions) -> None:
    cfg = model_config(load_json(opts.model_dir))  # check what can be checked before starting
    row = SampleRow(opts.temperature, opts.top_p, seed=opts.seed)
    SpecConfig.parse(opts.speculative_config)  # a bad one: an error before any stage starts
    prompt_tokens(
        PromptEncoder.load(opts.model_dir),
        cfg,
        opts.prompt,
        opts.max_tokens,
        cfg.max_position_embeddings,
        row,
    )
    launch(opts.dist, _worker, opts)


def _worker(rank: int, world: int, opts: GenerateOptions) -> None:
    device = stage_device(opts.dist)
    layers = stage_layers(opts.partition, rank)
    runner = StageRunner.load(
        opts.model_dir, device=device, dtype=opts.dtype, layer_ids=layers, seed=opts.seed,
        table_memory=opts.table_memory,
    )  # fmt: skip
    pipe = Pipeline(runner, rank, world)
    leader = pipe.tp.rank == 0  # a stage's trace and statistics: its leader's (all agree)
    if opts.trace_path and pipe.is_driver:
        Path(opts.trace_path).write_text("")  # before any stage can have written
    trace = EngramTrace(opts.trace_path, rank) if opts.trace_path and leader else None
    stats = EngramUpdateStats() if opts.engram_stats and leader else None
    runner.tracer = fanout(trace, stats)
    if pipe.is_driver:
        row = SampleRow(opts.temperature, opts.top_p, seed=opts.seed)
        try:
            prompts = PromptEncoder.load(opts.model_dir, runner.tokenizer)
            spec = SpecConfig.parse(opts.speculative_config)
            out = generate(pipe, prompts, opts.prompt, opts.max_tokens, row, spec)
        finally:
            pipe.stop()
        print(out.text, flush=True)
        n = len(out.token_ids)
        print(
            f"[{len(out.prompt_ids)} prompt + {n} generated tokens, "
            f"finish_reason={out.finish_reason}, {n / out.seconds:.1f} tok/s on {device}, "
            f"{world} stage(s) {opts.partition} x TP {pipe.tp.size}]",
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
    p.add_argument("--speculative-config", help="n-gram drafts, as on serve (vLLM's JSON)")
    add_dist_flags(p)


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    model_dir = resolve_model_dir(args.model)
    opts = GenerateOptions(
        model_dir=model_dir,
        prompt=args.prompt,
        partition=layer_partition(args, model_dir),
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        dtype=args.dtype,
        dist=dist_config(args, device),
        trace_path=args.engram_trace,
        engram_stats=args.engram_stats,
        table_memory=engram_table_memory(args),
        speculative_config=args.speculative_config,
    )
    run_generate(opts)
    return 0
