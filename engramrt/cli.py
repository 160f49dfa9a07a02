"""``engramrt`` command line: one console script with subcommands, vLLM style."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import torch

from engramrt.bundled import DEFAULT_MODEL_DIR, resolve_model_dir


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
    from engramrt.generate import generate as run
    from engramrt.model.trace import EngramUpdateStats
    from engramrt.session import Session

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    session = Session.load(resolve_model_dir(args.model), device=device, dtype=args.dtype)
    stats = EngramUpdateStats() if args.engram_stats else None
    out = run(session, args.prompt, args.max_tokens, args.temperature, args.top_p, args.seed, stats)
    print(out.text)
    if stats is not None:
        for layer, row in stats.summary().items():
            print(
                f"[engram layer {layer}: update RMS {row['update_rms']:.4f} on a stream of RMS "
                f"{row['stream_rms']:.4f}, {100 * row['changed_frac']:.2f}% of elements changed]",
                file=sys.stderr,
            )
    n = len(out.token_ids)
    print(
        f"[{len(out.prompt_ids)} prompt + {n} generated tokens, finish_reason={out.finish_reason}, "
        f"{n / out.seconds:.1f} tok/s on {device}]",
        file=sys.stderr,
    )
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
    g.set_defaults(func=generate)
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


if __name__ == "__main__":
    raise SystemExit(main())
