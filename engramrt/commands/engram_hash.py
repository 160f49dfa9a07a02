"""``engramrt engram-hash``: every token's Engram hash ids, from the tokenizer and the hash
layout alone (no weights are loaded), to compare against another implementation's."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from engramrt.bundled import DEFAULT_MODEL_DIR
from engramrt.commands.flags import add_model_flag
from engramrt.engram import load_hasher


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(v) for v in text.replace(" ", "").split(",") if v]
    except ValueError as exc:
        msg = f"--token-ids must be comma-separated integers: {text!r}"
        raise argparse.ArgumentTypeError(msg) from exc


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_flag(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", help="text to tokenize and hash")
    src.add_argument("--token-ids", type=_parse_ids, help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--json", action="store_true", help="print one JSON document")


def run(args: argparse.Namespace) -> int:
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
