"""V4.1's FP8 / FP4 linears at Flash's shapes (issue 34 item 3): the Triton kernel that reads the
weights as stored, against the torch path (dequantise, then an fp32 GEMM), a bf16 GEMM over a
weight dequantised beforehand (cuBLAS; twice the bytes of FP8, four times FP4's), and the byte
floor (the stored weight and scales, the activations and the output, once each, over the copy
bandwidth measured in the same run).

    python benchmarks/stored_linear_bench.py --out stored_linear.json
    python benchmarks/stored_linear_bench.py --out sweep.json --sweep  # launch settings

``--sweep`` times the kernel's launch settings (output features a program, K a step, warps,
split-K programs, row tiles) at decode sizes: where its defaults come from.
"""

from __future__ import annotations

import argparse
import itertools
import json

import torch

from benchmarks.hash_bench import copy_bandwidth_gbs, median_us
from engramrt.kernels.stored_linear import SMS, _launch, stored_linear
from engramrt.models.deepseek_v41 import quant

SHAPES = {  # name: (N, K, fp4) at V4.1-Flash's widths
    "wq_a": (1280, 5120, False),
    "wq_b": (32768, 1280, False),
    "wkv": (512, 5120, False),
    "wo_b": (5120, 8192, False),
    "indexer.wq_b": (4096, 1280, False),
    "expert.w1": (2304, 5120, True),
    "expert.w2": (5120, 2304, True),
}
ROTATE_BYTES = 256 * 2**20


def graph_us(fn, device: str) -> float:
    """GPU time of one call without the host's launch cost: the call captured in a CUDA graph,
    replayed after a 256 MB write that flushes the L2 (median of 20)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    flush = torch.empty(ROTATE_BYTES, dtype=torch.uint8, device=device)
    times = []
    for _ in range(20):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return sorted(times)[len(times) // 2]


def sweep(bw: float, dev: str) -> list[dict]:
    """Every launch setting at M = 1 (and the row tile at M = 16 / 64) for each shape: GPU time
    of a graph replay after an L2 flush, against the byte floor."""
    out, g = [], torch.Generator(device=dev).manual_seed(1)
    for name, (n, k, fp4) in SHAPES.items():
        w = torch.randn(n, k, device=dev, generator=g) / k**0.5
        stored, scale = quant.fp4_weight(w) if fp4 else quant.fp8_weight(w)
        for m in (1, 16, 64):
            a = quant.act_roundtrip(torch.randn(m, k, device=dev, generator=g)).bfloat16()
            floor = (stored.numel() + scale.numel() + a.numel() * 2 + m * n * 2) / (bw * 1e3)
            settings = [
                (1, bn, bk, warps, waves)
                for bn in (16, 32, 64, 128)
                for bk in (128, 256)
                for warps in (2, 4, 8)
                for waves in (0, 1, 2, 4)
            ]
            if m > 1:
                settings = [(bm, 64, 128, 4, 0) for bm in (16, 64) if bm <= max(16, m)]
            for bm, bn, bk, warps, waves in settings:
                tiles = -(-n // bn) * -(-m // bm)
                splits = max(1, min(-(-k // bk), waves * SMS // tiles)) if waves else 1
                us = graph_us(
                    lambda a=a, bm=bm, bn=bn, bk=bk, w=warps, s=splits: _launch(
                        a, stored, scale, fp4, -(-m // bm), bm, s, None, bn, bk, w
                    ),
                    dev,
                )
                row = {
                    "shape": name,
                    "m": m,
                    "bm": bm,
                    "bn": bn,
                    "bk": bk,
                    "warps": warps,
                    "splits": splits,
                    "us": us,
                    "x_floor": us / floor,
                }
                out.append(row)
            best = min(
                (r for r in out if r["shape"] == name and r["m"] == m), key=lambda r: r["us"]
            )
            print(
                f"{name:<14} M {m:>3}: best {best['us']:.1f} us ({best['x_floor']:.1f}x "
                f"floor) at bm {best['bm']} bn {best['bn']} bk {best['bk']} warps "
                f"{best['warps']} splits {best['splits']}",
                flush=True,
            )
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,16,64,8192")
    ap.add_argument("--sweep", action="store_true", help="time the kernel's launch settings")
    args = ap.parse_args()
    dev = "cuda"
    bw = copy_bandwidth_gbs(dev)
    if args.sweep:
        with open(args.out, "w") as f:
            json.dump({"copy_gbs": bw, "sweep": sweep(bw, dev)}, f, indent=1)
        return
    rows, g = [], torch.Generator(device=dev).manual_seed(0)
    print(f"copy bandwidth {bw:.0f} GB/s")
    print(
        f"{'shape':<14}{'M':>6}{'kernel us':>11}{'graph us':>10}{'torch us':>10}{'bf16 us':>9}"
        f"{'floor us':>10}{'x floor':>8}{'TFLOP/s':>9}"
    )
    for name, (n, k, fp4) in SHAPES.items():
        w = torch.randn(n, k, device=dev, generator=g) / k**0.5
        stored, scale = quant.fp4_weight(w) if fp4 else quant.fp8_weight(w)
        dequant = quant.dequant_fp4_weight if fp4 else quant.dequant_fp8_weight
        w16 = dequant(stored, scale, torch.bfloat16)
        # copies to rotate through, more bytes than the 60 MB L2 holds (a step reads each once)
        copies = [
            (stored.clone(), scale.clone()) for _ in range(-(-ROTATE_BYTES // stored.numel()))
        ]
        turn = itertools.cycle(copies)
        for m in map(int, args.rows.split(",")):
            a = quant.act_roundtrip(torch.randn(m, k, device=dev, generator=g)).bfloat16()
            kernel = median_us(lambda a=a: stored_linear(a, *next(turn), fp4), dev)
            replay = graph_us(lambda a=a: stored_linear(a, *copies[0], fp4), dev)
            torch_path = median_us(
                lambda a=a, s=stored, c=scale: quant.quantized_linear(a, dequant(s, c, a.dtype)),
                dev,
                reps=5,
            )
            bf16 = median_us(lambda a=a, w=w16: a @ w.T, dev)
            nbytes = stored.numel() + scale.numel() + a.numel() * 2 + m * n * 2
            floor = nbytes / (bw * 1e3)
            tflops = 2 * m * n * k / replay / 1e6
            rows.append(
                {
                    "shape": name,
                    "n": n,
                    "k": k,
                    "fp4": fp4,
                    "m": m,
                    "kernel_us": kernel,
                    "graph_us": replay,
                    "torch_us": torch_path,
                    "bf16_gemm_us": bf16,
                    "floor_us": floor,
                    "tflops": tflops,
                }
            )
            print(
                f"{name:<14}{m:>6}{kernel:>11.1f}{replay:>10.1f}{torch_path:>10.0f}"
                f"{bf16:>9.1f}{floor:>10.1f}{replay / floor:>8.2f}{tflops:>9.1f}",
                flush=True,
            )
    with open(args.out, "w") as f:
        json.dump({"copy_gbs": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
