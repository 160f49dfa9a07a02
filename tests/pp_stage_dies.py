"""Run as one rank of a 2-stage pipeline (torch environment variables set by the test); rank 1
dies abruptly after its first step, as a crashed stage would."""

from __future__ import annotations

import os
import sys

from engramrt.bundled import resolve_model_dir
from engramrt.parallel.launch import DistConfig, launch
from engramrt.parallel.partition import stage_layers
from engramrt.parallel.pipeline import Pipeline
from engramrt.runner.batch import StepBatch
from engramrt.runner.stage import StageRunner


def worker(rank: int, world: int) -> None:
    runner = StageRunner.load(resolve_model_dir(None), layer_ids=stage_layers([2, 2], rank))
    pipe = Pipeline(runner, rank, world)
    if rank == 1:
        pipe._stage(pipe._recv_batch(pipe._recv_header()[1]))
        os._exit(3)
    pipe.step(StepBatch([0, 7, 8, 9], [0], [4], [0]))
    pipe.step(StepBatch([10], [0], [1], [4]))  # rank 1 is gone by now: this must fail, not hang


if __name__ == "__main__":
    launch(DistConfig(pp_size=2, timeout_s=float(sys.argv[1])), worker)
