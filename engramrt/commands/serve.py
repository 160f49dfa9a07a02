"""``engramrt serve``: the engine and the OpenAI-compatible server on rank 0, the other pipeline
stages serving rank 0's steps."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from engramrt.bundled import resolve_model_dir
from engramrt.commands.flags import (
    add_device_flags,
    add_dist_flags,
    add_memory_flags,
    dist_config,
    layer_partition,
    resolve_device,
)
from engramrt.config import ModelConfig, load_json, model_config
from engramrt.engine.engine import Engine, EngineConfig
from engramrt.parallel.launch import DistConfig, launch, stage_device
from engramrt.parallel.partition import stage_layers
from engramrt.parallel.pipeline import Pipeline
from engramrt.sampling import SampleRow, sample_rows
from engramrt.session import Session

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


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
    api_key: str | None = None
    device: str = "cpu"
    dtype: str | None = None
    seed: int = 0
    dist: DistConfig = field(default_factory=DistConfig)


CPU_KV_BYTES = 256 * 2**20  # the KV budget where there is no GPU memory to size it from


def kv_block_bytes(cfg: ModelConfig, block_size: int, itemsize: int, layers: int) -> int:
    """K and V of one block in ``layers`` layers."""
    return block_size * cfg.num_kv_heads * cfg.head_dim * 2 * itemsize * layers


def num_kv_blocks(cfg: ModelConfig, opts: ServeOptions, max_len: int) -> int:
    """From a fixed byte budget (``--kv-cache-memory-bytes``, or 256 MiB off GPU) for all layers,
    capped at what ``max_num_seqs`` full-length sequences could use."""
    if opts.num_gpu_blocks_override is not None:
        return opts.num_gpu_blocks_override
    budget = opts.kv_cache_memory_bytes or CPU_KV_BYTES
    cap = opts.max_num_seqs * -(-max_len // opts.block_size)
    return max(
        1,
        min(
            cap,
            budget
            // kv_block_bytes(
                cfg, opts.block_size, DTYPE_BYTES[opts.dtype or cfg.torch_dtype], cfg.num_layers
            ),
        ),
    )


def profile_kv_blocks(session: Session, opts: ServeOptions, max_len: int) -> int:
    """vLLM's sizing: run the largest batch the scheduler can form (``max_num_batched_tokens``
    prefill tokens, then the sampler at ``max_num_seqs`` rows) on this stage, then give the KV
    cache what ``--gpu-memory-utilization`` of the GPU leaves after the weights, that peak's
    activations, an estimate of the decode graphs' pool and memory outside torch (CUDA context,
    NCCL). Stages spawned onto one GPU split it."""
    from engramrt.session import Carry

    cfg, dev = session.model.cfg, session.device
    tokens = max(1, min(opts.max_num_batched_tokens, max_len * opts.max_num_seqs))
    runs = [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
    slots = list(range(len(runs)))
    tables = [list(range(i * -(-n // opts.block_size), (i + 1) * -(-n // opts.block_size)))
              for i, n in enumerate(runs)]  # fmt: skip
    per_seq = -(-max_len // opts.block_size)
    session.kv = Session.new_cache(session.model, len(runs), max_len, opts.block_size,
                                   len(runs) * per_seq)  # fmt: skip
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    carry = None if session.hasher else Carry.zeros(session.model, tokens)  # a later stage
    fake = None if carry is not None else [cfg.bos_token_id or 0] * tokens
    logits = session.step(fake, slots, runs, [0] * len(runs), carry=carry, block_tables=tables)
    if session.model.head is not None:  # the sampler's temporaries at the largest batch
        n = min(tokens, opts.max_num_seqs)
        sample_rows(logits[:n], [SampleRow(temperature=1.0, top_p=0.9)] * n, None)
    del logits
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev)
    cache_bytes = sum(t.numel() * t.element_size() for t in (*session.kv.k.values(),
                                                          *session.kv.v.values()))  # fmt: skip
    session.kv = None
    if session.hasher is not None:
        session.hasher.history.table.zero_()  # the profile's history rows mean nothing
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    outside_torch = total - free - torch.cuda.memory_reserved(dev)  # CUDA context, NCCL, ...
    weights = torch.cuda.memory_allocated(dev)
    activations = peak - cache_bytes - weights
    # decode graphs keep a pool about as large as a forward of max_num_seqs tokens
    graphs = 0 if opts.enforce_eager else activations * min(1.0, opts.max_num_seqs / tokens)
    share = -(-int(os.environ.get("LOCAL_WORLD_SIZE", 1)) // torch.cuda.device_count())
    budget = int(total * opts.gpu_memory_utilization / share - outside_torch - weights
                 - activations - graphs)  # fmt: skip
    model = session.model  # the cache's own dtype, as loaded
    per_block = kv_block_bytes(cfg, opts.block_size, model.dtype.itemsize, len(model.layer_ids))
    if budget < per_block:
        raise ValueError(
            f"--gpu-memory-utilization {opts.gpu_memory_utilization} leaves no room for the KV "
            f"cache: the weights and a {tokens}-token forward peak at {peak / 2**30:.2f} GiB of "
            f"{total / 2**30:.2f} GiB (stages sharing this GPU: {share})"
        )
    return budget // per_block


def check(opts: ServeOptions) -> tuple[ModelConfig, int]:
    cfg = model_config(load_json(opts.model_dir))
    max_len = opts.max_model_len or cfg.max_position_embeddings
    if not 1 <= max_len <= cfg.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {max_len} must lie in [1, {cfg.max_position_embeddings}] "
            "(the model's max_position_embeddings)"
        )
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
        if getattr(opts, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
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
    profile = (
        device.type == "cuda"
        and opts.num_gpu_blocks_override is None
        and opts.kv_cache_memory_bytes is None
    )
    blocks = 1 if profile else num_kv_blocks(cfg, opts, max_len)
    session = Session.load(
        opts.model_dir, opts.max_num_seqs, max_len, device, opts.dtype,
        stage_layers(opts.partition, rank), opts.block_size, blocks,
    )  # fmt: skip
    if profile:
        blocks = _agree(profile_kv_blocks(session, opts, max_len), world, device)
        session.kv = Session.new_cache(session.model, opts.max_num_seqs, max_len,
                                       opts.block_size, blocks)  # fmt: skip
        if rank == 0:
            model = session.model
            gib = (
                blocks
                * kv_block_bytes(cfg, opts.block_size, model.dtype.itemsize, len(model.layer_ids))
                / 2**30
            )
            print(f"engramrt: KV cache {blocks} blocks = {blocks * opts.block_size} tokens "
                  f"({gib:.2f} GiB on stage 0)", flush=True)  # fmt: skip
    if device.type == "cuda" and not opts.enforce_eager:
        session.capture_graphs(opts.max_num_seqs)
    pipe = Pipeline(session, rank, world, opts.seed)
    if rank != 0:
        return pipe, None
    config = EngineConfig(
        max_len, opts.max_num_seqs, opts.max_num_batched_tokens, opts.block_size, blocks,
        opts.enable_prefix_caching,
    )  # fmt: skip
    return pipe, Engine(pipe, session.tokenizer, config)


def _agree(blocks: int, world: int, device: torch.device) -> int:
    """Every stage gets the smallest stage's block count: rank 0's block manager hands out ids
    that all stages' caches must hold."""
    if world == 1:
        return blocks
    where = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([blocks], dtype=torch.int64, device=where)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())


def _worker(rank: int, world: int, opts: ServeOptions) -> None:
    pipe, engine = build_stage(opts, rank, world)
    if engine is None:
        pipe.serve()
        return
    try:
        _serve_http(opts, engine)
    finally:
        pipe.stop()


def _serve_http(opts: ServeOptions, engine: Engine):
    import uvicorn

    from engramrt.engine.async_engine import AsyncEngine
    from engramrt.server.app import Server, ServerConfig, create_app

    session, max_len, blocks = (
        engine.pipeline.session,
        engine.cfg.max_model_len,
        engine.cfg.num_blocks,
    )
    tok_cfg_path = opts.model_dir / "tokenizer_config.json"
    tok_cfg = json.loads(tok_cfg_path.read_text()) if tok_cfg_path.is_file() else {}
    model_cfg = session.model.cfg
    server = Server(
        AsyncEngine(engine),
        session.tokenizer,
        ServerConfig(
            opts.served_model_name, max_len, opts.api_key, tok_cfg.get("chat_template"),
            tok_cfg.get("bos_token") or "", tok_cfg.get("eos_token") or "",
            model_cfg.bos_token_id,
        ),
    )  # fmt: skip
    ready = (
        f"engramrt: serving {opts.served_model_name[0]} ({opts.model_dir}) at "
        f"http://{opts.host}:{opts.port}/v1 | {len(opts.partition)} stage(s) {opts.partition}, "
        f"{blocks} KV blocks of {opts.block_size} tokens, max_model_len {max_len}"
    )
    try:
        app = create_app(server, ready)
        uvicorn.run(app, host=opts.host, port=opts.port, log_level="warning")
    finally:
        server.engine.shutdown()


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
    p.add_argument("--api-key", help="require this bearer key on /v1/* ($VLLM_API_KEY works)")
    add_device_flags(p)
    p.add_argument("--seed", type=int, default=0, help="for requests that bring no seed")
    add_dist_flags(p)


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
        api_key=args.api_key
        or os.environ.get("ENGRAMRT_API_KEY")
        or os.environ.get("VLLM_API_KEY"),
        device=device,
        dtype=args.dtype,
        seed=args.seed,
        dist=dist_config(args, device),
    )
    run_serve(opts)
    return 0
