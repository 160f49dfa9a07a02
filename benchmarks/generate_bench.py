"""`engramrt generate` on the bundled model: greedy tokens on each device/dtype compared with CPU
fp32 in the same run, and decode speed (eager, batch 1).

    python benchmarks/generate_bench.py [--max-tokens 64]
"""

from __future__ import annotations

import argparse

import torch

from engramrt.bundled import resolve_model_dir
from engramrt.commands.generate import GenerateOptions, generate
from engramrt.config import load_json
from engramrt.engine.build import build_stage
from engramrt.models import model_config
from engramrt.parallel.launch import DistConfig
from engramrt.prompts import PromptEncoder

PROMPT = "The quick brown fox jumps over the lazy dog, and the Engram"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()
    model_dir = resolve_model_dir(None)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    ref = None
    print(
        f"{'device':6} {'dtype':9} {'tokens':>6} {'tok/s':>8} {'common prefix with cpu fp32':>28}"
    )
    for device in devices:
        for dtype in ("float32", "bfloat16"):
            layers = model_config(load_json(model_dir)).num_layers
            opts = GenerateOptions(model_dir, [layers], dist=DistConfig(device=device), dtype=dtype)
            engine = build_stage(opts)[1]
            prompts = PromptEncoder.load(model_dir, engine.tokenizer)
            generate(engine, prompts, PROMPT, 4)  # warm-up
            out = generate(engine, prompts, PROMPT, args.max_tokens)
            ref = out.token_ids if ref is None else ref
            same = next(
                (i for i, (a, b) in enumerate(zip(out.token_ids, ref, strict=False)) if a != b),
                min(len(ref), len(out.token_ids)),
            )
            rate = len(out.token_ids) / out.seconds
            print(
                f"{device:6} {dtype:9} {len(out.token_ids):>6} {rate:>8.1f} {same:>10}/{len(ref)}"
            )


if __name__ == "__main__":
    main()
