"""Flags that several subcommands share: one definition keeps their names, defaults and help
text the same wherever they appear."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from engramrt.config import load_json
from engramrt.engine.build import EngineOptions
from engramrt.models import model_config
from engramrt.parallel.launch import DistConfig
from engramrt.parallel.partition import resolve_partition

DEVICES = ["cpu", "cuda"]
DTYPES = ["float32", "bfloat16"]


def add_model_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF-style model directory (default: the bundled tiny model)")


def add_device_flags(p: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype`` left open: see :func:`resolve_device`; no dtype means the
    model config's on a GPU, float32 on a CPU (``engramrt.model.checkpoint.default_dtype``)."""
    p.add_argument("--device", choices=DEVICES, help="default: cuda if available")
    p.add_argument(
        "--dtype", choices=DTYPES, help="default: the config's on a GPU, float32 on a CPU"
    )


def add_engram_memory_flags(p: argparse.ArgumentParser) -> None:
    """Where the Engram tables live (``engramrt.engram.host_memory``); vLLM's
    ``--engram-config '{"cpu_offload": true}'`` is read as ``host``."""
    p.add_argument(
        "--engram-table-memory",
        choices=["auto", "device", "host"],
        default="auto",
        help="host: the tables stay in pinned host memory (huge pages) and the GPU reads their "
        "rows in place; auto: host when a stage's tables would take over half its GPU",
    )
    p.add_argument(
        "--engram-config",
        metavar="JSON",
        help='vLLM\'s form: {"cpu_offload": true} is --engram-table-memory host, false device',
    )


def engram_table_memory(args: argparse.Namespace) -> str:
    """The placement the two flags ask for; a config key engramrt does not know is an error."""
    if args.engram_config is None:
        return args.engram_table_memory
    try:
        cfg = json.loads(args.engram_config)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--engram-config is not JSON: {exc}") from None
    if not isinstance(cfg, dict) or set(cfg) - {"cpu_offload"}:
        raise ValueError(f'--engram-config takes {{"cpu_offload": true|false}}, got {cfg}')
    if "cpu_offload" not in cfg:
        return args.engram_table_memory
    want = "host" if cfg["cpu_offload"] else "device"
    if args.engram_table_memory not in ("auto", want):
        raise ValueError(
            f"--engram-config cpu_offload={cfg['cpu_offload']} contradicts "
            f"--engram-table-memory {args.engram_table_memory}"
        )
    return want


def resolve_device(device: str | None) -> str:
    """What an unset ``--device`` means."""
    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def add_dist_flags(p: argparse.ArgumentParser) -> None:
    """Pipeline and tensor parallelism, and how their processes meet."""
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="ranks per pipeline stage, each holding a slice of every layer (world = TP x PP)",
    )
    p.add_argument(
        "--pp-layer-partition",
        help="layers per stage, e.g. 14,26 (also $ENGRAMRT_PP_LAYER_PARTITION or "
        "$VLLM_PP_LAYER_PARTITION with -pp > 1); "
        "default: vLLM's even split",
    )
    p.add_argument("--distributed-backend", choices=["gloo", "nccl"], help="default: by device")
    p.add_argument("--master-addr", help="default: $MASTER_ADDR or 127.0.0.1")
    p.add_argument("--master-port", type=int, help="default: $MASTER_PORT or a free port")
    p.add_argument("--distributed-timeout", type=float, default=600.0, help="seconds")


def dist_config(args: argparse.Namespace, device: str) -> DistConfig:
    """How the stage processes meet, from the :func:`add_dist_flags` values."""
    return DistConfig(
        pp_size=args.pipeline_parallel_size,
        tp_size=args.tensor_parallel_size,
        device=device,
        backend=args.distributed_backend,
        master_addr=args.master_addr,
        master_port=args.master_port,
        timeout_s=args.distributed_timeout,
    )


def layer_partition(args: argparse.Namespace, model_dir: Path) -> list[int]:
    """Layers per stage that the :func:`add_dist_flags` values ask for, for this model."""
    layers = model_config(load_json(model_dir)).num_layers
    return resolve_partition(layers, args.pipeline_parallel_size, args.pp_layer_partition)


def add_memory_flags(p: argparse.ArgumentParser) -> None:
    """How much memory the engine may take and how its GPU steps run: the KV cache budget, CUDA
    graphs, batch invariance."""
    p.add_argument(
        "--kv-cache-memory-bytes",
        type=int,
        help="KV cache budget over all layers (default: by --gpu-memory-utilization on CUDA, "
        "256 MiB on CPU)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.9,
        help="share of GPU memory for weights, activations and the KV cache (default 0.9)",
    )
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument(
        "--batch-invariant",
        action="store_true",
        help="a request's tokens the same alone or in any batch on a GPU: dense products "
        "through a kernel whose summation order ignores the step's other rows (V4.1's stored-"
        "format linears are so always; a CPU step always is)",
    )


def add_scheduling_flags(p: argparse.ArgumentParser) -> None:
    """Overlap scheduling and the prompt-chunk cap (vLLM's flag names)."""
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="prepare and launch step N+1 while the GPU runs step N; the host reads a step's "
        "tokens one step late (same outputs). Default: on with one pipeline stage of one rank, "
        "off otherwise",
    )
    p.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=0,
        help="a prompt computes at most this many tokens a step, so the decode rows that share "
        "the step wait less for it (0: up to --max-num-batched-tokens)",
    )
    p.add_argument(
        "--speculative-config",
        help="speculative decoding, vLLM's JSON: n-gram (prompt-lookup) drafts, "
        '\'{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
        "\"prompt_lookup_min\": 2}', or DeepSeek-V4.1's DSpark stages, "
        '\'{"method": "dspark", "num_speculative_tokens": 2}\'',
    )


def options_from_args(
    args: argparse.Namespace, model_dir: Path, cls: type[EngineOptions] = EngineOptions, **fields
) -> EngineOptions:
    """The ``cls`` (``EngineOptions`` or a command's extension of it) that the shared flags
    (``engramrt.commands.flags``) ask for; ``fields`` set or override the rest."""
    device = fields.pop("device", None) or args.device
    taken = {
        name: getattr(args, name)
        for name in (
            "max_model_len",
            "max_num_seqs",
            "max_num_batched_tokens",
            "block_size",
            "num_gpu_blocks_override",
            "kv_cache_memory_bytes",
            "enforce_eager",
            "batch_invariant",
            "gpu_memory_utilization",
            "async_scheduling",
            "long_prefill_token_threshold",
            "speculative_config",
            "dtype",
            "seed",
            "enable_prefix_caching",
        )
        if hasattr(args, name)
    }
    return cls(
        model_dir=model_dir,
        partition=layer_partition(args, model_dir),
        table_memory=engram_table_memory(args),
        dist=dist_config(args, device),
        **{**taken, **fields},
    )
