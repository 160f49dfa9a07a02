"""V4.1's sparse attention, indexer-score and top-k selection kernels alone at Flash's widths
(issue 34 item 8): GPU time of a CUDA-graph replay after an L2 flush, against the byte floor
(what a launch must read and write once: queries, each token's window rows and picked rows or
its request's index keys or its scores, the output) over the copy bandwidth measured in the
same run. The selection also against the torch path's stable sort, on rows as wide as a CUDA
graph's (``--capacity`` positions) and as an eager step's (the context).

    python benchmarks/v41_kernels_bench.py --out v41_kernels.json [--context 4096]

Decode: ``bs`` requests at position ``context - 1``, one token each, every request's window in
its own ring slot, ``index_topk`` distinct picks each in its own compressed rows, its own index
keys (ratio 2: ``context / 2`` entries). Prefill: one run of ``--prefill`` tokens.
"""

from __future__ import annotations

import argparse
import functools
import json

import torch

from benchmarks.hash_bench import copy_bandwidth_gbs
from benchmarks.stored_linear_bench import graph_us
from engramrt.kernels.index_scores import index_scores
from engramrt.kernels.sparse_attention import sparse_attention
from engramrt.kernels.top_select import top_select
from engramrt.models.deepseek_v41.attention import sorted_picks

HEADS, D, WINDOW, TOPK = 64, 512, 128, 512  # V4.1-Flash (bundled config)
INDEX_HEADS, INDEX_D, RATIO, BLOCK = 32, 128, 2, 16


def attention_case(bs: int, run: int, context: int, dev: str):
    """``bs`` runs of ``run`` tokens ending at ``context``: the launch, and its bytes."""
    g = torch.Generator(device=dev).manual_seed(bs * 7 + run)
    t = bs * run
    bf = torch.bfloat16
    q = torch.randn(t, HEADS, D, device=dev, generator=g, dtype=torch.float32).to(bf)
    kv = torch.randn(t, D, device=dev, generator=g).to(bf)
    ring = torch.randn((bs + 1) * WINDOW, D, device=dev, generator=g).to(bf)
    comp = torch.randn(bs * context // RATIO, D, device=dev, generator=g).to(bf)
    req = torch.arange(bs, device=dev).repeat_interleave(run)
    pos = (context - run + torch.arange(run, device=dev)).repeat(bs)
    seen = (pos + 1) // RATIO
    # distinct picks among what each token sees, in its request's own rows
    picks = torch.rand(t, context // RATIO, device=dev, generator=g).argsort(-1)[:, :TOPK]
    picks = torch.where(picks < seen[:, None], picks + req[:, None] * (context // RATIO), -1)
    p0 = torch.full_like(pos, context - run)
    q0 = req * run
    sink = torch.zeros(HEADS, device=dev)

    def launch():
        return sparse_attention(q, kv, ring, comp, picks, pos, p0, q0, req, sink, D**-0.5, WINDOW)

    # unique rows: the run's latents, the ring's earlier window, the distinct picks
    rows = bs * (run + WINDOW - 1 + min(context // RATIO, TOPK * run))
    nbytes = 2 * (2 * q.numel() + rows * D) + picks.numel() * 8
    flops = 4 * t * HEADS * D * (min(WINDOW, context) + TOPK)
    return launch, nbytes, flops


def index_case(bs: int, run: int, context: int, dev: str):
    g = torch.Generator(device=dev).manual_seed(bs * 11 + run)
    t, count = bs * run, context // RATIO
    per = -(-context // BLOCK)
    q = torch.randn(t, INDEX_HEADS, INDEX_D, device=dev, generator=g).bfloat16()
    w = torch.rand(t, INDEX_HEADS, device=dev, generator=g).bfloat16()
    keys = torch.randn(bs * per * BLOCK // RATIO, INDEX_D, device=dev, generator=g).bfloat16()
    table = torch.randperm(bs * per, device=dev, generator=g).view(bs, per)
    req = torch.arange(bs, device=dev).repeat_interleave(run)
    pos = (context - run + torch.arange(run, device=dev)).repeat(bs)

    def launch():
        return index_scores(q, w, keys, table, req, pos, RATIO, BLOCK, count)

    nbytes = 2 * (q.numel() + w.numel() + bs * count * INDEX_D + t * count)
    flops = 2 * t * INDEX_HEADS * INDEX_D * count
    return launch, nbytes, flops


def select_case(bs: int, run: int, context: int, dev: str, width: int, sort: bool):
    """Top-``TOPK`` of rows ``width`` entries wide, each token seeing its ``(pos + 1) / r``."""
    g = torch.Generator(device=dev).manual_seed(bs * 13 + run)
    t = bs * run
    scores = torch.randn(t, width, device=dev, generator=g).bfloat16()
    pos = (context - run + torch.arange(run, device=dev)).repeat(bs)
    seen = (pos + 1) // RATIO
    pick = sorted_picks if sort else top_select

    def launch():
        return pick(scores, seen, min(TOPK, width))

    nbytes = 2 * int(seen.sum()) + t * TOPK * 8  # what each token sees, once; the picks
    return launch, nbytes, 0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prefill", type=int, default=2048, help="one run's tokens (0: none)")
    ap.add_argument("--capacity", type=int, default=65536, help="a CUDA graph's positions")
    args = ap.parse_args()
    dev = "cuda"
    bw = copy_bandwidth_gbs(dev)
    print(f"copy bandwidth {bw:.0f} GB/s; context {args.context}")
    cases = [(bs, 1) for bs in map(int, args.batches.split(","))]
    if args.prefill:
        cases.append((1, args.prefill))
    rows = []
    wide, narrow = args.capacity // RATIO, args.context // RATIO
    kernels = [("sparse_attention", attention_case), ("index_scores", index_case)]
    for name, sort in (("top_select", False), ("sort (torch path)", True)):
        for label, width in (("graph", wide), ("eager", narrow)):
            make = functools.partial(select_case, width=width, sort=sort)
            kernels.append((f"{name}, {label} row", make))
    for kernel, make in kernels:
        for bs, run in cases:
            launch, nbytes, flops = make(bs, run, args.context, dev)
            us = graph_us(launch, dev)
            floor = nbytes / (bw * 1e3)
            rows.append(
                {
                    "kernel": kernel,
                    "bs": bs,
                    "run": run,
                    "us": us,
                    "floor_us": floor,
                    "bytes": nbytes,
                    "tflops": flops / us / 1e6,
                }
            )
            print(
                f"{kernel:<30} bs {bs:>3} x {run:>5} tokens: {us:8.1f} us, floor "
                f"{floor:7.1f} us ({us / floor:5.1f}x), {flops / us / 1e6:6.1f} TFLOP/s",
                flush=True,
            )
    with open(args.out, "w") as f:
        json.dump(
            {"copy_gbs": bw, "context": args.context, "capacity": args.capacity, "rows": rows},
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
