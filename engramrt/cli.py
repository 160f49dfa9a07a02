"""``engramrt`` command line: one console script with subcommands, vLLM style."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import torch
from torch.multiprocessing.spawn import ProcessException, ProcessExitedException

from engramrt.bundled import DEFAULT_MODEL_DIR, resolve_model_dir
from engramrt.commands.flags import add_dist_flags, add_memory_flags, dist_config


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError as exc:
        msg = f"--token-ids must be comma-separated integers: {text!r}"
        raise argparse.ArgumentTypeError(msg) from exc


def engram_hash(args: argparse.Namespace) -> int:
    from engramrt.engram import load_hasher

    hasher, tokenizer = load_hasher(args.model or DEFAULT_MODEL_DIR)  # needs no weights
    ids = args.token_ids if args.token_ids is not None else tokenizer.encode(args.text).ids
    if not ids:
        raise ValueError("nothing to hash: the input has no tokens")
    tokens = torch.tensor(ids, dtype=torch.int64)
    hashes = hasher.extend(tokens, torch.tensor([0]), torch.tensor([len(ids)]), torch.tensor([0]))
    dead = hasher.is_dead(tokens)
    layer_ids = hasher.layout.config.layer_ids
    rows = []
    for p, tok in enumerate(ids):
        rows.append(
            {
                "position": p,
                "token_id": tok,
                "token": tokenizer.id_to_token(tok),
                "compressed_id": None if dead[p] else int(hasher.token_map[tok]),
                "hash_ids": {str(lid): hashes[p, k].tolist() for k, lid in enumerate(layer_ids)},
            }
        )
    if args.json:
        json.dump({"engram_layer_ids": list(layer_ids), "tokens": rows}, sys.stdout)
        print()
        return 0
    for r in rows:
        print(
            f"pos {r['position']:>4}  token {r['token_id']:>7} {r['token']!r}  "
            f"compressed {r['compressed_id']}"
        )
        for lid, col in r["hash_ids"].items():
            print(f"    layer {lid:>3}: {' '.join(map(str, col))}")
    return 0


def generate(args: argparse.Namespace) -> int:
    from engramrt.commands.generate import GenerateOptions, run_generate
    from engramrt.config import load_json, model_config
    from engramrt.parallel.partition import resolve_partition

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model_dir = resolve_model_dir(args.model)
    layers = model_config(load_json(model_dir)).num_layers
    opts = GenerateOptions(
        model_dir=model_dir,
        prompt=args.prompt,
        partition=resolve_partition(layers, args.pipeline_parallel_size, args.pp_layer_partition),
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        dtype=args.dtype,
        dist=dist_config(args, device),
        trace_path=args.engram_trace,
        engram_stats=args.engram_stats,
    )
    run_generate(opts)
    return 0


def check_pp(args: argparse.Namespace) -> int:
    from engramrt.commands.check_pp import CheckOptions, check_pp, format_report

    device = args.device or "cpu"
    prompts = None
    if args.prompts:
        with open(args.prompts) as f:
            prompts = [line.rstrip("\n") for line in f if line.strip()]
        if not prompts:
            raise ValueError(f"{args.prompts} holds no prompts (one per line)")
    opts = CheckOptions(
        model_dir=resolve_model_dir(args.model),
        stages=args.stages,
        max_partitions=args.max_partitions,
        decode_steps=args.decode_steps,
        dtype=args.dtype,
        atol=args.atol,
        enforce_eager=args.enforce_eager,
        dist=dist_config(args, device),
    )
    if prompts:
        opts.prompts = prompts
    report = check_pp(opts)
    if report is None:
        return 0
    print(format_report(report))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if report["ok"] else 1


def serve(args: argparse.Namespace) -> int:
    import os

    from engramrt.commands.serve import ServeOptions, run_serve
    from engramrt.config import load_json, model_config
    from engramrt.parallel.partition import resolve_partition

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model_dir = resolve_model_dir(args.model_tag or args.model)
    layers = model_config(load_json(model_dir)).num_layers
    name = args.served_model_name or [
        "engramrt-tiny" if (args.model_tag or args.model) is None else str(model_dir)
    ]
    opts = ServeOptions(
        model_dir=model_dir,
        partition=resolve_partition(layers, args.pipeline_parallel_size, args.pp_layer_partition),
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="engramrt", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("engram-hash", help="print each token's Engram hash ids")
    p.add_argument("--model", help="HF-style model directory (default: the bundled tiny model)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="text to tokenize and hash")
    src.add_argument("--token-ids", type=_parse_ids, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--json", action="store_true", help="print one JSON document")
    p.set_defaults(func=engram_hash)

    g = sub.add_parser("generate", help="complete a prompt (prefill + decode with a KV cache)")
    g.add_argument("--model", help="HF-style model directory (default: the bundled tiny model)")
    g.add_argument("--prompt", required=True)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available")
    g.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: the config's")
    g.add_argument(
        "--engram-stats", action="store_true", help="print each Engram's update RMS and reach"
    )
    g.add_argument("--engram-trace", metavar="PATH", help="JSON lines of stage/Engram checksums")
    add_dist_flags(g)
    g.set_defaults(func=generate)

    c = sub.add_parser("check-pp", help="every layer partition must reproduce PP = 1 exactly")
    c.add_argument("--model", help="HF-style model directory (default: the bundled tiny model)")
    c.add_argument("--stages", type=int, default=2)
    c.add_argument("--max-partitions", type=int, help="at most K (entry-on-Engram ones always)")
    c.add_argument("--prompts", metavar="FILE", help="one prompt per line")
    c.add_argument("--decode-steps", type=int, default=8)
    c.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    c.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    c.add_argument("--atol", type=float, default=0.0, help="allowed max |dlogit| (default 0)")
    c.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    c.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs for decode")
    add_dist_flags(c)
    c.set_defaults(func=check_pp)

    v = sub.add_parser("serve", help="OpenAI-compatible server (vLLM's flag names)")
    v.add_argument("model_tag", nargs="?", help="model directory (default: the bundled model)")
    v.add_argument("--model", help="same as the positional MODEL")
    v.add_argument("--host", default="127.0.0.1")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--served-model-name", nargs="+", help="names in /v1/models and responses")
    v.add_argument("--max-model-len", type=int, help="default: the model's maximum")
    v.add_argument("--max-num-seqs", type=int, default=256)
    v.add_argument("--max-num-batched-tokens", type=int, default=2048, help="also the chunk size")
    v.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    v.add_argument("--num-gpu-blocks-override", type=int, help="KV blocks (default: by memory)")
    add_memory_flags(v)
    v.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    v.add_argument("--api-key", help="require this bearer key on /v1/* ($VLLM_API_KEY works)")
    v.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available")
    v.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: the config's")
    v.add_argument("--seed", type=int, default=0, help="for requests that bring no seed")
    add_dist_flags(v)
    v.set_defaults(func=serve)

    from engramrt.commands.bench_serve import add_bench_parser

    add_bench_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # output piped into e.g. `head`: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except (ValueError, OSError) as exc:
        print(f"engramrt {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ProcessExitedException as exc:  # the stage printed its own one-line error
        print(f"engramrt {args.command}: error: {exc}", file=sys.stderr)
        return exc.exit_code if exc.exit_code == 2 else 1
    except ProcessException as exc:  # a stage raised; its traceback is in exc
        print(f"engramrt {args.command}: error: a stage process failed:\n{exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())
