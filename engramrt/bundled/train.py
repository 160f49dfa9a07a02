"""Train the bundled model's weights from a fixed seed, on text that needs no network.

The data is generated here: closed-book facts about made-up countries (their capitals, recoverable
only from memorised n-grams: what Engram tables hold), templated arithmetic, in-context key ->
value recall (a control that needs no memory), the facts and sums again as one-turn chats in the
model's chat template, and English prose from the Python standard library's own documentation
(``pydoc_data.topics``). The forward pass is the engine's own: a
``StageRunner`` prefill of each sequence from position 0 with the torch reference kernels, hash
ids from engramrt's hasher, so what is trained is exactly what is served. Engram tables train in
fp32 and are quantised to the served fp8 format when saved.

    python -m engramrt.bundled.train OUT_DIR [--steps 3800] [--device cuda] [--length 128]
        [--batch 64] [--lr 3e-3]

``save`` writes the held-out items beside the weights (``engramrt eval`` task files).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from engramrt.bundled import DEFAULT_MODEL_DIR
from engramrt.bundled.weights import seeded_model
from engramrt.config import load_json, model_config
from engramrt.engram import load_hasher
from engramrt.engram.table import EngramTable, quantize_rows
from engramrt.kernels import FORCE_TORCH_ENV
from engramrt.model.checkpoint import save_checkpoint
from engramrt.model.context import ForwardContext
from engramrt.prompts import PromptEncoder
from engramrt.runner.batch import StepBatch
from engramrt.runner.stage import StageRunner

SEED = 4242
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


def corpus(seed: int = SEED, countries: int = 64, lookups: int = 3000) -> Corpus:
    rng = random.Random(seed)
    names = sorted({_name(rng, 3) for _ in range(4 * countries)})[:countries]
    capitals = [_name(rng, 2) for _ in names]
    docs, tasks = [], {"recall": [], "arithmetic": [], "in_context": []}
    for country, capital in zip(names, capitals, strict=True):
        docs.append(f"The capital of {country} is {capital}.")
        docs.append(f"{capital} is the capital of {country}.")
        docs.append(chat(f"What is the capital of {country}?", f"The capital is {capital}."))
        tasks["recall"].append({"prompt": f"The capital of {country} is", "answer": capital,
                                "stop": ["."]})  # fmt: skip
    pairs = [(a, b) for a in range(30) for b in range(30)]
    rng.shuffle(pairs)
    held = pairs[: len(pairs) // 10]
    docs += [f"{a} + {b} = {a + b}." for a, b in pairs[len(held) :]]
    docs += [chat(f"What is {a} + {b}?", f"{a} + {b} = {a + b}.") for a, b in pairs[len(held) :]]
    tasks["arithmetic"] = [{"prompt": f"{a} + {b} =", "answer": str(a + b), "stop": ["."]}
                           for a, b in held]  # fmt: skip

    def lookup(r: random.Random) -> tuple[str, str]:
        keys = r.sample(sorted({s + t for s in _SYLLABLES[:8] for t in _SYLLABLES[8:]}), 4)
        values = [str(r.randrange(10, 100)) for _ in keys]
        table = "; ".join(f"{k}={v}" for k, v in zip(keys, values, strict=True))
        i = r.randrange(len(keys))
        return f"{table}. {keys[i]}=", values[i]

    for _ in range(lookups):
        prompt, answer = lookup(rng)
        docs.append(f"{prompt}{answer}.")
    tasks["in_context"] = [{**dict(zip(("prompt", "answer"), lookup(rng), strict=True)),
                            "stop": ["."]} for _ in range(64)]  # fmt: skip
    try:
        from pydoc_data.topics import topics

        docs += [" ".join(text.split())[:2000] for _, text in sorted(topics.items())]
    except ImportError:  # some Python builds leave it out: the tasks need no prose
        pass
    return Corpus(docs, tasks)


def batches(token_docs: list[list[int]], eos: int, length: int, size: int, seed: int):
    """Endless batches of ``size`` windows of ``length`` tokens over the documents joined by
    EOS, in an order fixed by ``seed``."""
    stream = [t for doc in token_docs for t in (doc if doc[-1:] == [eos] else [*doc, eos])]
    rng = random.Random(seed)
    while True:
        yield [stream[s : s + length] for s in
               (rng.randrange(len(stream) - length) for _ in range(size))]  # fmt: skip


def loss_of(runner: StageRunner, windows: list[list[int]]) -> torch.Tensor:
    """Mean next-token cross-entropy of the windows, each a request prefilled from position 0
    in its own slot (a fresh KV cache: the forward writes it)."""
    n, length = len(windows), len(windows[0])
    block = 16
    runner.allocate_kv(n, length, block, n * -(-length // block))
    tables = [list(range(i * -(-length // block), (i + 1) * -(-length // block)))
              for i in range(n)]  # fmt: skip
    slots = list(range(n))
    for slot in slots:
        runner.hasher.rebuild(slot, [])
    tokens = [t for w in windows for t in w]
    runner.slots.advance(StepBatch(tokens, slots, [length] * n, [0] * n, new_blocks=tables))
    ctx = ForwardContext.for_runs(slots, [length] * n, [0] * n, runner.kv, runner.slots.blocks,
                                  runner.device)  # fmt: skip
    logits = runner.forward(ctx, None).view(n, length, -1)
    target = torch.tensor(windows, device=logits.device)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), target[:, 1:].flatten())


def trainable(runner: StageRunner) -> list[torch.Tensor]:
    params = list(runner.model.parameters())
    for block in runner.model.layers.values():
        if block.engram is not None:  # the tables are buffers (fp8 when served): fp32 here
            params.append(block.engram.embed.weight.requires_grad_(True))
    return params


def build(seed: int, device: str) -> StageRunner:
    cfg = model_config(load_json(DEFAULT_MODEL_DIR))
    torch.manual_seed(seed)
    model = seeded_model(cfg, seed, torch.float32, fp8_tables=False).to(device).train()
    model.requires_grad_(True)
    hasher, tokenizer = load_hasher(DEFAULT_MODEL_DIR, 64, device)
    return StageRunner(model, hasher, None, tokenizer, seed)


def train(steps: int, seed: int = SEED, device: str = "cpu", length: int = 64, size: int = 32,
          lr: float = 3e-3, log=print) -> tuple[StageRunner, list[float]]:  # fmt: skip
    """``steps`` AdamW steps (cosine decay after a short warm-up); the runner and the losses.
    The torch reference kernels run (they have gradients), also on a GPU, with deterministic
    algorithms: the same seed gives the same weights."""
    saved, deterministic = (
        os.environ.get(FORCE_TORCH_ENV),
        torch.are_deterministic_algorithms_enabled(),
    )
    os.environ[FORCE_TORCH_ENV] = "1"
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        return _train(steps, seed, device, length, size, lr, log)
    finally:
        torch.use_deterministic_algorithms(deterministic)
        if saved is None:
            os.environ.pop(FORCE_TORCH_ENV, None)
        else:
            os.environ[FORCE_TORCH_ENV] = saved


def _train(steps, seed, device, length, size, lr, log) -> tuple[StageRunner, list[float]]:
    runner = build(seed, device)
    data = corpus(seed)
    enc = PromptEncoder.load(DEFAULT_MODEL_DIR, runner.tokenizer)
    eos = runner.model.cfg.eos_token_id
    token_docs = [enc.text(d) if isinstance(d, str) else enc.chat(d, add_generation_prompt=False)
                  for d in data.train]  # fmt: skip
    params = trainable(runner)
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.0)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    losses, t0 = [], time.perf_counter()
    for step, windows in zip(range(steps), batches(token_docs, eos, length, size, seed),
                             strict=False):  # fmt: skip
        loss = loss_of(runner, windows)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        if log and (step % 50 == 0 or step == steps - 1):
            log(f"step {step}: loss {losses[-1]:.3f} ({time.perf_counter() - t0:.0f} s)")
    return runner, losses


def save(runner: StageRunner, out: Path, seed: int = SEED) -> Path:
    """The checkpoint in the served format (bf16 weights, fp8 tables), the bundled config and
    tokenizer, and the held-out task files beside it."""
    model = runner.model.eval().requires_grad_(False).cpu()
    for name, p in model.named_parameters():  # the served dtypes, as the seeded weights have
        if ".hc_" not in name:
            p.data = p.data.to(torch.bfloat16)
    for block in model.layers.values():
        if block.engram is not None:
            block.engram.embed = EngramTable(*quantize_rows(block.engram.embed.weight.detach()))
    raw = load_json(DEFAULT_MODEL_DIR)
    save_checkpoint(model, out, raw, tokenizer_dir=DEFAULT_MODEL_DIR)
    tasks = out / "tasks"
    tasks.mkdir(exist_ok=True)
    for name, items in corpus(seed).tasks.items():
        (tasks / f"{name}.jsonl").write_text("".join(json.dumps(i) + "\n" for i in items))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--steps", type=int, default=3800)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--length", type=int, default=128, help="tokens per training window")
    ap.add_argument("--batch", type=int, default=64, help="windows per step")
    ap.add_argument("--lr", type=float, default=3e-3)
    args = ap.parse_args()
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS
    runner, _ = train(args.steps, args.seed, args.device, args.length, args.batch, args.lr)
    print(f"saved to {save(runner, Path(args.out), args.seed)}")


if __name__ == "__main__":
    main()
