"""``engramrt serve``: the engine and the OpenAI-compatible server on rank 0, the other pipeline
stages serving rank 0's steps."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from engramrt.bundled import resolve_model_dir
from engramrt.commands.flags import (
    add_device_flags,
    add_dist_flags,
    add_engram_memory_flags,
    add_memory_flags,
    add_scheduling_flags,
    dist_config,
    engram_table_memory,
    layer_partition,
    resolve_device,
)
from engramrt.config import ModelConfig, load_json, model_config
from engramrt.engine.engine import Engine, EngineConfig
from engramrt.engine.speculative import SpecConfig
from engramrt.kernels.compiles import compilations, count_compilations
from engramrt.parallel.faults import inject_stage_faults
from engramrt.parallel.launch import DistConfig, launch, stage_device
from engramrt.parallel.liveness import Heartbeat, StageWatch
from engramrt.parallel.partition import stage_layers
from engramrt.parallel.pipeline import Pipeline
from engramrt.prompts import PromptEncoder
from engramrt.runner.carry import Carry
from engramrt.runner.graphs import MAX_GRAPH_TOKENS, graph_shapes, output_rows
from engramrt.runner.kv_budget import (
    CPU_KV_BYTES,
    blocks_from_bytes,
    blocks_from_profile,
    kv_block_bytes,
    stages_per_gpu,
)
from engramrt.runner.stage import StageRunner


@dataclass
class ServeOptions:
    model_dir: Path
    partition: list[int]
    served_model_name: list[str]
    host: str = "127.0.0.1"
    port: int = 8000
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None  # default: by --gpu-memory-utilization on CUDA
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    enable_prefix_caching: bool = True
    async_scheduling: bool = False  # overlap scheduling (one stage only)
    long_prefill_token_threshold: int = 0  # a prompt's tokens per step, at most (0: the budget)
    speculative_config: str | None = None  # --speculative-config (JSON)
    engram: bool = True  # False: every Engram layer skipped on purpose (an ablation)
    table_memory: str = "auto"  # where the Engram tables live (--engram-table-memory)
    disable_uvicorn_access_log: bool = False
    enable_log_requests: bool = False
    max_request_bytes: int = 32 * 2**20
    shutdown_timeout: float = 20.0
    stage_timeout: float = 10.0
    api_key: str | None = None
    device: str = "cpu"
    dtype: str | None = None
    seed: int = 0
    dist: DistConfig = field(default_factory=DistConfig)

    @property
    def speculative(self) -> SpecConfig | None:
        """``--speculative-config`` parsed (a bad one: a ValueError naming the rule)."""
        return SpecConfig.parse(self.speculative_config)

    @property
    def verify_drafts(self) -> int:
        """Drafts a row of the verify graphs (0: no speculation)."""
        spec = self.speculative
        return spec.num_speculative_tokens if spec is not None else 0


def kv_blocks(runner: StageRunner, opts: ServeOptions, cfg: ModelConfig, max_len: int) -> int:
    """``--num-gpu-blocks-override``; else a byte budget (``--kv-cache-memory-bytes``, or a
    default off GPU) over all the model's layers, capped at what ``max_num_seqs`` full-length
    sequences could use; else, on CUDA, what ``--gpu-memory-utilization`` leaves after a
    profiled forward of the largest batch the scheduler can form. Stages spawned onto one GPU
    split it."""
    if opts.num_gpu_blocks_override is not None:
        return opts.num_gpu_blocks_override
    model = runner.model  # the cache's own dtype, as loaded

    def per_block(layers: int) -> int:
        return kv_block_bytes(opts.block_size, model.kv_heads, cfg.head_dim,
                              model.dtype.itemsize, layers)  # fmt: skip

    if runner.device.type != "cuda" or opts.kv_cache_memory_bytes is not None:
        cap = opts.max_num_seqs * -(-max_len // opts.block_size)
        budget = opts.kv_cache_memory_bytes or CPU_KV_BYTES
        return blocks_from_bytes(budget, per_block(cfg.num_layers), cap)
    tokens = max(1, min(opts.max_num_batched_tokens, max_len * opts.max_num_seqs))
    profile = runner.profile_memory(tokens, max_len, opts.block_size, opts.max_num_seqs)
    share = stages_per_gpu(int(os.environ.get("LOCAL_WORLD_SIZE", 1)), torch.cuda.device_count())
    # the graphs' pool: about a forward of the largest captured step; and their outputs
    graph_rows = 0 if opts.enforce_eager else max(opts.max_num_seqs, min(tokens, MAX_GRAPH_TOKENS))
    outputs = 0
    if not opts.enforce_eager:
        shapes = graph_shapes(opts.max_num_seqs, opts.max_num_batched_tokens, opts.verify_drafts)
        if runner.is_last:
            row = cfg.vocab_size * 4  # fp32 logits
        else:
            row = sum(
                t[0].numel() * t.element_size() for t in Carry.empty(runner.model, 1).tensors()
            )
        outputs = output_rows(shapes, runner.is_last) * row
    return blocks_from_profile(profile, opts.gpu_memory_utilization,
                               per_block(len(model.layer_ids)), share, graph_rows,
                               outputs)  # fmt: skip


def check(opts: ServeOptions) -> tuple[ModelConfig, int]:
    cfg = model_config(load_json(opts.model_dir))
    max_len = cfg.max_position_embeddings if opts.max_model_len is None else opts.max_model_len
    if not 1 <= max_len <= cfg.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {max_len} must lie in [1, {cfg.max_position_embeddings}] "
            "(the model's max_position_embeddings)"
        )
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size", "max_request_bytes"):
        if getattr(opts, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if opts.long_prefill_token_threshold < 0:
        raise ValueError("--long-prefill-token-threshold must be >= 0 (0: off)")
    if opts.speculative is not None and opts.async_scheduling:  # a bad one: an error already
        raise ValueError("--speculative-config does not combine with --async-scheduling")
    if opts.async_scheduling and len(opts.partition) > 1:
        raise ValueError("--async-scheduling needs one pipeline stage (-pp 1)")
    if opts.shutdown_timeout < 0 or opts.stage_timeout <= 0:
        raise ValueError("--shutdown-timeout must be >= 0 and --stage-timeout > 0")
    if not 0 < opts.gpu_memory_utilization <= 1:
        raise ValueError(
            f"--gpu-memory-utilization must lie in (0, 1], got {opts.gpu_memory_utilization}"
        )
    return cfg, max_len


def run_serve(opts: ServeOptions) -> None:
    check(opts)
    launch(opts.dist, _worker, opts)


def build_stage(
    opts: ServeOptions, rank: int = 0, world: int = 1
) -> tuple[Pipeline, Engine | None]:
    """This rank's stage, and on rank 0 the engine that drives the pipeline."""
    cfg, max_len = check(opts)
    device = stage_device(opts.dist)
    runner = StageRunner.load(
        opts.model_dir, opts.max_num_seqs, max_len, device, opts.dtype,
        stage_layers(opts.partition, rank), opts.block_size, num_blocks=0, seed=opts.seed,
        table_memory=opts.table_memory,
    )  # fmt: skip
    inject_stage_faults(runner, rank)  # test-only, from the environment (A/B arms)
    pipe = Pipeline(runner, rank, world)
    driver = pipe.is_driver
    if not opts.engram:
        runner.model.disable_engram()
        if driver:
            print("engramrt: --engram off: every Engram layer is skipped (an ablation)", flush=True)
    blocks = _agree(kv_blocks(runner, opts, cfg, max_len), device)
    runner.allocate_kv(opts.max_num_seqs, max_len, opts.block_size, blocks)
    if driver and device.type == "cuda":
        gib = sum(t.numel() * t.element_size() for t in (*runner.kv.k.values(),
                                                        *runner.kv.v.values())) / 2**30  # fmt: skip
        print(f"engramrt: KV cache {blocks} blocks = {blocks * opts.block_size} tokens "
              f"({gib:.2f} GiB on stage 0)", flush=True)  # fmt: skip
    counting = count_compilations()
    runner.warm_up(opts.max_num_batched_tokens)  # kernel variants compiled now, not mid-serving
    spec, verify = opts.speculative, opts.verify_drafts
    if device.type == "cuda" and not opts.enforce_eager:
        runner.capture_graphs(opts.max_num_seqs, opts.max_num_batched_tokens, verify)
        if spec is not None and driver:
            print(f"engramrt: verify steps of {verify} drafts a row replay CUDA graphs (each "
                  f"decoding row is given {verify}: a lookup that finds fewer repeats its last "
                  "token); others run eagerly", flush=True)  # fmt: skip
    if driver and counting and compilations():
        print(f"engramrt: {compilations()} Triton kernel variants compiled at start-up",
              flush=True)  # fmt: skip
    if not driver:
        return pipe, None
    config = EngineConfig(
        max_len, opts.max_num_seqs, opts.max_num_batched_tokens, opts.block_size, blocks,
        opts.enable_prefix_caching, cfg.eos_token_id, cfg.vocab_size, opts.async_scheduling,
        opts.long_prefill_token_threshold, spec, uniform_drafts=runner.graphs is not None,
    )  # fmt: skip
    return pipe, Engine(pipe, runner.tokenizer, config)


def _agree(blocks: int, device: torch.device) -> int:
    """Every rank gets the smallest rank's block count: rank 0's block manager hands out ids
    that all ranks' caches must hold."""
    if not dist.is_initialized():
        return blocks
    where = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([blocks], dtype=torch.int64, device=where)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _worker(rank: int, world: int, opts: ServeOptions) -> None:
    pipe, engine = build_stage(opts, rank, world)
    if engine is None:
        _serve_stage(pipe, opts)
        return
    try:
        code = _serve_http(opts, engine)
    except BaseException:
        pipe.stop()  # a failed start (the port is taken, say): release the other stages
        raise
    if code == 0:
        pipe.stop()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    if opts.dist.world > 1:
        os._exit(code)  # a hung stage would hold the stop message and teardown barrier for ever
    raise SystemExit(code)


def _serve_stage(pipe: Pipeline, opts: ServeOptions) -> None:
    """A later stage: rank 0 owns the server's life (it drains, then stops the stages), so
    signals that reach the whole process group do not take this stage away mid-drain."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    first = sum(opts.partition[: pipe.rank])
    last = first + opts.partition[pipe.rank] - 1
    tp = f", TP rank {pipe.tp.rank} of {pipe.tp.size}" if pipe.tp.size > 1 else ""
    print(f"engramrt: stage {pipe.rank} of {pipe.world}{tp} (layers {first}-{last}) ready, "
          f"pid {os.getpid()}", flush=True)  # fmt: skip
    beat = Heartbeat()
    try:
        pipe.serve()
    finally:
        beat.stop()


def _serve_http(opts: ServeOptions, engine: Engine) -> int:
    """Serve until a signal (exit status 0) or the engine's death (1)."""
    import uvicorn

    from engramrt.engine.async_engine import AsyncEngine
    from engramrt.server.app import Server, ServerConfig, create_app
    from engramrt.server.lifecycle import EngineServer

    runner, max_len = engine.pipeline.runner, engine.cfg.max_model_len
    blocks = engine.cfg.num_blocks
    prompts = PromptEncoder.load(opts.model_dir, runner.tokenizer)
    server = Server(
        AsyncEngine(engine), prompts,
        ServerConfig(opts.served_model_name, max_len, opts.api_key, opts.max_request_bytes,
                     opts.enable_log_requests),
    )  # fmt: skip
    ready = (
        f"serving {opts.served_model_name[0]} ({opts.model_dir}) at "
        f"http://{opts.host}:{opts.port}/v1 | {runner.device}, {runner.model.dtype}, "
        f"{len(opts.partition)} stage(s) {opts.partition} x TP {opts.dist.tp_size}, {blocks} KV "
        f"blocks of "
        f"{opts.block_size} tokens, max_model_len {max_len}"
    )
    config = uvicorn.Config(
        create_app(server), host=opts.host, port=opts.port,
        log_level="warning" if opts.disable_uvicorn_access_log else "info",
        access_log=not opts.disable_uvicorn_access_log, timeout_graceful_shutdown=5,
    )  # fmt: skip
    http = EngineServer(config, server, ready, opts.shutdown_timeout)
    many = opts.dist.world > 1
    watch = StageWatch(opts.stage_timeout, server.engine.fail) if many else None
    try:
        http.run()
    finally:
        if watch is not None:
            watch.stop()
        server.engine.shutdown()
    return http.exit_code


# --------------------------------------------------------------------------- the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    """vLLM's flag names, so that ``vllm serve`` command lines carry over."""
    p.add_argument("model_tag", nargs="?", help="model directory (default: the bundled model)")
    p.add_argument("--model", help="same as the positional MODEL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", help="names in /v1/models and responses")
    p.add_argument("--max-model-len", type=int, help="default: the model's maximum")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="also the chunk size")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--num-gpu-blocks-override", type=int, help="KV blocks (default: by memory)")
    add_memory_flags(p)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    add_scheduling_flags(p)
    p.add_argument("--api-key", help="require this bearer key on /v1/* ($VLLM_API_KEY works)")
    p.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="no line per HTTP request"
    )
    p.add_argument(
        "--enable-log-requests", action="store_true",
        help="a line per API request: its id, choices, prompt tokens and main parameters",
    )  # fmt: skip
    p.add_argument(
        "--disable-log-requests", action="store_true",
        help="vLLM's older flag, kept so its command lines carry over: requests are not logged "
        "unless --enable-log-requests",
    )  # fmt: skip
    p.add_argument(
        "--max-request-bytes", type=int, default=32 * 2**20,
        help="larger request bodies are a 413 (default 32 MiB)",
    )  # fmt: skip
    p.add_argument(
        "--shutdown-timeout", type=float, default=20.0,
        help="on SIGTERM/SIGINT, seconds the running requests may take to finish before they "
        "are aborted (0: abort at once)",
    )  # fmt: skip
    add_device_flags(p)
    add_engram_memory_flags(p)
    p.add_argument("--seed", type=int, default=0, help="for requests that bring no seed")
    p.add_argument(
        "--engram", choices=["on", "off"], default="on",
        help="off: skip every Engram layer on purpose (an ablation for evaluations; the "
        "fail-closed check then expects none to run)",
    )  # fmt: skip
    add_dist_flags(p)
    p.add_argument(
        "--stage-timeout", type=float, default=10.0,
        help="with -pp > 1: seconds of silence after which a stage counts as hung; its "
        "requests fail and the server exits 1",
    )  # fmt: skip


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    model_dir = resolve_model_dir(args.model_tag or args.model)
    name = args.served_model_name or [
        "engramrt-tiny" if (args.model_tag or args.model) is None else str(model_dir)
    ]
    opts = ServeOptions(
        model_dir=model_dir,
        partition=layer_partition(args, model_dir),
        served_model_name=name,
        host=args.host,
        port=args.port,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        num_gpu_blocks_override=args.num_gpu_blocks_override,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=args.enable_prefix_caching,
        async_scheduling=args.async_scheduling,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        speculative_config=args.speculative_config,
        disable_uvicorn_access_log=args.disable_uvicorn_access_log,
        enable_log_requests=args.enable_log_requests,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout,
        stage_timeout=args.stage_timeout,
        api_key=args.api_key
        or os.environ.get("ENGRAMRT_API_KEY")
        or os.environ.get("VLLM_API_KEY"),
        device=device,
        dtype=args.dtype,
        seed=args.seed,
        engram=args.engram == "on",
        table_memory=engram_table_memory(args),
        dist=dist_config(args, device),
    )
    run_serve(opts)
    return 0
