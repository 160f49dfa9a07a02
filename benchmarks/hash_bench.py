"""Engram hashing (torch reference) on the real DeepSeek-V4.1-Flash layout: correctness of the
device path against the CPU path, then time per call for extend / decode / verify, eager and
(decode) CUDA-graph replay, next to the byte floor.

    python benchmarks/hash_bench.py [--device cuda] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from engramrt.bundled import FLASH_CONFIG
from engramrt.config import engram_config
from engramrt.engram import EngramHasher, EngramLayout

VOCAB = 128815  # tokenizer length; a random token map stands in for the real tokenizer's


def make_hasher(device: str, slots: int) -> EngramHasher:
    layout = EngramLayout.from_config(engram_config(json.loads(FLASH_CONFIG.read_text())))
    gen = torch.Generator().manual_seed(0)
    token_map = torch.randint(0, 99092, (VOCAB,), generator=gen)
    return EngramHasher(layout, token_map, slots, device)


def batches(device: str, seed: int) -> dict[str, tuple]:
    gen = torch.Generator().manual_seed(seed)

    def r(n: int, hi: int) -> torch.Tensor:
        return torch.randint(0, hi, (n,), generator=gen).to(device)

    ext_lens = torch.full((16,), 512)
    return {
        "extend": (r(8192, VOCAB), torch.arange(16).to(device), ext_lens.to(device), r(16, 4000)),
        "decode": (r(256, VOCAB), torch.randperm(256, generator=gen).to(device), r(256, 4000)),
        "verify": (r(64 * 4, VOCAB), torch.arange(64).to(device), r(64, 4000)),
    }


def run(h: EngramHasher, mode: str, args: tuple, check: bool = True) -> torch.Tensor:
    return getattr(h, mode)(*args, check=check)


def median_us(fn, device: str, reps: int = 200) -> float:
    for _ in range(10):
        fn()
    times = []
    for _ in range(reps):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def copy_bandwidth_gbs(device: str) -> float:
    """Measured ceiling: a 2 GiB device-to-device copy, bytes read plus bytes written."""
    src = torch.empty(2**29, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    us = median_us(lambda: dst.copy_(src), device, reps=20)
    return 2 * src.numel() * 4 / (us * 1e3)


def floor_bytes(tokens: int, layers: int = 2, cols: int = 24, n: int = 4) -> int:
    """Each input read once, each output written once: token (8 B), history row (3x4 B), the
    token-map entries of its N shifts (Nx8 B), ids out (L*cols*8 B), history write (3x4 B)."""
    return tokens * (8 + 12 + n * 8 + layers * cols * 8 + 12)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = args.device
    results: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu"}
    bandwidth = copy_bandwidth_gbs(dev) if dev == "cuda" else 50.0  # CPU: a nominal DRAM rate
    results["copy_bandwidth_gbs"] = bandwidth

    # 1. device path == CPU path, bitwise, ids and history, over all three modes in sequence
    ref, dut = make_hasher("cpu", 256), make_hasher(dev, 256)
    same = True
    for seed in range(3):
        b_cpu, b_dev = batches("cpu", seed), batches(dev, seed)
        for mode in ("extend", "decode", "verify"):
            a, b = run(ref, mode, b_cpu[mode]), run(dut, mode, b_dev[mode])
            same &= torch.equal(a, b.cpu())
        same &= torch.equal(ref.history.table, dut.history.table.cpu())
    results["device_equals_cpu"] = bool(same)

    # 2. time per call
    h = make_hasher(dev, 256)
    b = batches(dev, 7)
    rows = []
    for mode, tokens in (("extend", 8192), ("decode", 256), ("verify", 256)):
        us = median_us(lambda m=mode: run(h, m, b[m], check=False), dev)
        floor = floor_bytes(tokens) / (bandwidth * 1e3)  # bytes / (GB/s) in us
        rows.append({"mode": mode, "tokens": tokens, "path": "eager", "us": us, "floor_us": floor})
    if dev == "cuda":
        graph = torch.cuda.CUDAGraph()
        toks, slots, pos = b["decode"]
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                h.decode(toks, slots, pos, check=False)
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            h.decode(toks, slots, pos, check=False)
        us = median_us(graph.replay, dev)
        floor = floor_bytes(256) / (bandwidth * 1e3)
        rows.append(
            {"mode": "decode", "tokens": 256, "path": "cuda-graph", "us": us, "floor_us": floor}
        )
    results["rows"] = rows
    print(
        f"device {results['device']}  device==cpu bitwise: {results['device_equals_cpu']}  "
        f"copy bandwidth {bandwidth:.0f} GB/s (floor uses it)"
    )
    print(f"{'mode':8} {'tokens':>7} {'path':>11} {'us/call':>9} {'Mtok/s':>8} {'floor us':>9}")
    for r in rows:
        print(
            f"{r['mode']:8} {r['tokens']:>7} {r['path']:>11} {r['us']:>9.1f} "
            f"{r['tokens'] / r['us']:>8.2f} {r['floor_us']:>9.3f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
