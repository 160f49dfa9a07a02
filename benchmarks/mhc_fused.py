"""One sublayer's mHC glue on one GPU: the torch composition the decoder used before the fused
kernels (mixes matmul + rsqrt in torch, the Triton Sinkhorn, the collapse loop, RMSNorm, bmm +
FMAs for the expand) against ``engramrt.kernels.mhc_fused`` (two launches before the sublayer,
one after), at the 4B model's sizes (hidden 3072, hc 4, bf16 stream, fp32 mixing parameters).

    python benchmarks/mhc_fused.py [--out results.json] [--sweep]

Times: the average per call of GRAPH_CALLS calls captured in one CUDA graph (no launch
overhead, as in a decode graph) and the eager median (CUDA events, launches included). GB/s is
over the bytes a sublayer must move at least: the stream read once, ``fn`` once, the normed row,
the mixing weights, the sublayer output, the stream read and written once for the expand.
``--sweep`` also times the fused kernels under other tile constants (at SWEEP_TOKENS). With
$OUT set, the JSON lands there as mhc_fused.json.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from benchmarks.engram_kernels import events_us, graph_us
from benchmarks.hash_bench import copy_bandwidth_gbs
from engramrt.kernels import mhc_fused
from engramrt.model.layers import rms_norm
from engramrt.model.mhc import hc_mixes, hc_post, hc_pre, hc_split_sinkhorn

HIDDEN, HC, ITERS, HC_EPS, NORM_EPS = 3072, 4, 20, 1e-6, 1e-20
TOKENS = (1, 16, 64, 256)
SWEEP_TOKENS = (1, 64)


def torch_pre(x, pre_prev, fn, scale, base, weight):
    """The decoder's glue before the fused kernels, op for op."""
    mixes = hc_mixes(x, fn, NORM_EPS)
    pre, post, comb = hc_split_sinkhorn(mixes, scale, base, HC, ITERS, HC_EPS)
    return rms_norm(hc_pre(x, pre_prev), weight, NORM_EPS), pre, post, comb


def fused_pre(x, pre_prev, fn, scale, base, weight):
    return mhc_fused.mhc_pre(x, pre_prev, fn, scale, base, weight, HC, ITERS, HC_EPS, NORM_EPS)


def inputs(tokens: int) -> dict:
    g = torch.Generator(device="cuda").manual_seed(tokens)
    mix = (2 + HC) * HC

    def randn(*shape, dtype=torch.float32):
        return torch.randn(*shape, device="cuda", generator=g).to(dtype)

    return {
        "x": randn(tokens, HC, HIDDEN, dtype=torch.bfloat16),
        "pre_prev": randn(tokens, HC).sigmoid(),
        "fn": randn(mix, HC * HIDDEN) * 0.02,
        "scale": randn(3).abs() + 0.5,
        "base": randn(mix),
        "weight": randn(HIDDEN, dtype=torch.bfloat16),
        "y": randn(tokens, HIDDEN, dtype=torch.bfloat16),
    }


def floor_bytes(tokens: int) -> dict[str, int]:
    stream = tokens * HC * HIDDEN * 2
    row = tokens * HIDDEN * 2
    weights = tokens * (2 + HC) * HC * 4
    pre = stream + (2 + HC) * HC * HC * HIDDEN * 4 + tokens * HC * 4 + HIDDEN * 2 + row + weights
    post = row + stream + tokens * 2 * HC * 4 + tokens * HC * HC * 4 + stream
    return {"pre": pre, "post": post}


def time_sublayer(kind: str, a: dict) -> dict[str, float]:
    pre_fn = fused_pre if kind == "fused" else torch_pre
    post_fn = mhc_fused.mhc_post if kind == "fused" else hc_post
    args = (a["x"], a["pre_prev"], a["fn"], a["scale"], a["base"], a["weight"])
    _, _, post, comb, *_ = pre_fn(*args)

    def pre():
        pre_fn(*args)

    def expand():
        post_fn(a["y"], a["x"], post, comb)

    def both():
        pre()
        expand()

    return {
        "pre_graph_us": graph_us(pre),
        "post_graph_us": graph_us(expand),
        "graph_us": graph_us(both),
        "eager_us": events_us(both),
    }


def max_diff(a: dict) -> dict[str, float]:
    args = (a["x"], a["pre_prev"], a["fn"], a["scale"], a["base"], a["weight"])
    want, got = torch_pre(*args), fused_pre(*args)
    names = ("normed", "pre", "post", "comb")
    out = {
        n: (g.float() - w.float()).abs().max().item()
        for n, g, w in zip(names, got[:4], want, strict=True)
    }
    expand = mhc_fused.mhc_post(a["y"], a["x"], want[2], want[3]).float()
    out["expand"] = (expand - hc_post(a["y"], a["x"], want[2], want[3]).float()).abs().max().item()
    return out


SWEEP = {
    "TARGET_PROGRAMS": (128, 256, 512, 1024),
    "MAX_SPLITS": (32, 64, 128),
    "SPLIT_WARPS": (1, 2, 4),
    "SPLIT_BLOCK": (8, 32, 128),
}


def sweep(a: dict) -> list[dict]:
    rows = []
    for name, values in SWEEP.items():
        default = getattr(mhc_fused, name)
        for v in values:
            setattr(mhc_fused, name, v)
            try:
                t = time_sublayer("fused", a)
            finally:
                setattr(mhc_fused, name, default)
            rows.append({"const": name, "value": v, **t})
            print(f"    {name}={v:<5} pre {t['pre_graph_us']:7.2f} post {t['post_graph_us']:7.2f}")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--sweep", action="store_true", help="also time other tile constants")
    args = ap.parse_args()
    bw = copy_bandwidth_gbs("cuda")
    res: dict = {"device": torch.cuda.get_device_name(), "copy_gbs": bw, "rows": []}
    print(f"{res['device']}: copy {bw:.0f} GB/s; hidden {HIDDEN}, hc {HC}, bf16 stream")
    print(
        f"{'T':>4} {'path':>6} {'pre us':>8} {'post us':>8} {'graph us':>9} {'eager us':>9} "
        f"{'floor us':>9} {'GB/s':>7}"
    )
    for tokens in TOKENS:
        a = inputs(tokens)
        nbytes = floor_bytes(tokens)
        total = nbytes["pre"] + nbytes["post"]
        diff = max_diff(a)
        for kind in ("torch", "fused"):
            t = time_sublayer(kind, a)
            row = {
                "tokens": tokens,
                "path": kind,
                **t,
                "bytes": nbytes,
                "floor_us": total / (bw * 1e3),
                "gbs": total / (t["graph_us"] * 1e3),
            }
            if kind == "fused":
                row["max_abs_diff_vs_torch"] = diff
            res["rows"].append(row)
            print(
                f"{tokens:>4} {kind:>6} {t['pre_graph_us']:>8.2f} {t['post_graph_us']:>8.2f} "
                f"{t['graph_us']:>9.2f} {t['eager_us']:>9.2f} {row['floor_us']:>9.2f} "
                f"{row['gbs']:>7.0f}"
            )
        print(f"     max |fused - torch|: {diff}")
        if args.sweep and tokens in SWEEP_TOKENS:
            res.setdefault("sweep", {})[tokens] = sweep(a)
    out = args.out or (
        os.path.join(os.environ["OUT"], "mhc_fused.json") if "OUT" in os.environ else None
    )
    if out:
        with open(out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
