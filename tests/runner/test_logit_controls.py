"""Logit controls (penalties, logit_bias, allowed ids, banned ids, min_tokens) in the batched
sampler against ``restate``, a per-token re-statement: on random rows directly, and end to end
through the engine (each greedy token is the argmax of the re-stated logits the sampler saw,
given the request's tokens so far), with overlap scheduling on and off and across a preemption's
re-registration."""

from __future__ import annotations

import random

import pytest
import torch

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.engine.request import SamplingParams
from engramrt.runner.logit_controls import Controls, LogitControls, restate
from engramrt.runner.stage import StageRunner
from tests.support.engine_factory import build_engine
from tests.support.kernel_env import ENGINE_DEVICES

V = 37


def _random_controls(rng: random.Random) -> Controls:
    ids = list(range(V))
    return Controls(
        presence_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        frequency_penalty=rng.choice([0.0, rng.uniform(-2, 2)]),
        repetition_penalty=rng.choice([1.0, rng.uniform(0.2, 2)]),
        logit_bias={t: rng.uniform(-150, 150) for t in rng.sample(ids, rng.randint(0, 4))},
        min_tokens=rng.randint(0, 4),
        min_tokens_ids=rng.sample(ids, 2),
        allowed_token_ids=rng.choice([None, rng.sample(ids, 9)]),
        banned_ids=rng.sample(ids, rng.randint(0, 2)),
    )


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    inf = torch.isinf(want)
    assert torch.equal(torch.isinf(got), inf) and torch.equal(got[inf], want[inf])
    torch.testing.assert_close(got[~inf], want[~inf], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("seed", range(6))
def test_apply_and_count_equal_the_restatement(seed) -> None:
    rng = random.Random(seed)
    lc = LogitControls(torch.device("cpu"))
    slots = rng.sample(range(12), 6)
    state = {}  # slot -> (controls or None, prompt, output)
    for s in slots:
        c = _random_controls(rng) if rng.random() < 0.7 else None
        prompt = [rng.randrange(V) for _ in range(rng.randint(1, 8))]
        output = [rng.randrange(V) for _ in range(rng.randint(0, 5))]
        lc.register(s, c, prompt, output, V)
        state[s] = (c, prompt, list(output))
    for _ in range(4):  # steps: apply, sample, count
        logits = torch.randn(len(slots), V) * 5
        index = [len(state[s][2]) for s in slots]
        got = lc.apply(logits, slots, index)
        for i, s in enumerate(slots):
            c, prompt, output = state[s]
            if c is None:
                assert torch.equal(got[i], logits[i])  # untouched, bit for bit
            else:
                _close(got[i], restate(logits[i], c, prompt, output, index[i]))
        tokens = torch.tensor([rng.randrange(V) for _ in slots])
        final = [rng.random() < 0.8 for _ in slots]
        lc.count(slots, final, tokens)
        for s, t, f in zip(slots, tokens.tolist(), final, strict=True):
            if f:
                state[s][2].append(t)


def test_validation_names_the_field() -> None:
    for bad, field in [
        (Controls(presence_penalty=3), "presence_penalty"),
        (Controls(repetition_penalty=0), "repetition_penalty"),
        (Controls(min_tokens=-1), "min_tokens"),
        (Controls(allowed_token_ids=[]), "allowed_token_ids"),
        (Controls(logit_bias={V: 1.0}), "outside the vocabulary"),
        (Controls(allowed_token_ids=[3], banned_ids=[3]), "bad_words"),
        (Controls(allowed_token_ids=[1, 3], min_tokens=2, min_tokens_ids=[1, 3]), "min_tokens"),
    ]:
        with pytest.raises(ValueError, match=field):
            bad.validate(V)


# --- through the engine -------------------------------------------------------------------

MAX_LEN, SLOTS = 96, 3


@pytest.fixture(scope="module", params=ENGINE_DEVICES)
def session(request) -> StageRunner:
    """The engine tests run on the CPU, and with ``-m gpu`` on CUDA too (fp32: argmax ties
    are as unlikely as on the CPU)."""
    return StageRunner.load(GQA_MODEL_DIR, SLOTS, MAX_LEN, request.param, "float32")


def _recording(session: StageRunner, monkeypatch, engine) -> list:
    """What the sampler's controls saw each step: (input logits, request ids, output index,
    final) of its rows; the slots are mapped to requests while the step is being launched."""
    seen = []
    controls = session.sampler.controls
    apply, count = controls.apply, controls.count

    def recorded_apply(logits, slots, index):
        owner = {r.slot: r.id for r in engine.scheduler.running}
        seen.append([logits.clone(), [owner.get(s) for s in slots], list(index), None])
        return apply(logits, slots, index)

    def recorded_count(slots, final, tokens):
        seen[-1][3] = list(final)
        return count(slots, final, tokens)

    monkeypatch.setattr(controls, "apply", recorded_apply)
    monkeypatch.setattr(controls, "count", recorded_count)
    return seen


@pytest.mark.parametrize("overlap", [False, True])
def test_engine_tokens_are_argmax_of_the_restated_logits(session, monkeypatch, overlap) -> None:
    """Three requests with different controls share a batch (one without any); with too few
    KV blocks one is preempted and re-registers with its outputs so far. Every sampled token
    of a controlled request is the argmax of the sampler's logits re-stated with the request's
    tokens at that point."""
    engine = build_engine(
        session,
        MAX_LEN,
        SLOTS,
        max_num_seqs=3,
        max_num_batched_tokens=64,
        block_size=4,
        num_blocks=22,
        overlap=overlap,
    )
    seen = _recording(session, monkeypatch, engine)
    rng = random.Random(3)
    vocab = engine.vocab_size
    kinds = {
        "pen": {"presence_penalty": 0.8, "frequency_penalty": 0.6, "repetition_penalty": 1.7},
        "bias": {
            "logit_bias": {7: 3.0, 11: -100.0, 12: 2.5},
            "min_tokens": 6,
            "allowed_token_ids": rng.sample(range(13, vocab), 40) + [7, 12],
        },
        "plain": {},
    }
    params, prompts = {}, {}
    for rid, extra in kinds.items():
        params[rid] = SamplingParams(max_tokens=24, temperature=0, **extra)
        prompts[rid] = [rng.randrange(6, vocab) for _ in range(9)]
        engine.add_request(rid, prompts[rid], params[rid])
    out = {rid: [] for rid in kinds}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
    assert engine.scheduler.num_preemptions > 0, "meant to cover a re-registration"
    assert set(out["bias"]) <= set(params["bias"].allowed_token_ids)
    checked = 0
    for logits, rids, index, final in seen:
        for row, (rid, k, f) in enumerate(zip(rids, index, final, strict=True)):
            c = rid and params[rid].controls(engine.cfg.eos_token_id)
            if not c or not f or k >= len(out[rid]):  # no controls, discarded, or extra step
                continue
            want = restate(logits[row], c, prompts[rid], out[rid][:k], k).argmax().item()
            assert want == out[rid][k], (rid, k)
            checked += 1
    assert checked == len(out["pen"]) + len(out["bias"])


@pytest.mark.parametrize("overlap", [False, True])
def test_multi_token_bad_word_is_never_completed(session, overlap) -> None:
    """A bigram of the plain greedy output, given as a bad word: the output is the same up to
    where the bigram would complete, differs there, and never contains it."""

    def run(**extra) -> list[int]:
        engine = build_engine(session, MAX_LEN, SLOTS, max_num_seqs=SLOTS, overlap=overlap)
        engine.add_request(
            "r",
            [5, 6, 7, 8],
            SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, **extra),
        )
        out = []
        while engine.has_work():
            for o in engine.step():
                out += o.new_token_ids
        return out

    plain = run()
    i = next(i for i in range(1, len(plain)) if plain[i] != plain[i - 1])
    pair = plain[i - 1 : i + 1]
    banned = run(bad_word_seqs=[pair])
    assert banned[:i] == plain[:i] and banned[i] != plain[i]
    assert all(banned[j : j + 2] != pair for j in range(len(banned) - 1))
