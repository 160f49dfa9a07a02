"""The one assembly point: every command, test and benchmark builds its stages and engine here.

``EngineOptions`` holds what an engine is made of (model, limits, memory, scheduling,
parallelism) under vLLM's flag names; ``check`` validates it once; ``build_stage`` loads this
rank's stage, sizes and allocates its KV cache, compiles and captures, and on the driving rank
returns the ``Engine`` that ``engine_for`` wires to the pipeline. A rule about limits lives here
or in ``Engine.new_request`` and nowhere else.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from engramrt.config import ModelConfig, load_json
from engramrt.engine.engine import Engine, EngineConfig
from engramrt.engine.speculative import SpecConfig
from engramrt.engram import load_tokenizer
from engramrt.kernels import compiles, set_batch_invariant
from engramrt.kernels.compiles import compilations, count_compilations
from engramrt.model.checkpoint import check_layer_count, default_dtype
from engramrt.models import model_config
from engramrt.parallel.faults import inject_stage_faults
from engramrt.parallel.launch import DistConfig, stage_device
from engramrt.parallel.partition import stage_layers
from engramrt.parallel.pipeline import Pipeline
from engramrt.runner.carry import Carry
from engramrt.runner.graphs import MAX_GRAPH_TOKENS, graph_shapes, output_rows
from engramrt.runner.kv_budget import (
    CPU_KV_BYTES,
    blocks_from_bytes,
    blocks_from_profile,
    stages_per_gpu,
)
from engramrt.runner.stage import StageRunner
from engramrt.tensor_parallel import TensorParallel


@dataclass
class EngineOptions:
    model_dir: Path
    partition: list[int]
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_gpu_blocks_override: int | None = None
    kv_cache_memory_bytes: int | None = None  # default: by --gpu-memory-utilization on CUDA
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False
    batch_invariant: bool = False  # --batch-invariant: dense products row-invariant on a GPU
    enable_prefix_caching: bool = True
    # overlap scheduling; None: on wherever it gives the same outputs (one stage of one rank),
    # as vLLM's default
    async_scheduling: bool | None = None
    long_prefill_token_threshold: int = 0  # a prompt's tokens per step, at most (0: the budget)
    speculative_config: str | None = None  # --speculative-config (JSON)
    engram: bool = True  # False: every Engram layer skipped on purpose (an ablation)
    table_memory: str = "auto"  # where the Engram tables live (--engram-table-memory)
    dtype: str | None = None
    seed: int = 0
    dist: DistConfig = field(default_factory=DistConfig)  # the device too (``dist.device``)
    warm_up: bool = True  # compile every mixed-step kernel variant before the first request

    @property
    def speculative(self) -> SpecConfig | None:
        """``--speculative-config`` parsed (a bad one: a ValueError naming the rule)."""
        return SpecConfig.parse(self.speculative_config)

    @property
    def dspark(self) -> bool:
        """Drafts from V4.1's DSpark stages (``--speculative-config`` method ``dspark``)."""
        spec = self.speculative
        return spec is not None and spec.method == "dspark"

    @property
    def verify_drafts(self) -> int:
        """Drafts a row of the verify graphs (0: no speculation)."""
        spec = self.speculative
        return spec.num_speculative_tokens if spec is not None else 0

    @property
    def overlap(self) -> bool:
        """Whether the engine schedules step N+1 before it reads step N's tokens."""
        if self.async_scheduling is not None:
            return self.async_scheduling
        return len(self.partition) == 1 and self.dist.tp_size == 1


def check(opts: EngineOptions, notes: bool = True) -> tuple[ModelConfig, int]:
    """Every engine option checked before any stage starts: the model's config and the
    context length in force; ``notes``: log what the config says that is read otherwise
    (once, by the command: not again by each stage)."""
    cfg = model_config(load_json(opts.model_dir))
    for note in cfg.notes if notes else ():
        log(f"warning: {note}")
    max_len = cfg.max_position_embeddings if opts.max_model_len is None else opts.max_model_len
    if not 1 <= max_len <= cfg.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {max_len} must lie in [1, {cfg.max_position_embeddings}] "
            "(the model's max_position_embeddings)"
        )
    for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
        if getattr(opts, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if opts.long_prefill_token_threshold < 0:
        raise ValueError("--long-prefill-token-threshold must be >= 0 (0: off)")
    if opts.async_scheduling and (len(opts.partition) > 1 or opts.dist.tp_size > 1):
        raise ValueError("--async-scheduling needs one pipeline stage of one rank (-pp 1 -tp 1)")
    if not 0 < opts.gpu_memory_utilization <= 1:
        raise ValueError(
            f"--gpu-memory-utilization must lie in (0, 1], got {opts.gpu_memory_utilization}"
        )
    if opts.num_gpu_blocks_override is not None and opts.num_gpu_blocks_override < 1:
        raise ValueError("--num-gpu-blocks-override must be >= 1 (no block holds no token)")
    _check_slot_state(opts, max_len)
    tokens = load_tokenizer(opts.model_dir).get_vocab_size(with_added_tokens=True)
    if tokens > cfg.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokens} tokens but the model's vocab_size is {cfg.vocab_size}: "
            "ids past it have no embedding row (a tokenizer of another model?)"
        )
    check_layer_count(opts.model_dir, cfg)
    stages = [stage_layers(opts.partition, r) for r in range(len(opts.partition))]
    cfg.family.check_options(cfg, opts.block_size, stages)
    if opts.dist.tp_size > 1:
        cfg.family.check_tensor_parallel(cfg, TensorParallel(0, opts.dist.tp_size))
    if opts.dspark:
        _check_dspark(opts, cfg)
    return cfg, max_len


def _check_dspark(opts: EngineOptions, cfg: ModelConfig) -> None:
    """DSpark drafts need its stages, at most a block of drafts, and the target layers on the
    last pipeline stage (which drafts)."""
    cfg.family.check_drafting(cfg, stage_layers(opts.partition, len(opts.partition) - 1))
    if opts.dist.tp_size > 1:  # its followers would have to draft beside it, in its collectives
        raise ValueError(
            "--speculative-config method 'dspark' runs without tensor parallelism "
            "for now (-tp 1): the last stage's TP followers do not draft"
        )
    k, block = opts.speculative.num_speculative_tokens, cfg.family.draft_block(cfg)
    if k > block:
        raise ValueError(
            f"num_speculative_tokens {k} exceeds the DSpark block ({block} drafts a pass)"
        )


SLOT_STATE_BYTES = 4 << 30  # per-slot state (token rows, block tables) all slots may take


def _check_slot_state(opts: EngineOptions, max_len: int) -> None:
    """Every slot keeps a token row of ``max_len`` positions and a block table on its stage:
    sizes that cannot be allocated are an error before anything is."""
    per_slot = 4 * (max_len + 1) + 8 * -(-max_len // opts.block_size)
    need = opts.max_num_seqs * per_slot
    if need > SLOT_STATE_BYTES:
        length = (
            f"--max-model-len {max_len}"
            if opts.max_model_len is not None
            else f"max_position_embeddings {max_len} (no --max-model-len)"
        )
        raise ValueError(
            f"--max-num-seqs {opts.max_num_seqs} sequences of {length} need "
            f"{need / 2**30:.1f} GiB of per-slot state (token rows, block tables), more than "
            f"{SLOT_STATE_BYTES >> 30} GiB: lower one of them"
        )


def kv_blocks(runner: StageRunner, opts: EngineOptions, cfg: ModelConfig, max_len: int) -> int:
    """``--num-gpu-blocks-override``; else a byte budget (``--kv-cache-memory-bytes``, or a
    default off GPU) over all the model's layers, capped at what ``max_num_seqs`` full-length
    sequences could use; else, on CUDA, what ``--gpu-memory-utilization`` leaves after a
    profiled forward of the largest batch the scheduler can form. Stages spawned onto one GPU
    split it."""
    if opts.num_gpu_blocks_override is not None:
        return opts.num_gpu_blocks_override
    model, family = runner.model, cfg.family  # the cache's own dtype, as loaded

    def per_block(layers: list[int]) -> int:
        return family.block_bytes(model, layers, opts.block_size)

    def fixed(layers: list[int]) -> int:  # per slot, not per block (V4.1's rings and tails)
        slots, snaps = opts.max_num_seqs, snapshots_for(opts, cfg)
        return family.slot_bytes(model, layers, slots, snaps, opts.verify_drafts)

    if runner.device.type != "cuda" or opts.kv_cache_memory_bytes is not None:
        cap = opts.max_num_seqs * -(-max_len // opts.block_size)
        every = list(range(cfg.num_layers))
        stages = [i for i in runner.model.cache_layer_ids if i >= cfg.num_layers]  # DSpark's rings
        held, block = fixed(every + stages), per_block(every)
        budget = (opts.kv_cache_memory_bytes or CPU_KV_BYTES) - held
        if budget < block:
            raise ValueError(
                f"the KV cache budget cannot hold the per-sequence state of --max-num-seqs "
                f"{opts.max_num_seqs} sequences ({held / 2**20:.0f} MiB of window rings, "
                "their snapshots and compressor tails): lower --max-num-seqs or raise "
                "--kv-cache-memory-bytes"
            )
        return blocks_from_bytes(budget, block, cap)
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
    per, rings = per_block(model.layer_ids), fixed(model.cache_layer_ids)
    return blocks_from_profile(
        profile, opts.gpu_memory_utilization, per, share, graph_rows, outputs, rings
    )


def build_stage(
    opts: EngineOptions, rank: int = 0, world: int = 1
) -> tuple[Pipeline, Engine | None]:
    """This rank's stage, and on the driving rank the engine that drives the pipeline."""
    cfg, max_len = check(opts, notes=False)
    device = stage_device(opts.dist)
    layers = stage_layers(opts.partition, rank)
    set_batch_invariant(opts.batch_invariant or os.environ.get("VLLM_BATCH_INVARIANT") == "1")
    runner = StageRunner.load(
        opts.model_dir,
        opts.max_num_seqs,
        max_len,
        device,
        opts.dtype or default_dtype(cfg.torch_dtype, device),
        layers,
        opts.block_size,
        num_blocks=0,
        seed=opts.seed,
        table_memory=opts.table_memory,
        dspark=opts.dspark and layers[-1] == cfg.num_layers - 1,  # the last stage drafts
    )
    inject_stage_faults(runner, rank)  # test-only, from the environment (A/B arms)
    pipe = Pipeline(runner, rank, world)
    driver = pipe.is_driver
    if not opts.engram:
        runner.model.disable_engram()
        if driver:
            log("--engram off: every Engram layer is skipped (an ablation)")
    blocks = _agree(kv_blocks(runner, opts, cfg, max_len), device)
    runner.allocate_kv(
        opts.max_num_seqs,
        max_len,
        opts.block_size,
        blocks,
        snapshots_for(opts, cfg),
        opts.verify_drafts,
    )
    if driver and device.type == "cuda":
        gib = runner.kv.nbytes / 2**30
        log(
            f"KV cache {blocks} blocks = {blocks * opts.block_size} tokens ({gib:.2f} GiB on "
            "stage 0)"
        )
    counting = count_compilations()
    if opts.warm_up:
        runner.warm_up(opts.max_num_batched_tokens)  # kernel variants compiled now
    verify = opts.verify_drafts
    if verify:
        speculate(runner, opts)
    if device.type == "cuda" and not opts.enforce_eager:
        runner.capture_graphs(opts.max_num_seqs, opts.max_num_batched_tokens, verify)
        if verify and driver:
            log(
                f"verify steps of {verify} drafts a row replay CUDA graphs (each decoding row is "
                f"given {verify}: a lookup that finds fewer repeats its last token); others run "
                "eagerly"
            )
    if driver and counting and compilations():
        log(f"{compilations()} Triton kernel variants compiled at start-up")
    compiles.serving()
    if not driver:
        return pipe, None
    return pipe, engine_for(pipe, opts, cfg, max_len)


def engine_for(pipe: Pipeline, opts: EngineOptions, cfg: ModelConfig, max_len: int) -> Engine:
    """The engine over a pipeline whose driving stage has its KV cache."""
    kv = pipe.runner.kv
    k = opts.verify_drafts
    if k:
        cfg.family.check_cache(cfg, kv, k)
    if k and pipe.runner.verifier is None and pipe.runner.graphs is None:
        speculate(pipe.runner, opts)  # a runner set up by hand (tests, benchmarks)
    if k and pipe.can_overlap and pipe.runner.verifier is None:
        raise ValueError(
            "a stage that keeps its samples verifies drafts itself: "
            "StageRunner.speculate before capture_graphs"
        )
    snapshots = kv.num_snapshots
    prefix_caching = opts.enable_prefix_caching
    if prefix_caching and not snapshots and cfg.family.default_snapshots(opts.max_num_seqs):
        log("prefix caching is off: this V4.1 cache keeps no window snapshots")
        prefix_caching = False
    config = EngineConfig(
        max_len,
        opts.max_num_seqs,
        opts.max_num_batched_tokens,
        opts.block_size,
        kv.num_blocks,
        prefix_caching,
        cfg.eos_token_id,
        cfg.vocab_size,
        opts.overlap and (bool(opts.async_scheduling) or pipe.can_overlap),
        opts.long_prefill_token_threshold,
        opts.speculative,
        uniform_drafts=pipe.runner.graphs is not None,
        # V4.1 is served text-only (no vision tower): its image token is refused in prompts
        text_only_image_token=cfg.engram.image_token_id if cfg.family.refuses_images() else None,
        window_snapshots=snapshots,
    )
    return Engine(pipe, pipe.runner.tokenizer, config)


def speculate(runner: StageRunner, opts: EngineOptions) -> None:
    """The stage's device half of speculative decoding (``StageRunner.speculate``)."""
    spec = opts.speculative
    lookup = (spec.prompt_lookup_max, spec.prompt_lookup_min) if spec.method == "ngram" else None
    runner.speculate(spec.num_speculative_tokens, lookup)


def snapshots_for(opts: EngineOptions, cfg: ModelConfig) -> int:
    """The per-request snapshots prefix caching needs (V4.1's windows); none without it."""
    return cfg.family.default_snapshots(opts.max_num_seqs) if opts.enable_prefix_caching else 0


def log(line: str) -> None:
    """A start-up line: stderr, so that what a command prints stays its output."""
    print(f"engramrt: {line}", file=sys.stderr, flush=True)


def _agree(blocks: int, device: torch.device) -> int:
    """Every rank gets the smallest rank's block count: rank 0's block manager hands out ids
    that all ranks' caches must hold."""
    if not dist.is_initialized():
        return blocks
    where = device if dist.get_backend() == "nccl" else torch.device("cpu")
    t = torch.tensor([blocks], dtype=torch.int64, device=where)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return int(t.item())
