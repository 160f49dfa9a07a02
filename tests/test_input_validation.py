"""Bad input is an error with a message, never silent corruption: block tables, history
rebuilds, extend runs, sampling parameters, prompts; and the pipeline metadata round trip."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.commands.generate import prompt_tokens
from engramrt.config import load_json
from engramrt.engine.request import check_context_length
from engramrt.engram import load_hasher
from engramrt.engram.token_map import load_tokenizer
from engramrt.models import model_config
from engramrt.parallel.pipeline import Pipeline
from engramrt.prompts import PromptEncoder
from engramrt.runner.batch import (
    MAX_LOGPROBS,
    NewRequest,
    SampleRow,
    StepBatch,
    StepResult,
    decode_batch,
    decode_result,
    encode_batch,
    encode_result,
)
from engramrt.runner.logit_controls import Controls
from engramrt.runner.stage import StageRunner, new_kv_cache
from tests.support.model_factory import make_model


@pytest.fixture(scope="module")
def session() -> StageRunner:
    model, _ = make_model(seed=9, num_hidden_layers=2, engram_layer_ids=[0, 1])
    hasher, tok = load_hasher(GQA_MODEL_DIR, 2)
    return StageRunner(model, hasher, new_kv_cache(model, 2, max_len=64), tok)


@pytest.mark.parametrize("table", [[-2, 0], [0, 10**6]])
def test_block_ids_outside_the_cache_are_rejected(session: StageRunner, table: list[int]) -> None:
    with pytest.raises(ValueError, match="block table .* outside"):
        session.compute(StepBatch([7, 8], [0], [2], [0], new_blocks=[table]))


def test_block_table_updates_are_checked(session: StageRunner) -> None:
    """A step may extend a slot's table or replace it from any point it already holds; a gap,
    a table longer than max_len needs, or an unknown slot is an error that changes nothing."""
    tables = session.slots.blocks
    tables.set([1], None, [[5, 6]])
    before = (tables.tables.copy(), tables.lens.copy())
    for slots, starts, blocks, msg in [
        ([1], [3], [[7]], "do not extend"),  # a gap after the 2 blocks held
        ([1], [0], [[1] * (tables.per_seq + 1)], "do not extend"),
        ([9], None, [[1]], "outside the cache"),
    ]:
        with pytest.raises(ValueError, match=msg):
            tables.set(slots, starts, blocks)
        assert (tables.tables == before[0]).all() and (tables.lens == before[1]).all()
    tables.set([1], [2], [[7]])  # extend
    assert tables.tables[1, :3].tolist() == [5, 6, 7] and tables.lens[1] == 3
    tables.set([1], [1], [[3]])  # replace from block 1 on
    assert tables.tables[1, :2].tolist() == [5, 3] and tables.lens[1] == 2
    tables.set([1], None, [tables.fixed(1)])  # as the other tests expect it


@pytest.mark.parametrize("tokens", [[-1], [10**6]])
def test_rebuild_validates_tokens(tokens: list[int]) -> None:
    hasher, _ = load_hasher(GQA_MODEL_DIR, 2)
    with pytest.raises(ValueError, match="outside the tokenizer"):
        hasher.rebuild(0, tokens)


def _raised(fn, *args) -> str | None:
    try:
        fn(*args)
    except ValueError as exc:
        return str(exc)
    return None


def _torch_checks(hasher, toks: list[int]) -> None:
    t = torch.tensor(toks, dtype=torch.int64)
    hasher._check(t, torch.ones_like(t, dtype=torch.bool), torch.zeros(0, dtype=torch.int64))


def test_host_validation_agrees_with_the_checks_it_screens_for() -> None:
    """``validate``'s numpy fast path against the torch check itself on random token lists
    (ids out of range, negative, image ids): it raises exactly when the check does."""
    import random

    hasher, _ = load_hasher(GQA_MODEL_DIR, 4)
    rng = random.Random(0)
    vocab, image = hasher.vocab_size, hasher.image_token_id
    outcomes = set()
    for _ in range(400):
        n = rng.randint(0, 8)
        pool = [5, vocab - 1, vocab, -2] + ([image] if image is not None else [])
        toks = [rng.choice(pool) if rng.random() < 0.05 else rng.randrange(vocab) for _ in range(n)]

        want = _raised(_torch_checks, hasher, toks)
        got = _raised(hasher.validate, toks)
        assert got == want, toks
        outcomes.add(want is None)
    assert outcomes == {True, False}


@pytest.mark.parametrize(
    ("lens", "slots", "msg"),
    [
        ([3, 3], [0, 1], "sum to at most"),
        ([-1, 2], [0, 1], "must be >= 0"),
        ([1, 2], [1, 1], "share a slot"),
    ],
)
def test_extend_runs_are_checked(lens: list[int], slots: list[int], msg: str) -> None:
    hasher, _ = load_hasher(GQA_MODEL_DIR, 2)
    t = torch.tensor([7, 8, 9])
    with pytest.raises(ValueError, match=msg):
        hasher.extend(t, torch.tensor(slots), torch.tensor(lens), torch.tensor([0, 0]))


def test_zero_request_step(session: StageRunner) -> None:
    result = Pipeline(session).step(StepBatch([], [], [], []))
    assert result.tokens == []


@pytest.mark.parametrize(
    "row",
    [
        SampleRow(temperature=-1),
        SampleRow(top_p=0),
        SampleRow(top_p=1.5),
        SampleRow(top_k=-1),
        SampleRow(min_p=2),
        SampleRow(logprobs=MAX_LOGPROBS + 1),
        SampleRow(seed=-3),
    ],
)
def test_sampling_parameters_are_checked(row: SampleRow) -> None:
    with pytest.raises(ValueError):
        row.validate()


def test_prompt_limits() -> None:
    cfg = model_config(load_json(GQA_MODEL_DIR))
    enc = PromptEncoder.load(GQA_MODEL_DIR)
    ids = prompt_tokens(enc, cfg, "hello")
    assert ids == load_tokenizer(GQA_MODEL_DIR).encode("hello").ids  # add_bos_token: false
    with pytest.raises(ValueError, match="no tokens"):
        prompt_tokens(enc, cfg, "")
    small = dataclasses.replace(cfg, vocab_size=max(ids))  # a tokenizer larger than the model
    with pytest.raises(ValueError, match=f"past the model's vocab_size {max(ids)}"):
        prompt_tokens(enc, small, "hello")


@pytest.mark.parametrize("limit", [1, 2, 7, 100])
def test_one_context_length_rule(limit: int) -> None:
    """The rule the server, the engine and ``generate`` share: prompt + max_tokens fit."""
    for n in range(1, limit + 3):
        for mt in range(-1, limit + 2):
            fits = n + mt <= limit and mt >= 0
            if fits:
                check_context_length(n, mt, limit)
            else:
                with pytest.raises(ValueError, match=f"maximum context length is {limit}"):
                    check_context_length(n, mt, limit)


@pytest.mark.parametrize("with_tokens", [False, True])
def test_step_message_round_trip_keeps_every_field_exactly(with_tokens: bool) -> None:
    """What one stage encodes, the next decodes unchanged, every field by name: seeds stay
    exact integers, sampling floats exact bits; the tokens (the step's and the admitted
    requests') travel only to a first stage's TP followers, unless penalties need an admitted
    request's on the last stage; verify commits stay on the first stage's leader; the window
    snapshots to keep and restore (V4.1 prefix caching) reach every stage."""
    controls = Controls(0.5, -0.25, 1.3, {7: -100.0, 2: 0.1}, 3, [1, 9], [2, 7, 8], [4])
    admitted = [
        NewRequest(
            3,
            [5, 6, 7],
            2,
            1,
            [4, 7],
            SampleRow(0.7, 0.9, 5, 0.1, 2**53 + 1, 3, 4, False),
            controls,
            snapshot=5,
        ),
        NewRequest(1, [8, 9], 2, 0, [2], SampleRow(seed=2**63 - 1, min_p=1e-300)),
    ]
    batch = StepBatch(
        [9, 2**40, 0],
        [3, 1],
        [2, 1],
        [5, 9],
        new_blocks=[[4, 7], [2]],
        block_starts=[1, 0],
        admitted=admitted,
        token_counts=[2, 1],
        sample_index=[4, 0],
        final=[False, True],
        return_logits=True,
        targets=[11, -1, 4],
        target_k=2,
        masks=[(0, [5, -(2**31), 2**31 - 1])],
        drafts=[1, 0],
        commits=[(1, [4, 5], 1)],
        snapshots=[(3, 0), (1, 7)],
    )
    got = decode_batch(encode_batch(batch, with_tokens))
    # the second request's tokens stay on the first stage (no penalties need them further on)
    kept = admitted if with_tokens else [admitted[0], dataclasses.replace(admitted[1], tokens=[])]
    want = dataclasses.replace(
        batch, tokens=batch.tokens if with_tokens else None, admitted=kept, commits=[]
    )
    assert got == want
    # every field is compared: a field the codec dropped would differ from a changed batch
    for name in (f.name for f in dataclasses.fields(StepBatch)):
        if name not in ("tokens", "admitted", "commits"):
            assert getattr(got, name) == getattr(batch, name), name


def test_result_message_round_trip() -> None:
    result = StepResult(
        [3, -1],
        None,
        [-0.1, float("-inf")],
        [[1, 2], [0, 0]],
        [[-0.5, -1e-30], [0.0, -7.25]],
        [float("nan"), -2.0],
        [[1], [2]],
        [[-1.0], [-3.0]],
        finite=[True, False],
    )
    got = decode_result(encode_result(result))
    assert got.tokens == result.tokens and got.top_ids == result.top_ids
    assert got.finite == result.finite
    for name in ("logprobs", "top_logprobs", "target_logprobs", "target_top_logprobs"):
        a, b = (torch.tensor(getattr(r, name), dtype=torch.float64) for r in (got, result))
        assert torch.equal(a.view(torch.int64), b.view(torch.int64)), name  # exact bits


def test_sampler_never_returns_ids_past_the_tokenizer(session: StageRunner) -> None:
    """A head wider than the tokenizer (DeepSeek pads its vocab) must not sample the padding
    rows: the next step would reject the token and stop the engine."""
    limit = session.tokenizer.get_vocab_size(with_added_tokens=True)
    logits = torch.zeros(1, limit + 50)
    logits[0, limit + 7] = 100.0  # the model's favourite is a padding id
    row = SampleRow(temperature=1.0, seed=3, logprobs=2)
    batch = StepBatch([5], [0], [1], [0], admitted=[NewRequest(0, [5], 1, 0, sampling=row)])
    session.slots.admit(batch.admitted, logits.shape[-1])
    result = session.sampler(logits, batch)
    assert 0 <= result.tokens[0] < limit
    assert all(i < limit for i in result.top_ids[0])


def test_vanishing_temperature_is_greedy() -> None:
    from engramrt.runner.sampler import sample_tokens

    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(1))
    got = sample_tokens(logits, [SampleRow(temperature=1e-45)] * 3, None)
    assert got == logits.argmax(-1).tolist()


def test_stop_string_search_covers_rewritten_text() -> None:
    """Text already sent is not searched again, unless the decoder rewrote it: then a stop
    string that appeared before the unsent end is still found (the whole text is searched)."""
    from engramrt.engine.detokenize import StopStringHoldback

    d = StopStringHoldback(["xy"])
    assert d.update("abcdefgh", False) == ("abcdefg", False)  # the last character is held
    assert d.update("abxyefghij", False, rescan=True) == ("", True)


def test_stop_string_split_across_a_multibyte_character_does_not_leak() -> None:
    from engramrt.engine.detokenize import StopStringHoldback

    d = StopStringHoldback(["a€"])
    first, _ = d.update("za\ufffd", False)  # "€" not complete yet
    second, hit = d.update("za€", False)
    assert hit and first + second == "z"


def test_empty_stop_strings_and_stop_ids_outside_the_vocabulary_are_refused() -> None:
    """An empty stop string would end every request at once and an id past the vocabulary can
    never be sampled: each is an error naming its field (as vLLM), not quietly dropped."""
    from engramrt.engine.request import SamplingParams
    from engramrt.server.protocol import CompletionRequest

    for stop in ([""], ["b", ""]):
        with pytest.raises(ValueError, match="^stop must not hold an empty string"):
            SamplingParams(stop=stop).validate(100)
    for ids, bad in (([100], 100), ([3, -1], -1)):
        with pytest.raises(ValueError, match=rf"^stop_token_ids: token id {bad} is outside"):
            SamplingParams(stop_token_ids=ids).validate(100)
    SamplingParams(stop=["b"], stop_token_ids=[0, 99]).validate(100)
    assert CompletionRequest(prompt="x", stop="b").stops() == ["b"]
    req = CompletionRequest(prompt="x", temperature=None, stream=None, top_p=None)
    assert req.temperature == 1.0 and req.stream is False and req.top_p == 1.0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization must lie in"),
        (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization must lie in"),
        (["--max-num-seqs", "0"], "--max-num-seqs must be >= 1"),
        (["--max-request-bytes", "0"], "--max-request-bytes must be >= 1"),
        (["--async-scheduling", "-pp", "2"], "--async-scheduling needs one pipeline stage"),
        (["--async-scheduling", "-tp", "2"], "--async-scheduling needs one pipeline stage"),
    ],
)
def test_serve_rejects_bad_engine_flags(flags, message, capsys) -> None:
    from engramrt.cli import main

    assert main(["serve", "--device", "cpu", *flags]) == 2
    assert message in capsys.readouterr().err
