"""On a GPU under ``--batch-invariant``, a request's greedy tokens alone equal its tokens among
63 random others, without drafts and with n-gram or DSpark drafts (a verify run computes its
rows beside drafts where a decode step computes one): V4.1's FP8/FP4 linears are batch-invariant
by construction and the flag routes every dense product through ``dense_linear``; the attention,
norm, mHC and Engram kernels compute a row by itself. ``v41-small``, the bundled model and
``v41-wide`` (Flash's widths: the shapes whose launch settings come from the sweep; written once
where the benchmarks keep it)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engramrt.bundled import DEFAULT_MODEL_DIR
from engramrt.engine.request import SamplingParams
from engramrt.engine.speculative import SpecConfig
from engramrt.kernels import set_batch_invariant
from engramrt.runner.stage import StageRunner
from tests.support.engine_factory import build_engine, run_to_end

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU"),
]
BATCH, TOKENS, PICKED = 64, 48, (0, 21, 42, 63)
# an H100 (2026-12-06): all six pass since the mHC expand's products fuse the same way in every
# column tile (a step's size picked the tile, the compiler which product became an FMA)
METHODS = {"plain": None, "ngram": SpecConfig(4), "dspark": SpecConfig(3, method="dspark")}


def _model_dir(request) -> Path:
    if request.param == "bundled":
        return DEFAULT_MODEL_DIR
    if request.param == "v41-wide":
        from benchmarks.suites import Context

        return Context("cuda").preset("v41-wide", DEFAULT_MODEL_DIR)
    return request.getfixturevalue("v41_small")


@pytest.fixture(scope="module", params=["v41-small", "bundled", "v41-wide"])
def model(request) -> tuple[StageRunner, list[list[int]]]:
    path = _model_dir(request)
    set_batch_invariant(True)
    runner = StageRunner.load(
        path, num_slots=BATCH, max_len=256, device="cuda", dtype="bfloat16", dspark=True
    )
    rng = random.Random(1)
    top = min(runner.model.cfg.vocab_size, 1000)
    prompts = [[rng.randrange(10, top) for _ in range(rng.randrange(5, 60))] for _ in range(BATCH)]
    yield runner, prompts
    set_batch_invariant(False)


def _greedy(runner: StageRunner, prompts: list[list[int]], spec: SpecConfig | None):
    engine = build_engine(
        runner,
        256,
        BATCH,
        max_num_seqs=len(prompts),
        max_num_batched_tokens=512,
        num_blocks=2600,
        speculative=spec,
    )
    return run_to_end(
        engine, prompts, SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    )


@pytest.mark.parametrize("method", sorted(METHODS))
def test_a_request_alone_equals_it_in_a_batch_of_64(model, method: str) -> None:
    runner, prompts = model
    batched = _greedy(runner, prompts, METHODS[method])
    for i in PICKED:
        assert _greedy(runner, [prompts[i]], METHODS[method])[0] == batched[i], i
    if method != "plain":  # and the drafts change nothing
        assert batched == _greedy(runner, prompts, None)
