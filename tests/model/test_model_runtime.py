"""The model end to end: KV-cache decode == full recompute, batching, fail-closed Engram,
Engram ablation, and `engramrt generate` on the bundled model."""

from __future__ import annotations

import random

import pytest
import torch

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.cli import main
from engramrt.engram import load_hasher
from engramrt.model.context import ForwardContext
from engramrt.model.trace import EngramUpdateStats
from engramrt.runner.batch import StepBatch
from engramrt.runner.stage import StageRunner, new_kv_cache
from tests.support.model_factory import make_model


def new_session(model, slots: int = 4) -> StageRunner:
    hasher, tok = load_hasher(GQA_MODEL_DIR, slots)
    return StageRunner(model, hasher, new_kv_cache(model, slots), tok)


@pytest.fixture(scope="module")
def model():
    return make_model(seed=1, num_hidden_layers=3, engram_layer_ids=[0, 2])[0]


def full_logits(model, tokens: list[int]) -> torch.Tensor:
    return new_session(model, 1).compute(StepBatch(tokens, [0], [len(tokens)], [0]))


@pytest.mark.parametrize("prompt_len", [1, 2, 5, 11])
def test_incremental_decode_equals_full_recompute(model, prompt_len: int) -> None:
    """Prefill (in random chunks) then decode through the KV cache and the history gives the
    logits of recomputing the whole sequence from scratch at every step."""
    rng = random.Random(prompt_len)
    tokens = [rng.randrange(6, 1024) for _ in range(prompt_len + 6)]
    s = new_session(model, 2)
    cuts = sorted(rng.sample(range(1, prompt_len), min(prompt_len - 1, 2)))
    bounds = [0, *cuts, prompt_len]
    for a, b in zip(bounds, bounds[1:], strict=False):
        got = s.compute(StepBatch(tokens[a:b], [1], [b - a], [a]))
        torch.testing.assert_close(got, full_logits(model, tokens[:b])[a:b], rtol=1e-4, atol=1e-4)
    for p in range(prompt_len, len(tokens)):
        got = s.compute(StepBatch([tokens[p]], [1], [1], [p]))
        torch.testing.assert_close(
            got, full_logits(model, tokens[: p + 1])[-1:], rtol=1e-4, atol=1e-4
        )


def test_batched_requests_equal_alone(model) -> None:
    """Three requests of different lengths in one flat batch (prefill, then decode steps) get
    the logits each gets alone; slots do not leak into each other."""
    rng = random.Random(7)
    prompts = [[rng.randrange(6, 1024) for _ in range(n)] for n in (4, 9, 1)]
    s = new_session(model, 4)
    slots = [3, 0, 2]
    flat = [t for p in prompts for t in p]
    got = s.compute(StepBatch(flat, slots, [len(p) for p in prompts], [0, 0, 0]))
    start = 0
    for p in prompts:
        want = full_logits(model, p)
        torch.testing.assert_close(got[start : start + len(p)], want, rtol=1e-4, atol=1e-4)
        start += len(p)
    seqs = [list(p) for p in prompts]
    for _ in range(3):
        nxt = [rng.randrange(6, 1024) for _ in seqs]
        got = s.compute(StepBatch(nxt, slots, [1, 1, 1], [len(q) for q in seqs]))
        for i, q in enumerate(seqs):
            q.append(nxt[i])
            torch.testing.assert_close(
                got[i : i + 1], full_logits(model, q)[-1:], rtol=1e-4, atol=1e-4
            )


def test_forward_reports_engram_layers(model) -> None:
    """The context of a forward lists the Engram layers that ran, in layer order."""
    s = new_session(model, 1)
    t = torch.tensor([7, 8, 9])
    ids = s.hasher.extend(t, torch.tensor([0]), torch.tensor([3]), torch.tensor([0]))
    ctx = ForwardContext.for_runs([0], [3], [0], s.kv, s.slots.blocks, "cpu", hash_ids=ids)
    model(t, ctx)
    assert ctx.engram_ran == [0, 2]


def test_forward_without_hash_ids_raises(model) -> None:
    s = new_session(model, 1)
    ctx = ForwardContext.for_runs([0], [3], [0], s.kv, s.slots.blocks, "cpu")
    with pytest.raises(
        RuntimeError, match="layer 0 owns an Engram but the forward got no hash ids"
    ):
        model(torch.tensor([7, 8, 9]), ctx)


def test_skipped_engram_is_an_error() -> None:
    """A declared Engram layer that did not run (its module bypassed) fails the forward."""
    m, _ = make_model(seed=2, num_hidden_layers=3, engram_layer_ids=[0, 2])
    m.layers["2"].engram = None
    with pytest.raises(RuntimeError, match=r"Engram layers \[2\] did not run"):
        new_session(m, 1).compute(StepBatch([7, 8, 9], [0], [3], [0]))


def test_engram_ablation_changes_logits() -> None:
    """Zeroing one Engram table changes the logits of every token (the Engram is not inert)."""
    m, _ = make_model(seed=3, num_hidden_layers=3, engram_layer_ids=[0, 2])
    tokens = [11, 12, 13, 14, 15, 16]
    before = full_logits(m, tokens)
    with torch.no_grad():
        m.layers["2"].engram.embed.weight.zero_()
    after = full_logits(m, tokens)
    assert ((before - after).abs().amax(-1) > 1e-3).all()


def test_engram_update_is_visible_on_default_model() -> None:
    """On the bundled model each Engram update is a sizeable fraction of the stream and changes
    most stream elements (bf16, as shipped)."""

    s = StageRunner.load(GQA_MODEL_DIR)
    stats = EngramUpdateStats()
    ids = s.tokenizer.encode("The Engram hashes every token of this prompt.").ids
    s.tracer = stats
    s.compute(StepBatch(ids, [0], [len(ids)], [0]))
    summary = stats.summary()
    assert sorted(summary) == list(s.model.cfg.engram.layer_ids)
    for row in summary.values():
        assert row["update_rms"] > 0.2 * row["stream_rms"]
        assert row["changed_frac"] > 0.5


def _generate(capsys: pytest.CaptureFixture, *args: str) -> str:
    assert main(["generate", "--prompt", "The quick brown fox", "--device", "cpu", *args]) == 0
    return capsys.readouterr().out


def test_generate_greedy_is_deterministic(capsys: pytest.CaptureFixture) -> None:
    first = _generate(capsys, "--max-tokens", "12")
    assert first.strip() and first == _generate(capsys, "--max-tokens", "12")


def test_generate_sampling_reproducible_by_seed(capsys: pytest.CaptureFixture) -> None:
    runs = {
        seed: [
            _generate(capsys, "--temperature", "1.0", "--top-p", "0.9", "--seed", seed)
            for _ in range(2)
        ]
        for seed in ("1", "2")
    }
    assert runs["1"][0] == runs["1"][1] and runs["2"][0] == runs["2"][1]
    assert runs["1"][0] != runs["2"][0]


def test_generate_rejects_bad_input(capsys: pytest.CaptureFixture) -> None:
    assert main(["generate", "--prompt", "x", "--max-tokens", "0"]) == 2
    assert "max_tokens" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--max-tokens", "5000"]) == 2
    assert "maximum context length" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
