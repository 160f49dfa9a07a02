"""Logits that are not finite (issue 51, item 7): a checkpoint whose embedding row of one token
is NaN turns a request's logits into NaN from the step after that token is embedded. That
request ends with finish reason ``error`` and the error names it, keeping every token sampled
before (nothing is sampled from the NaN row); the requests batched with it give what they give
on the clean model, in every scheduling mode (synchronous, overlapped, with n-gram drafts
verified on the device). Before the check, the request ran on to max_tokens on argmax-of-NaN
tokens and finished with ``length``."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.engine.speculative import SpecConfig
from engramrt.runner.stage import StageRunner
from tests.engine.test_engine import TEXTS, assert_idle, greedy, run
from tests.support.engine_factory import bos_encoder, build_engine
from tests.support.poisoned import edited_model, poison

MAX_LEN = 128
SLOTS = 4
MAX_TOKENS = 12
VICTIM = TEXTS[2]  # the request whose own output token is poisoned
NEIGHBOURS = [TEXTS[0], TEXTS[3]]


def load(model: Path) -> StageRunner:
    return StageRunner.load(model, SLOTS, MAX_LEN, "cpu", "float32", num_blocks=0)


@pytest.fixture(scope="module")
def case(tmp_path_factory) -> tuple[StageRunner, dict, int, int]:
    """The poisoned model, each prompt's output on the clean one, the poisoned token ``T`` (the
    victim's output token ``at``, which no neighbour's prompt or output holds) and ``at``."""
    clean = load(GQA_MODEL_DIR)
    encode = bos_encoder(clean)
    prompts = {t: encode(t) for t in [VICTIM, *NEIGHBOURS]}
    engine = build_engine(clean, MAX_LEN, SLOTS)
    outs = run(engine, {t: (ids, greedy(MAX_TOKENS)) for t, ids in prompts.items()})
    seen = {t for text in NEIGHBOURS for t in prompts[text] + outs[text].ids}
    victim = outs[VICTIM].ids
    at = next(
        j
        for j in range(2, MAX_TOKENS - 2)
        if victim[j] not in seen | set(prompts[VICTIM]) | set(victim[:j])
    )
    model = edited_model(tmp_path_factory.mktemp("nan") / "m", poison("embed.weight", victim[at]))
    return load(model), outs, victim[at], at


MODES = {
    "sync": {},
    "overlap": {"overlap": True},
    "ngram": {"speculative": SpecConfig(3, 3, 1)},
    "ngram-overlap": {"overlap": True, "speculative": SpecConfig(3, 3, 1)},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_non_finite_logits_end_their_request_alone(case, mode: str, capsys) -> None:
    runner, clean, token, at = case
    make = partial(build_engine, runner, MAX_LEN, SLOTS, **MODES[mode])
    encode = bos_encoder(runner)
    engine = make()
    got = run(engine, {t: (encode(t), greedy(MAX_TOKENS)) for t in [VICTIM, *NEIGHBOURS]})
    for text in NEIGHBOURS:
        assert got[text].ids == clean[text].ids, text
        assert got[text].finish_reason == clean[text].finish_reason
    victim = got[VICTIM]
    assert victim.finish_reason == "error", victim
    assert victim.ids == clean[VICTIM].ids[: at + 1] and victim.ids[-1] == token
    log = f"engramrt: request {VICTIM}: the model's logits for output token {at + 1} hold NaN"
    assert log in capsys.readouterr().err
    assert_idle(engine)


def test_the_next_owner_of_its_slot_does_not_notice(case) -> None:
    """A request whose every K/V row is NaN (the poisoned token second in its prompt) leaves
    them in its blocks, and its slot's table keeps pointing at them; the next owner of the slot
    (the short neighbour, decoding beside the longer one) attends over positions past its own
    context that are masked, yet they must be zeros: a masked row weighs 0, and 0 * NaN is NaN.
    The torch path once read them as they were."""
    runner, clean, token, _ = case
    engine = build_engine(runner, MAX_LEN, SLOTS, prefix_caching=False)
    encode = bos_encoder(runner)
    victim = encode(VICTIM)
    victim.insert(1, token)
    assert run(engine, {"v": (victim, greedy(MAX_TOKENS))})["v"].finish_reason == "error"
    short, long = sorted(NEIGHBOURS, key=lambda t: len(encode(t)))
    got = run(engine, {t: (encode(t), greedy(MAX_TOKENS)) for t in (short, long)})
    assert {t: r.ids for t, r in got.items()} == {t: clean[t].ids for t in (short, long)}
