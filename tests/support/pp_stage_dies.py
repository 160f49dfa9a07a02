"""Run as one rank of a 2-stage pipeline, or with ``tp`` of one stage of 2 TP ranks (torch
environment variables set by the test); rank 1 dies abruptly after its first step, as a crashed
stage or rank would."""

from __future__ import annotations

import os
import sys

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.parallel.launch import DistConfig, launch
from engramrt.parallel.partition import stage_layers
from engramrt.parallel.pipeline import Pipeline
from engramrt.runner.batch import StepBatch
from engramrt.runner.stage import StageRunner


def worker(rank: int, world: int) -> None:
    parts = [2, 2] if world == 2 else [4]
    runner = StageRunner.load(GQA_MODEL_DIR, layer_ids=stage_layers(parts, rank))
    pipe = Pipeline(runner, rank, world)
    if pipe.tp.rank == 1:  # a TP follower: one step of the leader's, then gone
        step = runner.compute

        def once(*args, **kw):
            step(*args, **kw)
            os._exit(3)

        runner.compute = once
        pipe.serve()
    if rank == 1:
        pipe._stage(pipe._recv_batch(*pipe._recv_header()[1:]))
        os._exit(3)
    pipe.step(StepBatch([0, 7, 8, 9], [0], [4], [0]))
    pipe.step(StepBatch([10], [0], [1], [4]))  # rank 1 is gone by now: this must fail, not hang


if __name__ == "__main__":
    tp = sys.argv[2:] == ["tp"]
    launch(
        DistConfig(pp_size=1 if tp else 2, tp_size=2 if tp else 1, timeout_s=float(sys.argv[1])),
        worker,
    )
