"""Overlap scheduling (``EngineConfig.async_scheduling``): the host learns a step's tokens one
step late, yet every request's outputs equal those of the synchronous engine, requests that
reach max_tokens run no extra step, and a discarded extra step leaves nothing a later request
could see. On a CPU nothing overlaps, but the bookkeeping is the same as on a GPU."""

from __future__ import annotations

import math
import random

import pytest

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.engine.engine import Engine, EngineConfig
from engramrt.engine.request import SamplingParams
from engramrt.parallel.pipeline import Pipeline
from engramrt.runner.batch import StepBatch, StepResult
from engramrt.runner.stage import StageRunner
from tests.engine.test_engine import TEXTS, Result, absorb, assert_idle, drain
from tests.support.engine_factory import bos_encoder, build_engine

MAX_LEN = 128
MAX_SLOTS = 4


@pytest.fixture(scope="module")
def session() -> StageRunner:
    return StageRunner.load(GQA_MODEL_DIR, MAX_SLOTS, MAX_LEN, "cpu", "float32")


@pytest.fixture(scope="module")
def make_engine(session: StageRunner):
    def make(overlap: bool, **cfg) -> Engine:
        return build_engine(
            session, MAX_LEN, MAX_SLOTS, **{"num_blocks": 128, **cfg}, overlap=overlap
        )

    return make


@pytest.fixture(scope="module")
def encode(session: StageRunner):
    return bos_encoder(session)


class Counting:
    """Wraps the pipeline: how many steps were launched and how many rows they sampled."""

    def __init__(self, pipeline: Pipeline):
        self.pipeline, self.steps, self.rows = pipeline, 0, 0

    def __getattr__(self, name):
        return getattr(self.pipeline, name)

    def _count(self, batch: StepBatch) -> None:
        self.steps += 1
        self.rows += len(batch.slots)

    def launch(self, batch: StepBatch):
        self._count(batch)
        return self.pipeline.launch(batch)

    def step(self, batch: StepBatch) -> StepResult:
        self._count(batch)
        return self.pipeline.step(batch)


def counted(engine: Engine) -> Counting:
    engine.pipeline = Counting(engine.pipeline)
    return engine.pipeline


def run_all(engine: Engine, requests: dict, abort: tuple[str, int] | None = None) -> dict:
    """Add the requests, step until idle (aborting ``abort[0]`` after ``abort[1]`` steps) and
    check that nothing leaked."""
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    results: dict[str, Result] = {}
    if abort is not None:
        for _ in range(abort[1]):
            absorb(results, engine.step(), engine)
        engine.abort(abort[0])
    drain(engine, results)
    assert_idle(engine)
    return results


def assert_same(a: Result, b: Result, rid: str) -> None:
    assert a.ids == b.ids, rid
    assert a.text == b.text and a.finish_reason == b.finish_reason, rid
    assert len(a.logprobs) == len(b.logprobs), rid
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert x.top_ids == y.top_ids and math.isclose(x.logprob, y.logprob, abs_tol=1e-4), rid
    assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None), rid
    if a.prompt_logprobs is not None:
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:], strict=True):
            assert math.isclose(x.logprob, y.logprob, abs_tol=1e-4), rid


def random_requests(encode, vocab: int, seed: int, stop_token: int | None) -> dict:
    """Different prompt lengths (shared prefixes among them), max_tokens, stops, logprobs, seeded
    sampling and n > 1 as separate requests with the same prompt."""
    rng = random.Random(seed)
    reqs = {}
    for i in range(7):
        if i % 3 == 0:
            prompt = encode(rng.choice(TEXTS))
        else:
            prompt = encode(TEXTS[2])[: rng.randrange(2, 20)] + [
                rng.randrange(6, vocab) for _ in range(rng.randrange(1, 25))
            ]
        kw = {"max_tokens": rng.randrange(1, 14), "ignore_eos": rng.random() < 0.5}
        kind = i % 4
        if kind == 1 and stop_token is not None:
            kw["stop_token_ids"] = [stop_token]
        if kind == 2:
            kw["stop"] = [" the", "e"]
        if i % 3 == 1:
            kw["logprobs"] = 2
        if i == 5:
            kw["prompt_logprobs"] = 1
        if i % 2:
            kw.update(temperature=1.0, top_p=0.9, seed=1000 + i)
        else:
            kw.update(temperature=0.0)
        reqs[str(i)] = (prompt, SamplingParams(**kw))
    reqs["n1"] = (reqs["0"][0], reqs["0"][1])  # n = 2: the same prompt and parameters twice
    return reqs


CONFIGS = {
    "plain": {},
    "chunked": {"max_num_batched_tokens": 8},
    "preempting": {"num_blocks": 24, "max_num_batched_tokens": 16},
}


@pytest.mark.parametrize("config", list(CONFIGS))
def test_overlap_outputs_equal_synchronous(make_engine, encode, session, config: str) -> None:
    vocab = session.tokenizer.get_vocab_size()
    cfg = CONFIGS[config]
    probe = run_all(make_engine(False), random_requests(encode, vocab, 0, None))
    stop_token = next(r.ids[2] for r in probe.values() if len(r.ids) > 3)  # one it produces
    reqs = random_requests(encode, vocab, 0, stop_token)
    sync_engine = make_engine(False, **cfg)  # one at a time: they share the runner's cache
    sync = run_all(sync_engine, reqs)
    overlap_engine = make_engine(True, **cfg)
    over = run_all(overlap_engine, reqs)
    assert not sync_engine.overlap and overlap_engine.overlap
    assert set(sync) == set(over) == set(reqs)
    for rid in reqs:
        assert_same(over[rid], sync[rid], rid)
    reasons = {r.finish_reason for r in sync.values()}
    assert reasons == {"stop", "length"}  # both kinds of finish were exercised
    if config == "preempting":
        assert sync_engine.stats()["num_preemptions"] > 0
        assert overlap_engine.stats()["num_preemptions"] > 0
    assert overlap_engine.stats()["prefix_cache_hits"] > 0


def test_overlap_with_an_abort_in_the_middle(make_engine, encode, session) -> None:
    vocab = session.tokenizer.get_vocab_size()
    long = (encode(TEXTS[2]), SamplingParams(max_tokens=60, temperature=0))
    reqs = {"long": long, **random_requests(encode, vocab, 1, None)}  # admitted first
    sync = run_all(make_engine(False), reqs, abort=("long", 6))
    over = run_all(make_engine(True), reqs, abort=("long", 6))
    for rid in reqs:
        if rid != "long":
            assert_same(over[rid], sync[rid], rid)
    alone = run_all(make_engine(True), {"long": reqs["long"]})["long"]
    for r in (sync["long"], over["long"]):  # what was delivered before the abort is right
        assert r.finish_reason is None and 0 < len(r.ids) < 60
        assert r.ids == alone.ids[: len(r.ids)]


def test_max_tokens_runs_exactly_that_many_sampling_steps(make_engine, encode) -> None:
    lens = [1, 2, 5, 9]
    reqs = {
        str(n): (encode(TEXTS[i]), SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        for i, n in enumerate(lens)
    }
    for overlap in (False, True):
        engine = make_engine(overlap)
        pipe = counted(engine)
        results = run_all(engine, reqs)
        assert all(len(results[str(n)].ids) == n for n in lens)
        assert pipe.rows == sum(lens), overlap  # prompts fit one step: every row samples
        assert pipe.steps == max(lens), overlap
        one = make_engine(overlap)
        pipe = counted(one)
        run_all(one, {"x": reqs["5"]})
        assert pipe.steps == 5, overlap


def test_a_stop_runs_at_most_one_extra_step(make_engine, encode) -> None:
    prompt = encode(TEXTS[0])
    plain = SamplingParams(max_tokens=12, temperature=0)
    base = run_all(make_engine(False), {"x": (prompt, plain)})["x"]
    params = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[base.ids[3]])
    stop_at = base.ids.index(base.ids[3]) + 1
    for overlap, extra in ((False, 0), (True, 1)):
        engine = make_engine(overlap)
        pipe = counted(engine)
        got = run_all(engine, {"x": (prompt, params)})["x"]
        assert got.ids == base.ids[:stop_at] and got.finish_reason == "stop"
        assert pipe.steps == stop_at + extra, overlap


@pytest.mark.parametrize("how", ["stop", "abort"])
def test_a_discarded_step_leaves_nothing_in_the_slot(make_engine, encode, how: str) -> None:
    """A stops (its extra step commits history and writes K/V for its slot) or is aborted with a
    step in flight; B then runs in the same slot and blocks and must equal B alone."""
    a_prompt, b_prompt = encode(TEXTS[2]), encode(TEXTS[4])
    b_params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    b_alone = run_all(make_engine(True, max_num_seqs=1), {"b": (b_prompt, b_params)})["b"]
    plain = SamplingParams(max_tokens=12, temperature=0)
    base = run_all(make_engine(False), {"a": (a_prompt, plain)})["a"]
    engine = make_engine(True, max_num_seqs=1, prefix_caching=False)
    if how == "stop":
        stop = SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[base.ids[4]])
        got = run_all(engine, {"a": (a_prompt, stop)})["a"]
        assert got.finish_reason == "stop"
    else:
        engine.add_request("a", a_prompt, plain)
        for _ in range(4):
            engine.step()
        assert engine.in_flight is not None
        engine.abort("a")
        drain(engine)  # the step in flight is applied and its row discarded
        assert_idle(engine)
    b = run_all(engine, {"b": (b_prompt, b_params)})["b"]
    assert b.ids == b_alone.ids and b.text == b_alone.text


def test_an_idle_engine_delivers_the_step_in_flight(make_engine, encode) -> None:
    engine = make_engine(True)
    engine.add_request("x", encode(TEXTS[1]), SamplingParams(max_tokens=1, temperature=0))
    assert engine.step() == []  # launched; its token is not known yet
    assert engine.has_work()
    outs = engine.step()  # nothing new to launch: the step in flight is applied
    assert [o.request_id for o in outs] == ["x"] and outs[0].finished
    assert not engine.has_work()
    assert_idle(engine)


def test_overlap_needs_a_pipeline_that_can(session) -> None:
    class Stub:
        def step(self, batch: StepBatch) -> StepResult:
            return StepResult([7] * len(batch.slots))

    cfg = EngineConfig(MAX_LEN, eos_token_id=None)
    assert not Engine(Pipeline(session), session.tokenizer, cfg).overlap  # the default: off
    assert not Engine(Stub(), session.tokenizer, cfg).overlap
    cfg.async_scheduling = True
    assert Engine(Pipeline(session), session.tokenizer, cfg).overlap
    with pytest.raises(ValueError, match="one stage"):
        Engine(Stub(), session.tokenizer, cfg)


@pytest.mark.gpu
def test_overlap_with_cuda_graphs_equals_synchronous(encode, session) -> None:
    """On a GPU the steps really overlap, decode and mixed steps replay CUDA graphs (whose
    captured forward gathers the kept samples from the token rows) and results arrive
    through pinned copies and an event."""
    runner = StageRunner.load(GQA_MODEL_DIR, MAX_SLOTS, MAX_LEN, "cuda", "float32")
    runner.capture_graphs(MAX_SLOTS, 64)  # mixed steps too: pending tokens beside chunks
    assert runner.graphs is not None
    vocab = session.tokenizer.get_vocab_size()

    def engine(overlap: bool) -> Engine:
        return build_engine(
            runner, MAX_LEN, MAX_SLOTS, MAX_SLOTS, 64, overlap=overlap, allocate=False
        )

    probe = run_all(engine(False), random_requests(encode, vocab, 2, None))
    stop_token = next(r.ids[2] for r in probe.values() if len(r.ids) > 3)
    reqs = random_requests(encode, vocab, 2, stop_token)
    sync = run_all(engine(False), reqs)
    over = run_all(engine(True), reqs)
    for rid in reqs:
        assert_same(over[rid], sync[rid], rid)


@pytest.mark.parametrize(
    ("flags", "on"),
    [
        ([], True),
        (["--no-async-scheduling"], False),
        (["--async-scheduling"], True),
        (["-pp", "2"], False),
        (["-tp", "2"], False),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'], True),
        (["--speculative-config", '{"num_speculative_tokens": 2}', "-pp", "2"], False),
    ],
)
def test_overlap_is_the_default_wherever_outputs_are_the_same(flags: list[str], on: bool) -> None:
    """As vLLM: overlap scheduling is on unless asked off, or where it cannot give the same
    outputs (several stages or ranks); with speculative decoding too (the stage verifies and
    drafts on the device)."""
    import argparse

    from engramrt.commands.bench_throughput import add_arguments, options

    p = argparse.ArgumentParser()
    add_arguments(p)
    opts = options(p.parse_args(["--device", "cpu", *flags]), 64)
    assert opts.overlap is on
