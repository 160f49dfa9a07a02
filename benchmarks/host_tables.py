"""Engram tables in host memory against tables on the GPU, one model loaded three ways in one
process (device tables; host tables read ahead at forward entry; host tables without): logits
bit for bit (eager prefill and decode, then from captured graphs, decode and mixed), and the
decode step at bs 1 and bs 64 (CUDA-event median of 200 graph replays after 20 warm-ups, the
runners alternating in rounds so drift hits all).

    python benchmarks/host_tables.py --model /tmp/m1b --out host.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics

import torch

from engramrt.runner.batch import StepBatch
from engramrt.runner.stage import StageRunner


def compare(runners: list[StageRunner], seed: int, last_only: bool) -> bool:
    rng = random.Random(seed)
    vocab = runners[0].tokenizer.get_vocab_size()
    lens = [rng.randint(8, 300) for _ in range(8)]
    toks = [rng.randrange(6, vocab) for _ in range(sum(lens))]
    batch = StepBatch(toks, list(range(8)), lens, [0] * 8)
    pos, same = list(lens), True
    for _ in range(6):
        outs = [r.compute(batch, last_only=last_only) for r in runners]
        same &= all(torch.equal(outs[0], o) for o in outs[1:])
        batch = StepBatch(
            [rng.randrange(6, vocab) for _ in range(8)], list(range(8)), [1] * 8, list(pos)
        )
        pos = [p + 1 for p in pos]
    return same


def decode_ms(runners: list[StageRunner], bsz: int, rounds: int = 10) -> list[float]:
    batch = StepBatch([5] * bsz, list(range(bsz)), [1] * bsz, [300] * bsz)
    times: list[list[float]] = [[] for _ in runners]
    for r in runners:
        for _ in range(20):
            r.compute(batch, last_only=True)
    torch.cuda.synchronize()
    for _ in range(rounds):
        for i, r in enumerate(runners):
            for _ in range(200 // rounds):
                start, end = (torch.cuda.Event(enable_timing=True) for _ in range(2))
                start.record()
                r.compute(batch, last_only=True)
                end.record()
                torch.cuda.synchronize()
                times[i].append(start.elapsed_time(end))
    return [statistics.median(t) for t in times]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    runners = [
        StageRunner.load(a.model, 64, 2048, "cuda", "bfloat16", table_memory=m)
        for m in ("device", "host", "host")
    ]
    runners[2].prefetcher = None  # host tables read where each Engram layer needs them
    res = {"bitwise_eager": compare(runners, 0, last_only=False)}
    for r in runners:
        r.hasher.history.table.zero_()
        r.capture_graphs(64, 2048)
    res["bitwise_graphs"] = compare(runners, 1, last_only=True)
    for bsz in (1, 64):
        dev, host, plain = decode_ms(runners, bsz)
        res[f"decode_bs{bsz}_ms"] = {
            "device": dev,
            "host_prefetch": host,
            "host_no_prefetch": plain,
            "prefetch_over_device": host / dev,
            "no_prefetch_over_device": plain / dev,
        }
    print(json.dumps(res), flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
