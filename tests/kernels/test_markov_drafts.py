"""DSpark's Markov loop (``engramrt.kernels.markov_drafts`` and the torch path
``dspark.markov_loop``) against a restatement in Python: each row's previous token (the sampled
one, then each draft or the teacher's token), its embedding times the head added to the
logits, ids at or past ``limit`` set to ``-inf``, the first largest id taken. Integer-valued
inputs keep every sum exact, so ties are real (many values repeat) and the logits written back
must match to the bit; the rows span several vocabulary tiles and rank chunks, all-negative
rows check the float order of the packed keys, one case keeps its embedding in bf16 (as the
model does) and the sampled tokens come as a strided view. NaN is the largest value and the first
NaN wins, as ``torch.argmax`` has it: a row of NaN drafts its first id (the kernel once drafted
the id ``V`` and read the embedding past its end), a NaN beats +inf in another tile, and a NaN
at or past ``limit`` (in the logits or the Markov head) is never drafted."""

from __future__ import annotations

import math

import pytest
import torch

from engramrt.models.deepseek_v41.dspark import MarkovHead, markov_loop

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def restated(logits, tokens, embed, head, limit, targets):
    logits = logits.double().tolist()
    drafts = []
    for b, row in enumerate(logits):
        prev, out = int(tokens[b]), []
        for i, pos in enumerate(row):
            bias = [
                sum(w * e for w, e in zip(head[v].tolist(), embed[prev].tolist(), strict=True))
                for v in range(len(pos))
            ]
            pos[:] = [
                x + y if limit is None or v < limit else -math.inf
                for v, (x, y) in enumerate(zip(pos, bias, strict=True))
            ]
            out.append(max(range(len(pos)), key=lambda v, pos=pos: _order(pos[v], v)))
            prev = out[-1] if targets is None else int(targets[b, i])
        drafts.append(out)
    return torch.tensor(logits), drafts


def _order(x: float, v: int) -> tuple:
    """argmax's order: NaN above everything, then the value, then the lower id."""
    return (math.isnan(x), 0.0 if math.isnan(x) else x, -v)


def inputs(seed: int, v: int, rank: int, b: int, k: int, negative: bool, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randint(-4, 5, (b, k, v), generator=g).float()
    if negative:
        logits -= 100.0
    logits[0, 0, 3] = -math.inf
    head = MarkovHead(v, rank, dtype)
    with torch.no_grad():
        head.embed.weight.copy_(torch.randint(-2, 3, (v, rank), generator=g))
        head.head.weight.copy_(torch.randint(-1, 2, (v, rank), generator=g).float())
    tokens = torch.randint(0, v, (b, 2), generator=g)[:, 1]  # a strided view, as samples are
    targets = torch.randint(0, v, (b, k), generator=g)
    return logits, tokens, head, targets


F32, BF16 = torch.float32, torch.bfloat16
NAN, INF = math.nan, math.inf
# (row, position, id or None for the whole row, value) written into the logits; ("head", id)
# makes that id's row of the Markov head NaN (its bias is then NaN at every position)
WHOLE_ROW = [(0, 0, None, NAN), (1, 2, 7, INF), (1, 2, 100, NAN), (2, 1, 120, NAN)]
TILES = [(0, 1, 140, NAN), (0, 1, 10, NAN), (1, 0, 3, INF), (1, 3, 64, NAN), (1, 3, 65, NAN)]
CASES = [  # (seed, vocabulary, rank, rows, positions, limit, negative, teacher, embedding dtype,
    # NaN and infinities written)
    (0, 150, 70, 3, 5, None, False, False, F32, []),
    (1, 150, 70, 3, 5, 101, True, False, BF16, []),
    (2, 130, 33, 2, 6, 64, False, True, F32, []),
    (3, 96, 8, 1, 1, None, True, False, F32, []),
    (4, 150, 70, 3, 5, 101, False, False, F32, WHOLE_ROW),
    (5, 150, 70, 2, 4, None, True, False, F32, TILES),
    (6, 150, 70, 2, 4, 101, False, False, F32, [("head", 120)]),
]
IDS = ["plain", "limit-bf16", "teacher", "one", "nan-row", "nan-tiles", "nan-head-past-limit"]


def prepared(case):
    """(logits, tokens, head, limit, teacher's tokens or None) of a case, and the restatement's
    (logits, drafts) for them."""
    seed, v, rank, b, k, limit, negative, teacher, dtype, marks = case
    logits, tokens, head, targets = inputs(seed, v, rank, b, k, negative, dtype)
    for mark in marks:
        if mark[0] == "head":
            with torch.no_grad():
                head.head.weight[mark[1]] = NAN
        else:
            row, pos, at, value = mark
            logits[row, pos, slice(None) if at is None else at] = value
    forced = targets if teacher else None
    want = restated(logits, tokens, head.embed.weight, head.head.weight, limit, forced)
    return (logits, tokens, head, limit, forced), want


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal to the bit as doubles, NaN where NaN."""
    return torch.allclose(got.double(), want.double(), rtol=0, atol=0, equal_nan=True)


@pytest.mark.triton
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_kernel_is_the_restatement(case) -> None:
    from engramrt.kernels.markov_drafts import markov_drafts

    (logits, tokens, head, limit, forced), (want_logits, want) = prepared(case)
    on = logits.to(DEVICE)
    with torch.no_grad():
        got = markov_drafts(
            on,
            tokens.to(DEVICE),
            head.embed.weight.to(DEVICE),
            head.head.weight.to(DEVICE),
            limit,
            None if forced is None else forced.to(DEVICE),
        )
    assert got.cpu().tolist() == want
    assert same(on.cpu(), want_logits)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_torch_path_is_the_restatement(case) -> None:
    (logits, tokens, head, limit, forced), (want_logits, want) = prepared(case)
    with torch.no_grad():
        got = markov_loop(logits, tokens, head, limit, forced)
    assert got.tolist() == want
    assert same(logits, want_logits)
