"""Speculation keeps greedy output token for token on the CPU (float32), with the drafts the
methods really make: n-gram lookup and DSpark, on ``v41-small`` and the bundled model, 16 prompts
of 96 tokens. Near-ties of the random and the tiny model flip on any last-bit difference, and a
verify run computes its rows beside drafts where a decode step computes one: this holds only
because every product of a CPU step is row-invariant (``engramrt.kernels.row_invariant``), which
also makes 16 requests at once give each request's output alone."""

from __future__ import annotations

import json
import random

import pytest

from engramrt.bundled import DEFAULT_MODEL_DIR, DEFAULT_TASKS_DIR
from engramrt.engine.request import SamplingParams
from engramrt.engine.speculative import SpecConfig
from engramrt.runner.stage import StageRunner
from tests.support.engine_factory import build_engine

N_PROMPTS, N_TOKENS, ALONE = 16, 96, 4
METHODS = {
    "ngram": SpecConfig(4, prompt_lookup_max=3, prompt_lookup_min=1),
    "dspark": SpecConfig(3, method="dspark"),
}


@pytest.fixture(scope="module", params=["v41-small", "bundled"])
def model(request) -> tuple[StageRunner, list[list[int]]]:
    """The runner and 16 prompts: the bundled model's own held-out prompts, or word salads of
    the random model's vocabulary, half of them a phrase repeated (n-gram drafts from the
    prompt)."""
    if request.param == "bundled":
        path = DEFAULT_MODEL_DIR
    else:
        path = request.getfixturevalue("v41_small")
    runner = StageRunner.load(path, num_slots=N_PROMPTS, max_len=256, dtype="float32", dspark=True)
    cfg, enc = runner.model.cfg, runner.tokenizer
    if request.param == "bundled":
        lines = [
            json.loads(line)["prompt"]
            for task in ("recall", "in_context", "arithmetic")
            for line in (DEFAULT_TASKS_DIR / f"{task}.jsonl").read_text().splitlines()[:6]
        ]
        texts = lines[:N_PROMPTS]
    else:
        rng = random.Random(5)
        words = [enc.decode([t]) for t in range(16, 400)]
        texts = [
            "".join(rng.choice(words) for _ in range(rng.randrange(3, 12))) * (1 + i % 2)
            for i in range(N_PROMPTS)
        ]
    prompts = [[cfg.bos_token_id, *enc.encode(t).ids] for t in texts]
    return runner, prompts


def _greedy(runner: StageRunner, prompts, spec: SpecConfig | None, seqs: int):
    engine = build_engine(
        runner, 256, N_PROMPTS, max_num_seqs=seqs, num_blocks=1200, speculative=spec
    )
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    out = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    return [out[str(i)] for i in range(len(prompts))], engine.stats()


@pytest.fixture(scope="module")
def plain(model) -> list[list[int]]:
    runner, prompts = model
    return _greedy(runner, prompts, None, N_PROMPTS)[0]


def _first_difference(got: list[list[int]], want: list[list[int]]) -> dict[int, int]:
    """prompt -> the first output index where ``got`` parts from ``want``."""
    return {
        i: next(j for j, (a, b) in enumerate(zip(g, w, strict=True)) if a != b)
        for i, (g, w) in enumerate(zip(got, want, strict=True))
        if g != w
    }


@pytest.mark.parametrize("method", sorted(METHODS))
def test_speculation_keeps_greedy_output(model, plain, method: str) -> None:
    runner, prompts = model
    got, stats = _greedy(runner, prompts, METHODS[method], N_PROMPTS)
    assert _first_difference(got, plain) == {}
    assert all(len(o) == N_TOKENS for o in got)
    accepted, drafted = (
        stats["spec_decode_num_accepted_tokens"],
        stats["spec_decode_num_draft_tokens"],
    )
    assert 0 < accepted < drafted  # drafts kept and drafts rolled back


@pytest.mark.parametrize("method", [None, *sorted(METHODS)])
def test_one_request_at_a_time_gives_the_batched_output(model, plain, method) -> None:
    """The issue's case: one request at a time, with or without speculation, gives what 16
    requests at once do."""
    runner, prompts = model
    spec = None if method is None else METHODS[method]
    got, _ = _greedy(runner, prompts[:ALONE], spec, 1)
    assert _first_difference(got, plain[:ALONE]) == {}
