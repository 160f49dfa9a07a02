"""Host cost of detokenising a growing output: the full re-decode every step (what the engine
did before) against ``IncrementalDecoder``, per token, at several output lengths.

    python benchmarks/detok_bench.py
"""

from __future__ import annotations

import argparse
import random
import time

from engramrt.bundled import resolve_model_dir
from engramrt.engine.detokenize import IncrementalDecoder
from engramrt.engram import load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 1024])
    args = ap.parse_args()
    tok = load_tokenizer(resolve_model_dir(None))
    rng = random.Random(0)
    print("| output tokens | full re-decode (us/token) | incremental (us/token) | ratio |")
    print("|---:|---:|---:|---:|")
    for n in args.lengths:
        seqs = [[rng.randrange(6, 1024) for _ in range(n)] for _ in range(32)]
        t0 = time.perf_counter()
        for ids in seqs:
            for i in range(1, n + 1):
                tok.decode(ids[:i], skip_special_tokens=True)
        full = (time.perf_counter() - t0) / (32 * n) * 1e6
        t0 = time.perf_counter()
        for ids in seqs:
            text = IncrementalDecoder(tok)
            for i in range(1, n + 1):
                text(ids[:i])
        inc = (time.perf_counter() - t0) / (32 * n) * 1e6
        print(f"| {n} | {full:.1f} | {inc:.1f} | {full / inc:.1f}x |")


if __name__ == "__main__":
    main()
