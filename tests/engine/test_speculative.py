"""Speculative decoding with n-gram drafts: the proposer against a brute-force search; greedy
output with speculation equals the output without it, token for token, under continuous
batching, chunked prefill, prefix caching and preemption, and across two pipeline stages; the
Engram history at every hash equals the history of the same tokens decoded one by one (a row
rebuilt from them); seeded sampling draws the same tokens; spare blocks go back."""

from __future__ import annotations

import random

import pytest
import torch

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.engine.engine import Engine
from engramrt.engine.request import SamplingParams
from engramrt.engine.speculative import SpecConfig, accepted
from engramrt.engram.history import NgramHistory
from engramrt.runner.stage import StageRunner
from tests.engine.test_engine import assert_tables_match
from tests.support.engine_factory import build_engine, run_to_end

WORDS = "the capital of Bribrinu is Mokmok and 12 + 7 = 19 while rivers run".split()


@pytest.fixture(scope="module")
def runner() -> StageRunner:
    return StageRunner.load(GQA_MODEL_DIR, 8, 256, "cpu", "float32", num_blocks=0)


# --- the proposer ------------------------------------------------------------------------------


def _brute(tokens: list[int], k: int, hi: int, lo: int) -> list[int]:
    """Every earlier occurrence of every suffix length, the longest length and latest
    occurrence winning."""
    best = None
    for n in range(lo, hi + 1):
        if n >= len(tokens):
            continue
        tail = tuple(tokens[-n:])
        hits = [s for s in range(len(tokens) - n) if tuple(tokens[s : s + n]) == tail]
        if hits:
            best = (n, max(hits))
    if best is None:
        return []
    n, s = best
    return tokens[s + n : s + n + k]


def test_proposals_match_a_brute_force_search() -> None:
    rng = random.Random(0)
    for _ in range(3000):
        toks = [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        lo = rng.randrange(1, 4)
        cfg = SpecConfig(rng.randrange(1, 6), lo + rng.randrange(3), lo)
        limit = rng.randrange(0, 7)
        want = _brute(toks, min(cfg.num_speculative_tokens, limit), cfg.prompt_lookup_max, lo)
        assert cfg.propose(toks, limit) == want, (toks, cfg, limit)


def test_acceptance_and_config() -> None:
    assert accepted([5, 6, 7], [5, 6, 9, 1]) == 2 and accepted([5], [4, 5]) == 0
    assert accepted([1, 2], [1, 2, 3]) == 2
    cfg = SpecConfig.parse('{"method": "ngram", "num_speculative_tokens": 3}')
    assert cfg == SpecConfig(3, 4, 2) and SpecConfig.parse(None) is None
    dspark = SpecConfig.parse('{"method": "dspark", "num_speculative_tokens": 5}')
    assert dspark.method == "dspark" and SpecConfig.parse(dspark.to_json()) == dspark
    assert SpecConfig.parse(cfg.to_json()) == cfg
    for bad, rule in [
        ('{"method": "eagle", "num_speculative_tokens": 2}', "one of"),
        (
            '{"method": "dspark", "num_speculative_tokens": 2, "prompt_lookup_max": 3}',
            "unknown keys",
        ),
        ('{"num_speculative_tokens": 0}', ">= 1"),
        ("[1]", "JSON object"),
        ('{"num_speculative_tokens": 2, "prompt_lookup_min": 5}', "<="),
        ('{"num_speculative_tokens": 2, "x": 1}', "unknown keys"),
        ("{", "not JSON"),
    ]:
        with pytest.raises(ValueError, match=rule):
            SpecConfig.parse(bad)


# --- the engine --------------------------------------------------------------------------------


def _engine(runner: StageRunner, spec: SpecConfig | None, **kw) -> Engine:
    cfg = {"max_num_seqs": 4, "max_num_batched_tokens": 64, **kw}
    return build_engine(runner, 256, 8, speculative=spec, **cfg)


def _prompts(runner: StageRunner, n: int, seed: int) -> list[list[int]]:
    """Random word salads, half of them a phrase repeated (drafts get accepted there)."""
    rng, enc = random.Random(seed), runner.tokenizer
    out = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randrange(2, 12))]
        text = " ".join(words * (3 if i % 2 else 1))
        out.append([runner.model.cfg.bos_token_id, *enc.encode(text).ids])
    return out


def _run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]):
    """Each prompt's output ids; the stage's block tables checked after every step (a verify
    step's given-back blocks are sent again from where they went: a block taken again at the
    same index may be another request's since)."""
    return run_to_end(engine, prompts, params, after_step=assert_tables_match)


def _watch_history(runner: StageRunner, engine: Engine, seen: list[int]) -> None:
    """Before every hash: each run's history row equals the row rebuilt from the tokens before
    the run (what decoding them one by one commits)."""
    hasher = runner.hasher
    extend, decode = hasher.extend, hasher.decode

    def expected(slot: int, start: int) -> torch.Tensor:
        (req,) = [r for r in engine.scheduler.running if r.slot == slot]
        oracle = NgramHistory(1, hasher.n)
        oracle.rebuild(0, req.token_ids[:start])
        return oracle.table[0]

    def check(slots, starts) -> None:
        for slot, start in zip(slots.tolist(), starts.tolist(), strict=True):
            assert torch.equal(hasher.history.table[slot].cpu(), expected(slot, start)), slot
            seen.append(slot)

    def checked_extend(tokens, slots, lens, start_pos, **kw):
        live = lens > 0
        check(slots[live], start_pos[live])
        return extend(tokens, slots, lens, start_pos, **kw)

    def checked_decode(tokens, slots, positions, num_real=None, **kw):
        check(slots[: len(tokens) if num_real is None else num_real], positions)
        return decode(tokens, slots, positions, num_real, **kw)

    hasher.extend, hasher.decode = checked_extend, checked_decode


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"max_num_batched_tokens": 8},  # chunked prefill beside verify runs
        {"num_blocks": 40, "block_size": 4},  # preemption: too few blocks for four requests
        {"max_num_seqs": 2},
    ],  # continuous batching: requests admitted while others verify
    ids=["plain", "chunked", "preempting", "admitting"],
)
def test_greedy_with_speculation_equals_without(runner: StageRunner, kw: dict) -> None:
    prompts = _prompts(runner, 6, seed=len(kw))
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for _ in prompts]
    want = _run(_engine(runner, None, **kw), prompts, params)
    engine = _engine(runner, SpecConfig(4), **kw)
    seen: list[int] = []
    _watch_history(runner, engine, seen)
    try:
        got = _run(engine, prompts, params)
    finally:
        del runner.hasher.extend, runner.hasher.decode  # the class's methods again
    assert got == want
    stats = engine.stats()
    assert stats["spec_decode_num_drafts"] > 0 and stats["spec_decode_num_accepted_tokens"] > 0
    assert stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    per_pos = stats["spec_decode_num_accepted_tokens_per_pos"]  # a run accepts a prefix
    assert len(per_pos) == 4 and sum(per_pos) == stats["spec_decode_num_accepted_tokens"]
    assert stats["spec_decode_num_drafts"] >= per_pos[0] and per_pos == sorted(per_pos)[::-1]
    assert seen and engine.blocks.num_free == engine.cfg.num_blocks  # every block back
    if "num_blocks" in kw:
        assert stats["num_preemptions"] > 0


@pytest.mark.parametrize(
    "kw",
    [{}, {"max_num_batched_tokens": 8}, {"num_blocks": 40, "block_size": 4}, {"max_num_seqs": 2}],
    ids=["plain", "chunked", "preempting", "admitting"],
)
def test_overlap_with_speculation_equals_greedy_without(runner: StageRunner, kw: dict) -> None:
    """Overlap scheduling with n-gram drafts looked up on the stage: step N+1 is launched before
    the host reads step N, a run behind a verify run in flight starts where every draft of it
    was accepted, and the stage moves it back by those it rejected (here eagerly: it reads them
    back first). Greedy output equals decoding without speculation, token for token."""
    prompts = _prompts(runner, 6, seed=len(kw))
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for _ in prompts]
    want = _run(_engine(runner, None, **kw), prompts, params)
    engine = _engine(runner, SpecConfig(4), overlap=True, **kw)
    assert engine.overlap
    lagged = []
    launch = engine.pipeline.launch

    def launch_and_record(batch):
        lagged.append(sum(batch.lag or []))
        return launch(batch)

    engine.pipeline.launch = launch_and_record
    assert _run(engine, prompts, params) == want
    stats = engine.stats()
    assert sum(lagged) > 10 and stats["spec_decode_num_accepted_tokens"] > 0
    assert engine.blocks.num_free == engine.cfg.num_blocks
    if "num_blocks" in kw:
        assert stats["num_preemptions"] > 0


def test_seeded_sampling_draws_the_same_tokens(runner: StageRunner) -> None:
    """A seeded row's noise is keyed by its output index, and a verify run samples output i
    from the same logits as decoding does: the drawn tokens are the same."""
    prompts = _prompts(runner, 4, seed=7)
    params = [
        SamplingParams(max_tokens=24, temperature=0.3, top_p=0.95, seed=11 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    want = _run(_engine(runner, None), prompts, params)
    for overlap in (False, True):  # a seeded request speculates synchronously
        engine = _engine(runner, SpecConfig(3), overlap=overlap)
        assert _run(engine, prompts, params) == want
        assert engine.stats()["spec_decode_num_accepted_tokens"] > 0


def test_requests_that_need_each_token_get_no_drafts(runner: StageRunner) -> None:
    """Logprobs, penalties, grammars: no drafts for them, the same output."""
    prompts = _prompts(runner, 2, seed=3)[1:] * 2
    params = [
        SamplingParams(max_tokens=12, temperature=0, logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=12, temperature=0, repetition_penalty=1.5),
    ]
    want = _run(_engine(runner, None), prompts, params)
    engine = _engine(runner, SpecConfig(4))
    assert _run(engine, prompts, params) == want
    assert engine.stats()["spec_decode_num_drafts"] == 0


@pytest.mark.slow
def test_two_stages_with_speculation_answer_as_one_without() -> None:
    """Two pipeline stages (the verify run's hash ids travel in the carry, its commit stays on
    the first stage) against one process without speculation, over HTTP."""
    import httpx

    from tests.support.server_fixture import running_server

    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    prompt = "The capital of Bribrinu is Mokmok. The capital of Bribrinu is Mokmok. The capital"
    body = {
        "prompt": [prompt, "12 + 7 = 19. 12 + 7 = 19. 12 +"],
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
    }
    texts = {}
    for name, flags in {"plain": (), "pp2": ("--speculative-config", spec, "-pp", "2")}.items():
        with running_server("--dtype", "float32", "--max-model-len", "256", *flags) as base:
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            texts[name] = [c["text"] for c in r.json()["choices"]]
            m = httpx.get(f"{base}/metrics", timeout=30).text
            if name == "pp2":
                line = next(
                    x
                    for x in m.splitlines()
                    if x.startswith("engramrt:spec_decode_num_accepted_tokens_total")
                )
                assert float(line.split()[-1]) > 0
                per_pos = [
                    float(x.split()[-1])
                    for x in m.splitlines()
                    if x.startswith("engramrt:spec_decode_num_accepted_tokens_per_pos_total{")
                ]
                assert len(per_pos) == 4 and sum(per_pos) == float(line.split()[-1])
    assert texts["pp2"] == texts["plain"]


@pytest.mark.slow
def test_generate_with_speculation_over_two_stages() -> None:
    """``generate`` runs its request through the engine: with drafts over two stages it
    prints what one process prints without them."""
    import subprocess
    import sys

    args = [
        "generate",
        "--model",
        str(GQA_MODEL_DIR),
        "--prompt",
        "12 + 7 = 19. 12 + 7 = 19. 12 + 7 = 19. 12 +",
        "--max-tokens",
        "16",
        "--device",
        "cpu",
        "--dtype",
        "float32",
    ]
    spec = ["--speculative-config", '{"num_speculative_tokens": 3}', "-pp", "2"]
    outs = [
        subprocess.run(
            [sys.executable, "-m", "engramrt", *args, *extra],
            text=True,
            capture_output=True,
            timeout=180,
        )
        for extra in ([], spec)
    ]
    assert all(o.returncode == 0 for o in outs), outs[1].stderr
    assert outs[0].stdout.strip() and outs[0].stdout == outs[1].stdout


@pytest.mark.gpu
def test_verify_graphs_give_the_output_without_speculation() -> None:
    """On a GPU, every decoding row padded to K drafts so verify steps replay their CUDA
    graphs: greedy output token for token that of the engine without speculation (graphs
    too), synchronous and with overlap scheduling, and most verify steps replay a graph."""

    def engine(spec: SpecConfig | None, overlap: bool = False) -> tuple[Engine, list]:
        k = spec.num_speculative_tokens if spec else 0
        r = StageRunner.load(GQA_MODEL_DIR, 8, 256, "cuda", "float32", num_blocks=0)
        r.allocate_kv(8, 256, 16, 128, slack=k)
        if spec:
            r.speculate(k, (spec.prompt_lookup_max, spec.prompt_lookup_min))
        r.capture_graphs(8, 256, k)
        replays, real = [], r.graphs.replay
        r.graphs.replay = lambda h, s, c: replays.append(s) or real(h, s, c)
        return build_engine(
            r, 256, 8, 8, 256, overlap=overlap, speculative=spec, allocate=False
        ), replays

    runner = StageRunner.load(GQA_MODEL_DIR, 1, 64, "cpu", num_blocks=0)
    prompts = _prompts(runner, 6, seed=2)
    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True) for _ in prompts]
    want = _run(engine(None)[0], prompts, params)
    for overlap in (False, True):  # overlap: runs behind a verify run moved back in the graph
        spec, replays = engine(SpecConfig(3), overlap)
        assert _run(spec, prompts, params) == want
        verify = [s for s in replays if s.verify == 3]
        assert len(verify) > 10 and spec.stats()["spec_decode_num_accepted_tokens"] > 0


def test_a_preempted_verifying_request_resumes_without_its_drafts(runner: StageRunner) -> None:
    """Every decoding row verifies K drafts (uniform drafts, as under CUDA graphs), in a cache
    too small for four requests: a request preempted after a verify step is admitted again
    with a plain recompute run (its last drafts dropped, not appended to the recomputed
    prompt), and greedy output equals decoding without speculation."""
    from dataclasses import replace

    prompts = _prompts(runner, 4, seed=5)
    params = [SamplingParams(max_tokens=24, temperature=0, ignore_eos=True) for _ in prompts]
    kw = {"num_blocks": 40, "block_size": 4}
    want = _run(_engine(runner, None, **kw), prompts, params)
    engine = _engine(runner, SpecConfig(4), **kw)
    engine.cfg = replace(engine.cfg, uniform_drafts=True)
    assert _run(engine, prompts, params) == want
    assert engine.stats()["num_preemptions"] > 0


def test_speculation_is_set_up_before_graphs(runner: StageRunner) -> None:
    """Graphs captured without the lag flags in their buffers would take a lagging step's
    buffer misaligned: speculating after capture is an error, not silence."""
    saved, runner.graphs = runner.graphs, object()
    try:
        with pytest.raises(RuntimeError, match="before capture_graphs"):
            runner.speculate(3, (4, 2))
    finally:
        runner.graphs = saved


def test_verify_graphs_draft_up_to_the_end_of_a_request(runner: StageRunner) -> None:
    """With every decoding row verifying K drafts (as under verify graphs), drafts past
    max_tokens cost nothing more: every decoding run to the last carries K, and the output is
    max_tokens long and the output without speculation."""
    from dataclasses import replace

    prompts = _prompts(runner, 2, seed=9)
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True) for _ in prompts]
    want = _run(_engine(runner, None), prompts, params)
    engine = _engine(runner, SpecConfig(4))
    engine.cfg = replace(engine.cfg, uniform_drafts=True)
    counts = []
    launch = engine._launch

    def launch_and_record():
        launched = launch()
        for r in launched.rows if launched else []:
            if r.start >= r.req.num_prompt_tokens:  # a decoding run
                counts.append(len(r.drafts))
        return launched

    engine._launch = launch_and_record
    assert _run(engine, prompts, params) == want
    assert counts and set(counts) == {4}
