"""What a CUDA graph launch costs the host against its node count: graphs of N small kernels
(an in-place add on a 4 KiB tensor), the CPU time of ``replay()`` (the driver queues every
node before it returns) against the GPU time of the graph, warm, averaged over many replays.

    python benchmarks/graph_launch.py [--nodes 100,300,1000,2000] [--out r.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def measure(nodes: int, reps: int = 200) -> dict:
    x = torch.zeros(1024, device="cuda")
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for _ in range(3):
            x.add_(1)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(nodes):
            x.add_(1)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    cpu = 0.0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        t = time.perf_counter()
        g.replay()
        cpu += time.perf_counter() - t
    end.record()
    torch.cuda.synchronize()
    return {
        "nodes": nodes,
        "launch_us": 1e6 * cpu / reps,
        "gpu_us": 1e3 * start.elapsed_time(end) / reps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="10,100,300,1000,2000")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    rows = [measure(int(n)) for n in args.nodes.split(",")]
    for r in rows:
        print(
            f"{r['nodes']:6d} nodes: launch {r['launch_us']:8.1f} us on the host, "
            f"{r['gpu_us']:8.1f} us on the GPU"
        )
    print(f"{torch.cuda.get_device_properties(0).name}, CUDA {torch.version.cuda}")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
