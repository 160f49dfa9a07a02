"""The serving engine in process (no HTTP): batching, prefix caching, chunked prefill, preemption,
aborts, stop strings, seeded sampling and validation. Every expected output comes from another
run of the engine (alone, uncached, unchunked or unpreempted), never from hard-coded text."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import pytest

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.engine.engine import Engine, EngineConfig
from engramrt.engine.request import Logprob, SamplingParams
from engramrt.parallel.pipeline import Pipeline
from engramrt.runner.stage import StageRunner
from tests.support.engine_factory import bos_encoder, build_engine, with_text

MAX_LEN = 256
MAX_SLOTS = 8


@pytest.fixture(scope="module")
def session() -> StageRunner:
    """One model for the module; each engine gets a fresh KV cache (history rows are rebuilt
    from a request's tokens whenever it is admitted, so the hasher can be shared)."""
    return StageRunner.load(GQA_MODEL_DIR, MAX_SLOTS, MAX_LEN, "cpu", "float32")


@pytest.fixture(scope="module")
def make_engine(session: StageRunner):
    return partial(build_engine, session, MAX_LEN, MAX_SLOTS)


@pytest.fixture(scope="module")
def encode(session: StageRunner):
    return bos_encoder(session)


@dataclass
class Result:
    ids: list[int] = field(default_factory=list)
    text: str = ""
    pieces: list[str] = field(default_factory=list)
    logprobs: list[Logprob] = field(default_factory=list)
    prompt_logprobs: list[Logprob | None] | None = None
    finish_reason: str | None = None
    num_outputs: int = 0


def absorb(results: dict[str, Result], outputs, engine: Engine) -> None:
    """Append one step's outputs to their requests' results, with their text as the server's
    process makes it (``RequestText``, kept per request by the test factory): a request that
    reaches a stop string ends there and is aborted in the engine, which may have run past it."""
    for out in outputs:
        text = engine.texts.get(out.request_id)
        out = out if text is None else text.apply(out)
        if out is None:  # a step the engine ran past the request's stop string
            continue
        if out.finished:
            engine.abort(out.request_id)  # (a no-op unless a stop string ended it here)
        r = results.setdefault(out.request_id, Result())
        assert r.finish_reason is None, "output after the request finished"
        r.ids += out.new_token_ids
        r.text += out.new_text
        r.pieces.append(out.new_text)
        r.logprobs += out.new_logprobs
        if out.prompt_logprobs is not None:
            r.prompt_logprobs = out.prompt_logprobs
        r.num_outputs += 1
        assert out.num_output_tokens == len(r.ids)
        if out.finished:
            r.finish_reason = out.finish_reason


def assert_tables_match(engine: Engine) -> None:
    """The stage's block tables, sent a step's new blocks at a time, equal the block manager's:
    every running request's slot holds its blocks (and, after a verify step gave some back,
    those past them until its next send, which starts where they went)."""
    blocks = engine.pipeline.runner.slots.blocks
    for req in engine.scheduler.running:
        n = len(req.blocks)
        assert int(blocks.lens[req.slot]) >= n, req.id
        assert blocks.tables[req.slot, :n].tolist() == req.blocks, req.id


def drain(engine: Engine, results: dict[str, Result] | None = None) -> dict[str, Result]:
    """Step until the engine has no work, checking the block tables after every step."""
    results = {} if results is None else results
    for _ in range(10_000):
        if not engine.has_work():
            return results
        absorb(results, engine.step(), engine)
        assert_tables_match(engine)
    raise AssertionError("the engine did not finish")


def run(engine: Engine, requests: dict[str, tuple[list[int], SamplingParams]]) -> dict:
    for rid, (ids, params) in requests.items():
        engine.add_request(rid, ids, params)
    results = drain(engine)
    assert set(results) == set(requests)
    assert_idle(engine)
    return results


def run_alone(make_engine, ids: list[int], params: SamplingParams, **cfg) -> Result:
    return run(make_engine(**cfg), {"x": (ids, params)})["x"]


def assert_idle(engine: Engine) -> None:
    """Nothing queued or running, every KV block and history slot free."""
    assert not engine.has_work()
    assert engine.requests == {}
    assert engine.blocks.num_free == engine.cfg.num_blocks
    assert all(r == 0 for r in engine.blocks.ref)
    assert sorted(engine.scheduler.free_slots) == list(range(engine.cfg.max_num_seqs))
    stats = engine.stats()
    assert stats["num_requests_running"] == stats["num_requests_waiting"] == 0
    assert stats["kv_cache_usage_perc"] == 0 and stats["engram_history_slots_used"] == 0


TEXTS = [
    "The quick brown fox jumps",
    "Hello",
    "A much longer prompt about rivers and mountains and gardens and the towns between them",
    "Engram hashes",
    "rivers and mountains",
    "x",
]


def greedy(max_tokens: int = 10, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kw)


# --- batching ------------------------------------------------------------------------------------


def test_batched_equals_alone(make_engine, encode) -> None:
    prompts = [encode(t) for t in TEXTS]
    alone = [run_alone(make_engine, p, greedy(), prefix_caching=False) for p in prompts]
    batched = run(
        make_engine(max_num_seqs=8), {str(i): (p, greedy()) for i, p in enumerate(prompts)}
    )
    for i, ref in enumerate(alone):
        got = batched[str(i)]
        assert got.ids == ref.ids and got.text == ref.text, i
        assert got.finish_reason == ref.finish_reason
        if ref.finish_reason == "length":
            assert len(ref.ids) == 10


def test_chunked_prefill_equals_whole(make_engine, encode) -> None:
    prompts = [encode(t) for t in TEXTS]
    reqs = {str(i): (p, greedy(logprobs=2, prompt_logprobs=2)) for i, p in enumerate(prompts)}
    whole = run(make_engine(max_num_seqs=8, prefix_caching=False), reqs)
    chunked = run(make_engine(max_num_seqs=8, max_num_batched_tokens=8), reqs)
    for rid, ref in whole.items():
        got = chunked[rid]
        assert got.ids == ref.ids and got.text == ref.text
        assert got.prompt_logprobs is not None and len(got.prompt_logprobs) == len(reqs[rid][0])
        assert got.prompt_logprobs[0] is None and ref.prompt_logprobs[0] is None
        for a, b in zip(got.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
            assert a.top_ids == b.top_ids
            assert a.logprob == pytest.approx(b.logprob, rel=1e-5, abs=1e-5)
            assert a.top_logprobs == pytest.approx(b.top_logprobs, rel=1e-5, abs=1e-5)
        for a, b in zip(got.logprobs, ref.logprobs, strict=True):
            assert a.top_ids == b.top_ids
            assert a.logprob == pytest.approx(b.logprob, rel=1e-5, abs=1e-5)


def test_greedy_logprobs_are_the_top(make_engine, encode) -> None:
    res = run_alone(make_engine, encode(TEXTS[0]), greedy(8, logprobs=3))
    assert len(res.logprobs) == len(res.ids)
    for token, lp in zip(res.ids, res.logprobs, strict=True):
        assert lp.top_ids[0] == token and lp.logprob == pytest.approx(lp.top_logprobs[0])
        assert len(lp.top_ids) == 3 and lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        assert all(v <= 0 for v in lp.top_logprobs)


# --- prefix cache --------------------------------------------------------------------------------


def test_prefix_cache_hit(make_engine, encode) -> None:
    long = encode(" ".join(TEXTS[2:]) + " " + TEXTS[2])
    assert len(long) > 30
    ref = run_alone(make_engine, long, greedy(12), prefix_caching=False)

    engine = make_engine()
    first = run(engine, {"a": (long, greedy(12))})["a"]
    hits = engine.stats()["prefix_cache_hits"]
    second = run(engine, {"b": (long, greedy(12))})["b"]
    gained = engine.stats()["prefix_cache_hits"] - hits
    assert first.ids == second.ids == ref.ids
    assert first.text == second.text == ref.text
    assert 0 < gained < len(long)
    assert gained % engine.cfg.block_size == 0

    # a prompt that shares only a prefix hits too, and still matches an uncached run
    other = long[: len(long) // 2] + encode(TEXTS[0])[1:]
    hits = engine.stats()["prefix_cache_hits"]
    shared = run(engine, {"c": (other, greedy(12))})["c"]
    assert engine.stats()["prefix_cache_hits"] > hits
    assert shared.ids == run_alone(make_engine, other, greedy(12), prefix_caching=False).ids


def test_prefix_cache_shared_while_running(make_engine, encode) -> None:
    """Two identical prompts admitted together, then a third while they run."""
    ids = encode(TEXTS[2])
    ref = run_alone(make_engine, ids, greedy(16), prefix_caching=False)
    engine = make_engine()
    engine.add_request("a", ids, greedy(16))
    engine.add_request("b", ids, greedy(16))
    results: dict[str, Result] = {}
    for _ in range(3):
        absorb(results, engine.step(), engine)
    engine.add_request("c", ids, greedy(16))
    drain(engine, results)
    assert_idle(engine)
    assert results["a"].ids == results["b"].ids == results["c"].ids == ref.ids
    assert engine.stats()["prefix_cache_hits"] > 0


# --- preemption ----------------------------------------------------------------------------------


def _preempting_engine(make_engine) -> Engine:
    # 4 requests of up to ~36 tokens need ~9 blocks each at the end; 20 blocks cannot hold them
    return make_engine(max_num_seqs=4, block_size=4, num_blocks=20)


def test_preemption_gives_identical_outputs(make_engine, encode) -> None:
    prompts = [encode(t) for t in (TEXTS[0], TEXTS[2], TEXTS[4], TEXTS[3])]
    params = greedy(16, ignore_eos=True)
    alone = [run_alone(make_engine, p, params, prefix_caching=False) for p in prompts]
    engine = _preempting_engine(make_engine)
    reqs = {str(i): (p, params) for i, p in enumerate(prompts)}
    for rid, (ids, p) in reqs.items():
        engine.add_request(rid, ids, p)
    handles = dict(engine.requests)
    results = drain(engine)
    assert_idle(engine)
    assert engine.stats()["num_preemptions"] > 0
    assert any(h.num_preemptions > 0 for h in handles.values())
    for i, ref in enumerate(alone):
        assert results[str(i)].ids == ref.ids and results[str(i)].text == ref.text, i
        assert len(ref.ids) == 16


# --- abort ---------------------------------------------------------------------------------------


def test_abort_mid_generation(make_engine, encode) -> None:
    engine = make_engine(max_num_seqs=2)
    ref = run_alone(make_engine, encode(TEXTS[0]), greedy(12))
    engine.add_request("long", encode(TEXTS[2]), greedy(200, ignore_eos=True))
    engine.add_request("keep", encode(TEXTS[0]), greedy(12))
    engine.add_request("queued", encode(TEXTS[1]), greedy(12))  # waits: 2 sequences at most
    results: dict[str, Result] = {}
    while len(results.get("long", Result()).ids) < 3:
        absorb(results, engine.step(), engine)
    assert engine.stats()["num_requests_waiting"] == 1
    engine.abort("long")
    engine.abort("queued")
    engine.abort("no-such-request")  # unknown ids are ignored
    assert "long" not in engine.requests and "queued" not in engine.requests
    assert engine.stats()["num_requests_waiting"] == 0
    drain(engine, results)
    assert set(results) == {"long", "keep"}
    assert results["keep"].ids == ref.ids and results["keep"].text == ref.text
    assert results["long"].finish_reason is None  # an aborted request gets no final output
    assert_idle(engine)


def test_abort_frees_blocks_and_slot(make_engine, encode) -> None:
    engine = make_engine()
    engine.add_request("a", encode(TEXTS[2]), greedy(100, ignore_eos=True))
    for _ in range(4):
        engine.step()
    stats = engine.stats()
    assert stats["engram_history_slots_used"] == 1 and stats["kv_cache_usage_perc"] > 0
    engine.abort("a")
    assert_idle(engine)


# --- stop strings --------------------------------------------------------------------------------


def _boundary_stop(tokenizer, ids: list[int]) -> tuple[str, int] | None:
    """A stop string made of the end of one token and the start of the next (both plain ASCII),
    and the number of tokens after which its first occurrence is complete."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    for i in range(1, len(ids) - 1):
        a = tokenizer.decode([ids[i]], skip_special_tokens=True)
        b = tokenizer.decode([ids[i + 1]], skip_special_tokens=True)
        if not (a.isascii() and b.isascii() and a.strip() and b.strip()):
            continue
        stop = a[-2:] + b[:2]
        pos = text.find(stop)
        if pos <= 0:
            continue
        for n in range(1, len(ids) + 1):  # the first prefix whose text holds the stop string
            if stop in tokenizer.decode(ids[:n], skip_special_tokens=True):
                return stop, n
    return None


def test_stop_string_across_tokens(make_engine, encode, session: StageRunner) -> None:
    tok = session.tokenizer
    for text in TEXTS:
        prompt = encode(text)
        base = run_alone(make_engine, prompt, greedy(40, ignore_eos=True))
        found = _boundary_stop(tok, base.ids)
        if found is not None:
            break
    else:
        pytest.skip("no ASCII token boundary to build a stop string from")
    stop, n_tokens = found
    assert len(stop) >= 2
    expected = base.text[: base.text.find(stop)]
    got = run_alone(make_engine, prompt, greedy(40, ignore_eos=True, stop=[stop]))
    assert got.text == expected
    assert stop not in got.text
    assert got.finish_reason == "stop"
    assert len(got.ids) == n_tokens  # it stopped at the token that completed the stop string
    assert got.ids == base.ids[:n_tokens]
    for piece_end in range(1, len(got.pieces) + 1):  # nothing emitted is ever taken back
        assert expected.startswith("".join(got.pieces[:piece_end]))

    # of two stop strings, the one that appears first wins, whatever the list order
    later = base.text[len(base.text) * 3 // 4 :][:3]
    if later and stop not in later and base.text.find(later) > base.text.find(stop):
        both = run_alone(make_engine, prompt, greedy(40, ignore_eos=True, stop=[later, stop]))
        assert both.text == expected and both.finish_reason == "stop"


def test_stop_token_ids_and_eos(make_engine, encode) -> None:
    prompt = encode(TEXTS[0])
    base = run_alone(make_engine, prompt, greedy(20, ignore_eos=True))
    target = base.ids[5]
    first = base.ids.index(target)
    got = run_alone(make_engine, prompt, greedy(20, ignore_eos=True, stop_token_ids=[target]))
    assert got.ids == base.ids[: first + 1] and got.finish_reason == "stop"


# --- seeded sampling -----------------------------------------------------------------------------


def seeded(seed: int, max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0, top_p=0.9, seed=seed, ignore_eos=True
    )


def test_seeded_sampling_independent_of_batch(make_engine, encode) -> None:
    target = encode(TEXTS[4])
    alone = run_alone(make_engine, target, seeded(1234))
    assert run_alone(make_engine, target, seeded(1234)).ids == alone.ids
    others = [run_alone(make_engine, target, seeded(s)).ids for s in (1, 2, 3)]
    assert any(o != alone.ids for o in others)  # the seed matters

    neighbours = {
        "n0": (encode(TEXTS[0]), seeded(7)),
        "n1": (encode(TEXTS[2]), SamplingParams(max_tokens=20, temperature=0.8)),  # unseeded
        "n2": (encode(TEXTS[1]), greedy(5)),
        "t": (target, seeded(1234)),
    }
    batched = run(make_engine(max_num_seqs=8), neighbours)
    assert batched["t"].ids == alone.ids
    assert batched["n0"].ids == run_alone(make_engine, encode(TEXTS[0]), seeded(7)).ids
    chunked = run(make_engine(max_num_seqs=8, max_num_batched_tokens=8), neighbours)
    assert chunked["t"].ids == alone.ids


def test_seeded_sampling_survives_preemption(make_engine, encode) -> None:
    prompts = [encode(t) for t in (TEXTS[2], TEXTS[0], TEXTS[4], TEXTS[3])]
    alone = [run_alone(make_engine, p, seeded(100 + i)).ids for i, p in enumerate(prompts)]
    engine = _preempting_engine(make_engine)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, seeded(100 + i))
    handles = dict(engine.requests)
    results = drain(engine)
    assert_idle(engine)
    preempted = [rid for rid, h in handles.items() if h.num_preemptions > 0]
    assert preempted, "the setup must preempt a seeded request"
    for i, ref in enumerate(alone):
        assert results[str(i)].ids == ref, (i, preempted)


# --- validation ----------------------------------------------------------------------------------

BAD_PARAMS = {
    "max_tokens_negative": SamplingParams(max_tokens=-1),
    "temperature_negative": SamplingParams(temperature=-0.1),
    "top_p_zero": SamplingParams(top_p=0.0),
    "top_p_above_one": SamplingParams(top_p=1.5),
    "top_k_negative": SamplingParams(top_k=-1),
    "min_p_above_one": SamplingParams(min_p=2.0),
    "logprobs_too_many": SamplingParams(logprobs=21),
    "prompt_logprobs_negative": SamplingParams(prompt_logprobs=-1),
    "seed_negative": SamplingParams(seed=-1),
}


@pytest.mark.parametrize("name", list(BAD_PARAMS))
def test_bad_sampling_params_rejected(make_engine, encode, name: str) -> None:
    engine = make_engine()
    with pytest.raises(ValueError):
        engine.add_request("r", encode("hi"), BAD_PARAMS[name])
    assert_idle(engine)


def test_bad_prompts_rejected(make_engine, encode, session: StageRunner) -> None:
    engine = make_engine(num_blocks=16)  # 64 tokens of KV at most
    vocab = session.tokenizer.get_vocab_size(with_added_tokens=True)
    cases = [
        ([], greedy(), "empty"),
        ([0, vocab], greedy(), str(vocab)),
        ([0, 10**6], greedy(), str(10**6)),
        ([0, -1], greedy(), "-1"),
        ([0] * MAX_LEN, greedy(1), "maximum context length"),
        (encode("hi"), greedy(MAX_LEN), str(MAX_LEN)),
        ([0] * 60, greedy(10), "blocks"),  # fits the context, not the KV cache
    ]
    for ids, params, needle in cases:
        with pytest.raises(ValueError, match=needle):
            engine.add_request("r", ids, params)
        assert_idle(engine)
    # a request id in use is refused without touching the running request
    ref = run_alone(make_engine, encode("hi"), greedy(4))
    engine.add_request("dup", encode("hi"), greedy(4))
    with pytest.raises(ValueError, match="dup"):
        engine.add_request("dup", encode(TEXTS[0]), greedy(4))
    assert drain(engine)["dup"].ids == ref.ids
    assert_idle(engine)


def test_a_tokenizer_larger_than_the_model_cannot_kill_the_engine() -> None:
    """Ids are checked against the smaller of the tokenizer and the model's vocab_size: an id
    the tokenizer knows but the embedding has no row for is a ValueError naming both sizes,
    and the engine keeps serving (it used to die in the embedding lookup)."""
    from engramrt.engram import load_hasher
    from tests.support.model_factory import make_model

    model, _ = make_model(seed=3, vocab_size=600)
    hasher, tok = load_hasher(GQA_MODEL_DIR, 2)
    assert tok.get_vocab_size(with_added_tokens=True) > 600
    runner = StageRunner(model, hasher, None, tok)
    runner.allocate_kv(2, 64, 4, 32)
    cfg = EngineConfig(64, 2, 64, 4, 32, True, model.cfg.eos_token_id, model.cfg.vocab_size)
    engine = with_text(Engine(Pipeline(runner), tok, cfg))
    with pytest.raises(ValueError, match=r"\[700\].*600.*1024"):
        engine.add_request("bad", [0, 700], greedy(2))
    engine.add_request("ok", [0, 599], greedy(2))
    assert len(drain(engine)["ok"].ids) == 2
    assert_idle(engine)


def test_context_boundary(make_engine, encode) -> None:
    """prompt + max_tokens == max_model_len is accepted and ends with "length"."""
    res = run_alone(make_engine, encode("hi"), greedy(7, ignore_eos=True))
    assert res.finish_reason == "length" and len(res.ids) == 7
    res = run_alone(make_engine, [0] * (MAX_LEN - 3), greedy(3, ignore_eos=True))
    assert res.finish_reason == "length" and len(res.ids) == 3


@pytest.mark.parametrize("skip", [True, False], ids=["skip-special", "keep-special"])
def test_incremental_text_equals_a_full_decode_at_every_step(skip: bool) -> None:
    """Random ids, many of them bytes that split UTF-8 characters, plus special tokens: after
    every appended token the incremental text is the full decode of the ids so far (special
    tokens left out, as generated text does, or kept, as an echoed prompt of ids does)."""
    import random

    from engramrt.engine.detokenize import IncrementalDecoder
    from engramrt.engram import load_tokenizer

    tok = load_tokenizer(GQA_MODEL_DIR)
    byte_ids = [tok.token_to_id(c) for c in ("\u00e2", "\u0124", "\u00ac", "\u00e4", "\u00bd")]
    assert None not in byte_ids
    rng, partial = random.Random(0), 0
    for trial in range(30):
        text, ids = IncrementalDecoder(tok, skip_special=skip), []
        for _ in range(rng.randint(1, 60)):
            pick = rng.random()
            ids.append(rng.choice(byte_ids) if pick < 0.3 else rng.randrange(0, 1024))
            want = tok.decode(ids, skip_special_tokens=skip)
            partial += want.endswith("\ufffd")
            assert text(ids) == want, (trial, ids)
    assert partial > 20  # the oracle did see unfinished characters
