"""The training recipe: its generated data is fixed by the seed, a few steps on the CPU are
reproducible and lower the loss, and what it saves loads as a served checkpoint (fp8 tables)
whose hash ids are the hasher's; on the GQA fixture (the V4.1 default's own training:
``test_train_v41``)."""

from __future__ import annotations

import torch

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.bundled import train as recipe
from engramrt.engram import load_hasher
from engramrt.runner.batch import StepBatch
from engramrt.runner.stage import StageRunner


def test_corpus_is_fixed_by_the_seed() -> None:
    a, b, c = recipe.corpus(1), recipe.corpus(1), recipe.corpus(2)
    assert a == b and a.train != c.train
    generated = recipe.corpus(1, pydoc=False)  # a later phase's text: the prose left out
    assert a.train[: len(generated.train)] == generated.train and generated.tasks == a.tasks
    assert len(a.train) > len(generated.train) or not _has_pydoc()
    for item in a.tasks["in_context"]:  # every lookup has one answer
        pairs = [p.split("=") for p in item["prompt"].split(". ")[0].split("; ")]
        assert len({k for k, _ in pairs}) == len(pairs)
    train_text = "\n".join(d if isinstance(d, str) else str(d) for d in a.train)
    assert any(not isinstance(d, str) for d in a.train)  # chats: their text is checked too
    held = [f"{i['prompt']} {i['answer']}." for i in a.tasks["arithmetic"]]
    assert not any(h in train_text for h in held)  # held-out sums are never trained on


def test_a_few_steps_are_reproducible_and_learn() -> None:
    kw = {"length": 24, "size": 3, "log": None, "model_dir": GQA_MODEL_DIR}  # V4.1: test_train_v41
    r1, l1 = recipe.train(6, seed=7, **kw)
    r2, l2 = recipe.train(6, seed=7, **kw)
    assert l1 == l2
    for (n, p), (_, q) in zip(
        r1.model.state_dict().items(), r2.model.state_dict().items(), strict=True
    ):
        assert torch.equal(p, q), n
    fresh = recipe.build(7, "cpu", GQA_MODEL_DIR)
    windows = next(recipe.batches([[5, 6, 7, 8, 9] * 6], 1, 24, 3, 0))
    before = recipe.loss_of(fresh, windows).total.item()
    opt = torch.optim.AdamW(recipe.trainable(fresh), lr=3e-3)
    for _ in range(8):
        loss = recipe.loss_of(fresh, windows).total
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert recipe.loss_of(fresh, windows).total.item() < 0.5 * before


def test_saved_checkpoint_serves(tmp_path) -> None:
    runner, _ = recipe.train(2, seed=3, length=16, size=2, log=None, model_dir=GQA_MODEL_DIR)
    out = recipe.save(runner, tmp_path / "m", seed=3, model_dir=GQA_MODEL_DIR)
    assert sorted(p.name for p in (out / "tasks").iterdir()) == [
        "arithmetic.jsonl",
        "in_context.jsonl",
        "recall.jsonl",
    ]
    served = StageRunner.load(out, 1, 64, "cpu", "float32")
    table = served.model.layers["1"].engram.embed
    assert table.weight.dtype == torch.float8_e4m3fn
    logits = served.compute(StepBatch([5, 6, 7], [0], [3], [0], new_blocks=[[0]]))
    assert torch.isfinite(logits).all()
    hasher, _ = load_hasher(out, 1, "cpu")
    ids = torch.tensor([5, 6, 7])
    want = hasher.extend(ids, torch.tensor([0]), torch.tensor([3]), torch.tensor([0]))
    got = served.hasher.extend(ids, torch.tensor([0]), torch.tensor([3]), torch.tensor([0]))
    assert torch.equal(got, want)


def _has_pydoc() -> bool:
    try:
        import pydoc_data.topics  # noqa: F401
    except ImportError:
        return False
    return True
