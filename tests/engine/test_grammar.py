"""Structured outputs in the engine: guided requests (llguidance matchers) produce text their
grammar accepts even from random weights, the same with overlap scheduling on and off, without
changing what an unguided neighbour generates; the sampler's bit masks against a re-statement."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.engine.grammar import GrammarSpec
from engramrt.engine.request import SamplingParams
from engramrt.runner.batch import NewRequest, StepBatch
from engramrt.runner.logit_controls import Controls
from engramrt.runner.sampler import Sampler, apply_token_masks
from engramrt.runner.slots import SlotTable
from engramrt.runner.stage import StageRunner
from tests.support.engine_factory import build_engine
from tests.support.kernel_env import ENGINE_DEVICES

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["id", "ok"],
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
}


@pytest.fixture(scope="module", params=ENGINE_DEVICES)
def session(request) -> StageRunner:
    return StageRunner.load(GQA_MODEL_DIR, 4, 256, request.param, "float32")


def _run(session, overlap: bool, guided: bool) -> dict[str, str]:
    engine = build_engine(
        session,
        256,
        4,
        max_num_seqs=4,
        max_num_batched_tokens=32,
        block_size=4,
        num_blocks=256,
        overlap=overlap,
    )
    engine.add_request("plain", [5, 6, 8, 9], SamplingParams(max_tokens=12, temperature=0))
    if guided:
        for i, spec in enumerate(
            [
                GrammarSpec("json", SCHEMA),
                GrammarSpec("regex", "[a-z]{2,5}!"),
                GrammarSpec("choice", ["alpha", "beta"]),
            ]
        ):
            engine.add_request(
                f"g{i}",
                [7, 8, 9 + i],
                SamplingParams(max_tokens=120, temperature=1.0, seed=i, grammar=spec),
            )
    text = {}
    while engine.has_work():
        for o in engine.step():
            o = engine.texts[o.request_id].apply(o)  # the text as the server's process makes it
            text[o.request_id] = text.get(o.request_id, "") + o.new_text
            if o.request_id != "plain" and o.finished:
                assert o.finish_reason == "stop"
    return text


def test_guided_outputs_match_their_grammar_with_and_without_overlap(session) -> None:
    sync, overlap = _run(session, False, True), _run(session, True, True)
    assert sync == overlap
    obj = json.loads(sync["g0"])
    assert set(obj) == {"id", "ok"} and 0 <= obj["id"] <= 999 and isinstance(obj["ok"], bool)
    assert re.fullmatch("[a-z]{2,5}!", sync["g1"]) and sync["g2"] in {"alpha", "beta"}
    assert sync["plain"] == _run(session, False, False)["plain"]  # the neighbour is untouched


def test_invalid_grammar_is_a_value_error(session) -> None:
    engine = build_engine(session, 256, 4)
    for spec, needle in [
        (GrammarSpec("regex", "(a"), "regex"),
        (GrammarSpec("json", {"type": "nope"}), "json"),
        (GrammarSpec("choice", []), "choice"),
    ]:
        with pytest.raises(ValueError, match=needle):
            engine.new_request("x", [5], SamplingParams(grammar=spec))


def test_token_masks_equal_a_restatement() -> None:
    rng = random.Random(0)
    logits = torch.randn(5, 70)
    masks = [(r, [rng.randrange(-(2**31), 2**31) for _ in range(2)]) for r in (0, 3)]
    got = apply_token_masks(logits, masks)
    for r in range(5):
        words = dict(masks).get(r)
        for t in range(70):
            allowed = words is None or (t < 64 and (words[t // 32] >> (t % 32)) & 1)
            assert got[r, t] == (logits[r, t] if allowed else float("-inf"))


def test_grammar_wins_over_min_tokens(session) -> None:
    """A request stops as soon as its grammar is complete, min_tokens notwithstanding; and in
    the sampler, controls that would leave no token allowed (min_tokens holding back the EOS a
    grammar requires) give way to the grammar's mask."""
    engine = build_engine(session, 256, 4)
    engine.add_request(
        "r",
        [5, 6],
        SamplingParams(
            max_tokens=40,
            temperature=1.0,
            seed=0,
            min_tokens=30,
            grammar=GrammarSpec("choice", ["ab", "cd"]),
        ),
    )
    text, reason = "", None
    while engine.has_work():
        for o in engine.step():
            o = engine.texts[o.request_id].apply(o)
            text, reason = text + o.new_text, o.finish_reason or reason
    assert text in {"ab", "cd"} and reason == "stop"
    sampler = Sampler(SlotTable(torch.device("cpu"), None, True))
    eos, vocab = 1, 64
    only_eos = [1 << eos, 0]
    controls = Controls(min_tokens=5, min_tokens_ids=[eos])
    batch = StepBatch(
        [5],
        [0],
        [1],
        [0],
        admitted=[NewRequest(0, [5], 1, 0, controls=controls)],
        masks=[(0, only_eos)],
    )
    sampler.slots.admit(batch.admitted, vocab)
    pending, _ = sampler.launch(torch.randn(1, vocab), batch)
    assert pending.wait().tokens == [eos]


NODE = {"type": "object", "properties": {"next": {"$ref": "#/$defs/n"}}, "required": ["next"]}
RECURSIVE = {"$ref": "#/$defs/n", "$defs": {"n": NODE}}


def test_a_grammar_that_cannot_be_followed_is_never_a_silent_stop(session) -> None:
    """Where llguidance can tell before generation (a limit broken on the tokens the grammar
    forces) the grammar is refused; where it breaks on a path the model chose (here: a bias
    toward the branch that repeats 'a' a million times), the request ends with finish reason
    'error' and the matcher's message, never 'stop' with output that violates the grammar."""
    engine = build_engine(session, 256, 4)
    for spec in (GrammarSpec("regex", "a{1000}{1000}"), GrammarSpec("json", RECURSIVE)):
        with pytest.raises(ValueError, match="cannot be followed"):
            engine.new_request("x", [5], SamplingParams(grammar=spec))
    a = session.tokenizer.token_to_id("a")
    params = SamplingParams(
        max_tokens=20,
        temperature=0,
        logit_bias={a: 100.0},
        grammar=GrammarSpec("regex", "b|a{1000}{1000}"),
    )
    engine.add_request("r", [5, 6], params)
    outs = []
    while engine.has_work():
        outs += engine.step()
    assert outs[-1].finished and outs[-1].finish_reason == "error", outs[-1]
    assert "cannot be followed" in outs[-1].error
    assert all(o.error is None and o.finish_reason is None for o in outs[:-1])
