"""``engramrt serve``: the engine and the OpenAI-compatible server on rank 0, the other pipeline
stages serving rank 0's steps."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from engramrt.config import ModelConfig, load_json, model_config
from engramrt.engine.engine import Engine, EngineConfig
from engramrt.parallel.launch import DistConfig, launch, stage_device
from engramrt.parallel.partition import stage_layers
from engramrt.parallel.pipeline import Pipeline
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
    kv_cache_memory_bytes: int = 256 * 2**20
    enable_prefix_caching: bool = True
    api_key: str | None = None
    device: str = "cpu"
    dtype: str | None = None
    seed: int = 0
    dist: DistConfig = field(default_factory=DistConfig)


def num_kv_blocks(cfg: ModelConfig, opts: ServeOptions, max_len: int) -> int:
    """The same on every stage: the budget over the bytes a block takes in all layers, capped
    at what ``max_num_seqs`` full-length sequences could use."""
    if opts.num_gpu_blocks_override is not None:
        return opts.num_gpu_blocks_override
    itemsize = DTYPE_BYTES[opts.dtype or cfg.torch_dtype]
    per_block = opts.block_size * cfg.num_kv_heads * cfg.head_dim * 2 * itemsize * cfg.num_layers
    cap = opts.max_num_seqs * -(-max_len // opts.block_size)
    return max(1, min(cap, opts.kv_cache_memory_bytes // per_block))


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
    return cfg, max_len


def run_serve(opts: ServeOptions) -> None:
    check(opts)
    launch(opts.dist, _worker, opts)


def build_stage(
    opts: ServeOptions, rank: int = 0, world: int = 1
) -> tuple[Pipeline, Engine | None]:
    """This rank's stage, and on rank 0 the engine that drives the pipeline."""
    cfg, max_len = check(opts)
    blocks = num_kv_blocks(cfg, opts, max_len)
    session = Session.load(
        opts.model_dir, opts.max_num_seqs, max_len, stage_device(opts.dist), opts.dtype,
        stage_layers(opts.partition, rank), opts.block_size, blocks,
    )  # fmt: skip
    pipe = Pipeline(session, rank, world, opts.seed)
    if rank != 0:
        return pipe, None
    config = EngineConfig(
        max_len, opts.max_num_seqs, opts.max_num_batched_tokens, opts.block_size, blocks,
        opts.enable_prefix_caching,
    )  # fmt: skip
    return pipe, Engine(pipe, session.tokenizer, config)


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
