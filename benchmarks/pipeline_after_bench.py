"""What follows the sampler on the last stage of a pipeline (no token rows there: the host sends
the drafts), eager against replayed from its CUDA graph with the host's drafts as an input: a
verify step of K DSpark drafts a run at each batch size, on the stage holding the model's last
layers (its rings seeded from a prefill of random streams).

    python benchmarks/pipeline_after_bench.py [--model DIR] [--layers 3,4,5] [--batches 1,4]

Each figure is the median wall time of ``--iters`` calls, each waited for (ms); JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.dspark_draft_bench import timed
from engramrt.bundled import DEFAULT_MODEL_DIR
from engramrt.runner.batch import StepBatch
from engramrt.runner.carry import Carry
from engramrt.runner.stage import StageRunner


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    ap.add_argument("--layers", default="3,4,5")
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    sizes, k, prompt = [int(b) for b in args.batches.split(",")], args.k, 64
    slots, block = max(sizes), 16
    per = -(-(prompt + 2 * k + 2) // block)
    runner = StageRunner.load(
        args.model,
        num_slots=slots,
        max_len=prompt + 4 * k,
        device="cuda",
        layer_ids=[int(i) for i in args.layers.split(",")],
        dspark=True,
        num_blocks=0,
    )
    runner.allocate_kv(slots, prompt + 4 * k, block, slots * per, slack=k)
    runner.speculate(k)
    runner.capture_graphs(slots, 64)
    v = runner.verifier
    carry = Carry.empty(runner.model, prompt * slots, torch.zeros)
    carry.x.normal_(generator=torch.Generator("cuda").manual_seed(0))
    runner.compute(
        StepBatch(
            None,
            list(range(slots)),
            [prompt] * slots,
            [0] * slots,
            new_blocks=[list(range(s * per, (s + 1) * per)) for s in range(slots)],
        ),
        carry,
    )
    rows = []
    for b in sizes:
        batch = StepBatch(
            None,
            list(range(b)),
            [1 + k] * b,
            [prompt] * b,
            drafts=[k] * b,
            draft_tokens=[7] * (b * k),
        )
        samples = torch.full((b * (1 + k),), 7, device="cuda")
        graphs = v.graphs

        def waited():  # wall time: the eager path is bound by the host's launches
            v.after(batch, samples)
            torch.cuda.synchronize()

        row = {"batch": b, "k": k, "graph_ms": timed(waited, args.iters, cuda=False)}
        v.graphs = {}
        row["eager_ms"] = timed(waited, args.iters, cuda=False)
        v.graphs = graphs
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
