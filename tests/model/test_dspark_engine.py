"""DSpark speculative decoding through the engine, on ``v41-small`` (fp32, CPU): greedy output
equals decoding without speculation, and every draft the engine proposes after a verify step
(counted and rolled back on the device) is the draft a plain engine makes at the same position.

The random model's drafts are almost never right, so acceptance is driven by an oracle whose
drafts come from the output without speculation, the first ``j`` right (``speculative_run``),
while the stage also runs its DSpark pass after every step from the accepted position it counts
itself. One request at a time (V4.1 is not batch-invariant:
``speculative_run``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from engramrt.engine.speculative import SpecConfig
from engramrt.runner.stage import StageRunner
from tests.engine.test_engine import assert_idle
from tests.model.test_v41_engine import PARAMS, PROMPTS, ends_of, speculative_run
from tests.support.engine_factory import build_engine
from tests.support.poisoned import edited_model, poison

K = 3


@pytest.fixture(scope="module")
def runner(v41_small: Path) -> StageRunner:
    return StageRunner.load(v41_small, num_slots=1, max_len=256, dtype="float32", dspark=True)


def recording(engine):
    """``engine`` whose every step records each running request's proposed drafts by (request,
    the token count they follow); the outputs by request."""
    proposals, outputs = {}, {}
    step = engine.step

    def step_and_record():
        outs = step()
        for o in outs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        for req in engine.scheduler.running:
            if req.proposed_at == req.num_tokens:
                proposals[req.id, req.num_tokens] = list(req.proposed)
        return outs

    engine.step = step_and_record
    engine.proposals, engine.outputs = proposals, outputs
    return engine


@pytest.fixture(scope="module")
def base(runner):
    """The engine without speculation, run once: its outputs and proposals (its stage drafts
    after every step, and the engine does not use the drafts)."""
    engine = build_engine(runner, 256, 1, max_num_seqs=1)
    runner.speculate(K)
    engine = recording(engine)
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        engine.add_request(str(i), p, sp)
    while engine.has_work():
        engine.step()
    return engine


def test_drafts_after_verify_steps_are_the_plain_drafts(runner, base) -> None:
    """Verify runs accepting 0..K drafts (the oracle's), each followed on the device by the
    acceptance count, the bonus token and a DSpark draft from there: every proposal equals the
    plain engine's at the same position (the rings hold the target's features, a rejected
    draft's rows out of every later window), and the greedy tokens are the plain ones."""
    want = [base.outputs[str(i)] for i in range(len(PROMPTS))]
    spec = {}

    def engine_with(**kw):
        spec["engine"] = recording(build_engine(runner, 256, 1, **kw))
        return spec["engine"]

    assert speculative_run(engine_with, {"max_num_seqs": 1}, want, K) == want
    got = spec["engine"].stage_proposals
    extra = got.keys() - base.proposals.keys()  # drafted after a request's last token
    assert all(n == len(PROMPTS[int(r)]) + PARAMS[int(r)].max_tokens for r, n in extra)
    got = {key: v for key, v in got.items() if key not in extra}
    assert len(got) > 25
    assert all(got[key] == base.proposals[key] for key in got)
    assert len({tuple(v) for v in got.values()}) > len(got) // 2  # drafts that vary


def test_overlap_with_dspark_rolls_back_every_acceptance_length(runner, base) -> None:
    """Overlap scheduling: each step is launched before the host reads the one before, so a
    run behind a verify run starts as if all its drafts were accepted and the stage moves it
    back on the device (eagerly here: it reads the count back first). Oracle drafts accepting
    0..K: greedy tokens equal decoding without speculation, and each DSpark pass after a
    sampled run drafts what the plain engine drafts there."""
    want = [base.outputs[str(i)] for i in range(len(PROMPTS))]
    spec = {}

    def engine_with(**kw):
        spec["engine"] = build_engine(runner, 256, 1, overlap=True, **kw)
        assert spec["engine"].overlap
        return spec["engine"]

    assert speculative_run(engine_with, {"max_num_seqs": 1}, want, K) == want
    got = spec["engine"].stage_proposals
    common = got.keys() & base.proposals.keys()
    assert len(common) > 25 and all(got[key] == base.proposals[key] for key in common)


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 8}], ids=["plain", "chunked"])
def test_greedy_with_dspark_equals_without(runner, base, kw: dict) -> None:
    """``--speculative-config {"method": "dspark", ...}``: each decoding step verifies the K
    drafts its previous step made; greedy tokens equal decoding without speculation, whole or
    in chunks of 8 tokens, each verified block is the plain engine's draft at its anchor, and
    the engine ends idle."""
    engine = build_engine(
        runner, 256, 1, max_num_seqs=1, speculative=SpecConfig(K, method="dspark"), **kw
    )
    verified = []
    launch = engine._launch

    def launch_and_record():  # synchronous: the drafts a run verifies are known at its launch
        launched = launch()
        for row in launched.rows if launched else []:
            if row.drafts:
                req = row.req
                assert req.proposed_at == row.start + 1
                verified.append((req.id, row.start + 1, req.proposed[: len(row.drafts)]))
        return launched

    engine._launch = launch_and_record
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
        engine.add_request(str(i), p, sp)
    out = {}
    while engine.has_work():
        for o in engine.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert out == base.outputs
    assert len(verified) > 20
    # (fewer than K where max_tokens leaves less room)
    assert all(d == base.proposals[rid, n][: len(d)] for rid, n, d in verified)
    stats = engine.stats()
    assert stats["spec_decode_num_draft_tokens"] == sum(len(d) for _, _, d in verified)
    assert_idle(engine)


def test_drafts_on_the_last_pipeline_stage_equal_one_stage(v41_small: Path, runner) -> None:
    """Two stages in one process (layers 0-2 | 3-5: the cut before the target layers' stage):
    the last stage embeds the draft block with its own copy of the embedding and counts a
    verify run's acceptance from the drafts the step message carries (no token rows there);
    its drafts after a prefill and after a verify step equal the one-stage runner's, bitwise."""
    from engramrt.runner.batch import StepBatch

    stages = [
        StageRunner.load(
            v41_small, num_slots=1, max_len=256, dtype="float32", layer_ids=ids, dspark=ids[-1] == 5
        )
        for ids in ([0, 1, 2], [3, 4, 5])
    ]
    assert stages[1].model.embed is not None and not stages[1].is_first
    for r in (runner, *stages):
        r.allocate_kv(1, 256, 4, 64, slack=K)
        r.speculate(K)
    p = PROMPTS[0]
    prefill = {"new_blocks": [list(range(-(-len(p) // 4) + 2))]}

    def both(batch: StepBatch):
        whole = runner.run(batch)
        carry = stages[0].compute(batch)
        split = stages[1].run(
            StepBatch(
                None,
                batch.slots,
                batch.run_lens,
                batch.start_pos,
                drafts=batch.drafts,
                draft_tokens=batch.draft_tokens,
            ),
            carry,
        )
        assert split.tokens == whole.tokens and split.drafts == whole.drafts
        return whole

    first = both(StepBatch(p, [0], [len(p)], [0], **prefill))
    bonus, drafts = first.tokens[0], first.drafts[0][:K]
    right = drafts[:1] + [(t + 1) % 1000 for t in drafts[1:]]  # the first may be accepted
    verify = both(
        StepBatch([bonus, *right], [0], [1 + K], [len(p)], drafts=[K], draft_tokens=right)
    )
    assert len(verify.tokens) == 1 + K


def test_dspark_under_preemption(v41_small: Path) -> None:
    """DSpark speculation with four requests in a cache too small for all of them (preempted,
    recomputed, their stale proposals never used): greedy tokens equal each request's alone
    without speculation."""
    from tests.engine.test_engine import drain
    from tests.engine.test_speculative import _run  # (the table check of ``drain`` does not

    # apply: a verify step's spare blocks go back before the stage's tables learn it)
    from tests.model.test_v41_engine import prompt

    runner = StageRunner.load(v41_small, num_slots=4, max_len=256, dtype="float32", dspark=True)
    prompts = [prompt(n, 10 + n) for n in (30, 41, 26, 35)]
    params = PARAMS[0].__class__(max_tokens=12, temperature=0, ignore_eos=True)
    alone = []
    for p in prompts:
        engine = build_engine(runner, 256, 4, max_num_seqs=4, num_blocks=64)
        engine.add_request("x", p, params)
        alone.append(drain(engine)["x"].ids)
    engine = build_engine(
        runner, 256, 4, max_num_seqs=4, num_blocks=40, speculative=SpecConfig(K, method="dspark")
    )
    assert _run(engine, prompts, [params] * len(prompts)) == alone
    stats = engine.stats()
    assert stats["spec_decode_num_draft_tokens"] > 0
    assert stats["num_preemptions"] > 0
    assert_idle(engine)


def test_seeded_sampling_with_dspark_draws_the_same_tokens(runner) -> None:
    """Seeded sampling (a row's noise keyed by its output index): with DSpark drafts verified
    the drawn tokens are those drawn without speculation."""
    from dataclasses import replace

    from tests.engine.test_speculative import _run

    params = [replace(PARAMS[0], temperature=0.8, top_p=0.95, seed=11 + i) for i in range(2)]
    prompts = PROMPTS[:2]
    want = _run(build_engine(runner, 256, 1, max_num_seqs=1), prompts, params)
    engine = build_engine(
        runner, 256, 1, max_num_seqs=1, speculative=SpecConfig(K, method="dspark")
    )
    assert _run(engine, prompts, params) == want
    assert engine.stats()["spec_decode_num_draft_tokens"] > 0


def test_drafts_stay_inside_the_tokenizer(runner, monkeypatch) -> None:
    """DeepSeek pads its vocabulary past the tokenizer: a draft there would be a token the
    next step cannot take (the sampler never draws one). With the Markov head pushed towards a
    padding id, every draft stays below the tokenizer's size, which the argmax alone would not."""
    import torch

    from engramrt.runner.batch import StepBatch

    runner.allocate_kv(1, 256, 4, 64, slack=K)
    p = PROMPTS[1]
    batch = StepBatch(p, [0], [len(p)], [0], new_blocks=[list(range(-(-len(p) // 4)))])
    runner.compute(batch)
    head = runner.model.mtp[-1].markov_head.head.weight
    pad = head.shape[0] - 3
    saved = head[pad].clone()
    head.data[pad] = 1e3 * runner.model.mtp[-1].markov_head.embed.weight.sign().mean(0)
    try:
        token = torch.tensor([p[-1]])
        runner.speculate(K)  # the stage's own draft pass, with the sampler's limit
        monkeypatch.setattr(runner.sampler, "token_limit", None)
        assert (runner.verifier.propose(*ends_of(batch), token) == pad).any()  # the bias wins
        monkeypatch.setattr(runner.sampler, "token_limit", pad)
        runner.speculate(K)
        assert (runner.verifier.propose(*ends_of(batch), token) < pad).all()
    finally:
        head.data[pad] = saved


def test_an_engine_refuses_a_cache_without_room_for_its_drafts(runner) -> None:
    """Speculation over a V4.1 cache allocated without slack (rings of ``window`` rows) would
    let a rejected draft's ring row be read: the engine refuses it, naming the rule."""
    runner.allocate_kv(1, 256, 4, 64)
    with pytest.raises(ValueError, match=r"rings of window \+ 3 rows"):
        build_engine(
            runner,
            256,
            1,
            max_num_seqs=1,
            allocate=False,
            speculative=SpecConfig(K, method="dspark"),
        )
    runner.allocate_kv(1, 256, 4, 64, slack=K)
    build_engine(
        runner, 256, 1, max_num_seqs=1, allocate=False, speculative=SpecConfig(K, method="dspark")
    )


def test_drafts_without_the_confidence_head_are_the_same_drafts(v41_small: Path) -> None:
    """The verifier's draft pass skips the confidence head (``confidence=False``): the same
    drafts and logits as the full pass, bitwise, after a prefill of two requests; no scores."""
    import torch

    from engramrt.models.deepseek_v41 import dspark
    from engramrt.runner.batch import StepBatch

    runner = StageRunner.load(v41_small, num_slots=2, max_len=64, dtype="float32", dspark=True)
    a, b = PROMPTS[0][:12], PROMPTS[1][:7]
    batch = StepBatch(a + b, [0, 1], [12, 7], [0, 0])
    runner.compute(batch)
    ends, slots = ends_of(batch)
    tokens = torch.tensor([5, 9])
    full = dspark.draft(runner.model, runner.kv, ends, slots, tokens)
    short = dspark.draft(runner.model, runner.kv, ends, slots, tokens, confidence=False)
    assert full.confidence is not None and short.confidence is None
    assert torch.equal(full.tokens, short.tokens) and torch.equal(full.logits, short.logits)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_nan_row_drafts_inside_the_vocabulary_and_ends_its_request(
    v41_small: Path, tmp_path: Path, device: str
) -> None:
    """One token's embedding row NaN: a request whose prompt holds it has NaN logits, and its
    DSpark pass NaN draft logits. Its drafts stay inside the tokenizer (the Markov kernel once
    drafted the id ``V`` from a NaN row, which the verify run launched behind it under overlap
    then embedded), the request ends with finish reason ``error``, and the request after it in
    the same slot gives its output alone (the torch attention once weighed the earlier owner's
    NaN rows, which its window cannot see, by 0: NaN). On CUDA the kernels, on the CPU the
    torch paths."""
    neighbour = PROMPTS[1]
    token = next(t for t in PROMPTS[0] if t not in neighbour)
    # last, so its own row is NaN: an earlier one reaches the logits only through attention,
    # which on CUDA never picks a NaN compressed entry (the top-k takes no NaN score)
    victim = [*PROMPTS[0], token]
    model = edited_model(tmp_path / "m", poison("embed.weight", token), src=v41_small)
    runner = StageRunner.load(
        model, num_slots=1, max_len=256, device=device, dtype="float32", dspark=True
    )
    limit = runner.sampler.token_limit

    def run(prompts: list[list[int]]) -> dict[str, tuple[list[int], str]]:
        engine = build_engine(
            runner, 256, 1, max_num_seqs=1, overlap=True, speculative=SpecConfig(K, method="dspark")
        )
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, replace(PARAMS[0], max_tokens=10))
        out: dict[str, tuple[list[int], str]] = {}
        while engine.has_work():
            for o in engine.step():
                ids, _ = out.get(o.request_id, ([], ""))
                out[o.request_id] = (ids + o.new_token_ids, o.finish_reason)
                assert int(runner.slots.tokens.max()) < limit
        assert_idle(engine)
        return out

    alone = run([neighbour])["0"]
    got = run([victim, neighbour])
    assert got["0"] == ([], "error") and got["1"] == alone and alone[1] == "length"
