"""Memory per tensor-parallel rank: each rank's load in a fresh process (its peak RSS over the
interpreter's, and the bytes of what it holds), at TP 1 and TP N.

    python benchmarks/tp_memory.py MODEL_DIR [--sizes 1 2] [--table-memory device|host]

A rank reads only its slices of the checkpoint (``EngramMHCModel.checkpoint_slices``), so its
peak should be its share: the sharded tensors / N plus the replicated ones (norms, mHC, wkv).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

PROBE = """
import json, resource, sys, torch
from engramrt.model.checkpoint import load_model
from engramrt.tensor_parallel import TensorParallel
model_dir, rank, size, tables = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
torch.ones(1)  # the interpreter and torch, before the load
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
model = load_model(model_dir, tp=TensorParallel(rank, size), table_memory=tables)
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
state = model.state_dict()
held = sum(t.numel() * t.element_size() for t in state.values())
sharded = set(model.checkpoint_slices())
split = sum(t.numel() * t.element_size() for n, t in state.items() if n in sharded)
print(json.dumps({"rank": rank, "size": size, "peak_rss": peak - base, "held": held,
                  "sharded": split}))
"""


def probe(model_dir: str, rank: int, size: int, tables: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", PROBE, model_dir, str(rank), str(size), tables],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--table-memory", choices=["device", "host"], default="device")
    args = ap.parse_args()
    gib = 2**30
    print("| TP | rank | holds (GiB) | of which sharded | peak RSS of the load (GiB) |")
    print("|---:|---:|---:|---:|---:|")
    for size in args.sizes:
        for rank in range(size):
            r = probe(args.model, rank, size, args.table_memory)
            print(
                f"| {size} | {rank} | {r['held'] / gib:.3f} | {r['sharded'] / gib:.3f} | "
                f"{r['peak_rss'] / gib:.3f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
