"""Speculative decoding's device half (``engramrt.runner.verify``): the n-gram lookup over the
token rows against the host's lookup (padded as the engine pads), a lagging run moved back on
the device against the same run built from its true start, and the bookkeeping kernels against
the torch statement."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from engramrt.engine.speculative import SpecConfig
from engramrt.model.context import ForwardContext, GraphShape
from engramrt.models.gqa.cache import GQACache
from engramrt.runner.batch import StepBatch
from engramrt.runner.slots import SlotTable
from engramrt.runner.verify import Verifier, ngram_drafts
from tests.support.graph_replay import replayed_context
from tests.support.kernel_env import kernel_device, triton_runs


def test_ngram_drafts_equal_the_host_lookup_padded() -> None:
    """Random rows over four ids (many repeats), random ends and lookup lengths: each row's
    drafts are the host proposer's, padded with its last draft (or the last token where it
    finds none), as the engine pads a verify run to K drafts."""
    rng = random.Random(0)
    for _ in range(40):
        k, lo = rng.randrange(1, 6), rng.randrange(1, 4)
        hi = lo + rng.randrange(3)
        gen = torch.Generator().manual_seed(rng.randrange(2**31))
        rows = torch.randint(0, 4, (6, 24), generator=gen, dtype=torch.int32)
        slots = torch.tensor([rng.randrange(6) for _ in range(5)])
        last = torch.tensor([rng.randrange(24) for _ in range(5)])
        got = ngram_drafts(rows, slots, last, k, hi, lo)
        for b in range(5):
            tokens = rows[slots[b], : last[b] + 1].tolist()
            want = SpecConfig(k, hi, lo).propose(tokens, k)
            want += [(want or tokens)[-1]] * (k - len(want))
            assert got[b].tolist() == want, (tokens, k, hi, lo)


KERNELS = pytest.param(
    True,
    marks=[
        pytest.mark.triton,
        pytest.mark.skipif(not triton_runs(), reason="needs Triton (GPU or TRITON_INTERPRET=1)"),
    ],
)


@pytest.mark.parametrize("kernels", [False, KERNELS])
@pytest.mark.parametrize("pad", [None, GraphShape(False, 4 * 5, 4, 4), GraphShape(True, 8, 8)])
def test_a_lagging_run_moves_back_to_its_true_start(pad, kernels) -> None:
    """Runs built from optimistic starts (every draft of the verify run before them counted
    as accepted), moved back on the device by the drafts their slots rejected (the torch
    statement, or the one launch of ``kernels.verify_rows.shift``), equal the runs built from
    their true starts: positions, cache rows, context lengths, starts, decode lengths; padding
    (a graph's) untouched. A decode graph's step is narrower than the graph's table: each run's
    blocks are read where the step put them."""
    from engramrt.kernels import verify_rows

    rng = np.random.default_rng(1)
    dev = kernel_device() if kernels else "cpu"
    kv = GQACache([0], 96, 4, 1, 8, torch.float32, dev, 48, 8)
    tables = kv.fixed_tables()  # each slot 8 of its 12 blocks, out of order
    tables.set(list(range(8)), None, rng.permutation(96)[:64].reshape(8, 8).tolist())
    n = pad.requests - 1 if pad is not None else 5
    run = 1 if pad is not None and pad.decode else 5
    slots = rng.permutation(8)[:n].tolist()
    true = rng.integers(0, 23, n).tolist()
    lag = rng.integers(0, 2, n).tolist()
    verifier = Verifier(8, 4, lambda *a: None, None, None, torch.device(dev))
    verifier.rejected[:8] = torch.from_numpy(rng.integers(0, 5, 8))
    rejected = verifier.rejected.tolist()
    start = [t + lg * rejected[s] for t, lg, s in zip(true, lag, slots, strict=True)]
    runs = [run] * n

    def step(starts: list[int], lags: list[int]) -> ForwardContext:
        """Built as the stage builds it (a decode graph's step at its own width, the others'
        at the graph's) and, for a graph, as the graph sees it."""
        width = None if pad is not None and pad.decode else 12
        host = ForwardContext.for_runs(slots, runs, starts, kv, tables, dev, width, pad, lag=lags)
        return host if pad is None else replayed_context(host, kv, tables, 12, pad, lag=[])

    built = step(start, lag)
    if kernels:
        verify_rows.shift(built, verifier.rejected)
    else:
        verifier.shift(built)
    want = step(true, [0] * n)
    for name in ("positions", "slot_mapping", "context_lens", "start_pos_t", "dec_lens", "flat"):
        if getattr(want, name) is None:
            continue
        if name == "flat":  # everything but the lag flags themselves
            built.lag.zero_()
        assert torch.equal(getattr(built, name), getattr(want, name)), name
    assert lag.count(1) and (built.slot_mapping == -1).any() == (pad is not None)


class _Commits:
    """A hasher that records the history commits it is given (the kernel path and the torch
    path must commit the same blocks: the anchor and the accepted drafts, to the same rows)."""

    class history:  # noqa: N801 (the hasher's attribute)
        pad_row = 99

    def __init__(self) -> None:
        self.made: list[tuple[int, list[int]]] = []

    def commit_verify(self, tokens, slots, accepted, check=True) -> None:
        blocks = tokens.view(len(slots), -1).tolist()
        for b, (slot, n) in enumerate(zip(slots.tolist(), accepted.tolist(), strict=True)):
            if slot != self.history.pad_row:
                self.made.append((slot, blocks[b][: 1 + n]))


def _propose(last: torch.Tensor, slots: torch.Tensor, bonus: torch.Tensor) -> torch.Tensor:
    """Drafts that depend on every input: a wrong last position, slot or bonus shows."""
    i = torch.arange(6, device=last.device)
    return (last[:, None] * 7 + slots[:, None] * 3 + bonus[:, None] * 5 + i) % 10


@pytest.mark.triton
@pytest.mark.skipif(not triton_runs(), reason="needs Triton (GPU or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("seed", range(16))
def test_the_bookkeeping_kernels_equal_the_torch_statement(seed: int) -> None:
    """Random steps (by seed: verify runs of K drafts each, of up to K, no drafts at all (the
    decode graph's width 0), or up to K beside an empty run and a mid-prompt chunk; drafts whose
    samples confirm a random prefix; plain runs, chunks, lagging runs, graph padding): the two
    launches of ``kernels.verify_rows`` leave the rows, the rejected counts, the history commits
    and the next drafts exactly as ``Verifier._run``'s torch statement does."""
    rng = np.random.default_rng(seed)
    k, slots_n, width = 4, 6, 30
    mode = seed % 4
    n = int(rng.integers(2 if mode == 3 else 1, slots_n + 1))
    drafts = [
        [k] * n,
        rng.integers(0, k + 1, n).tolist(),
        [0] * n,
        rng.integers(0, k + 1, n).tolist(),
    ][mode]
    rows = torch.from_numpy(rng.integers(0, 10, (slots_n + 1, width))).int()
    rejected = torch.from_numpy(rng.integers(0, k + 1, slots_n + 1))
    slots = rng.permutation(slots_n)[:n].tolist()
    lag = rng.integers(0, 2, n).tolist()
    run_lens = [1 + d if d or rng.random() < 0.6 else int(rng.integers(2, 5)) for d in drafts]
    true = rng.integers(0, width - 2 * k - 2, n).tolist()  # the next drafts fit the row
    start = [t + lg * int(rejected[s]) for t, lg, s in zip(true, lag, slots, strict=True)]
    final = [bool(rng.random() < 0.85) for _ in slots]
    if mode == 3:  # run 0 empty (its sample -1), run 1 a chunk that samples nothing kept
        drafts[:2], run_lens[:2], final[:2] = [0, 0], [0, 3], [True, False]
    batch = StepBatch(None, slots, run_lens, start, drafts=drafts, final=final, lag=lag)
    samples = []
    for b, d in enumerate(drafts):  # a random prefix of the row's drafts confirmed, then one
        row = rows[slots[b]].tolist()  # refused and the later ones matched or not at random
        agree = int(rng.integers(0, d + 1))
        for i in range(d):
            guess = row[true[b] + 1 + i]
            later = guess if rng.random() < 0.5 else int(rng.integers(0, 10))
            samples.append(guess if i < agree else (guess + 1) % 10 if i == agree else later)
        samples.append(int(rng.integers(0, 10)) if run_lens[b] else -1)
    size = n + int(rng.integers(0, 3))  # graph padding past the batch
    width_ = max(drafts)
    x = Verifier(slots_n, k, _propose, None, None, torch.device("cpu"))._inputs(batch, size, width_)
    pad = torch.tensor(samples + [0] * ((size - n) * (1 + width_)), dtype=torch.int64)
    results = []
    for kernels in (False, True):
        dev = torch.device(kernel_device() if kernels else "cpu")
        table = SimpleNamespace(tokens=rows.clone().to(dev))
        table.write = SlotTable.write.__get__(table)
        hasher = _Commits()
        v = Verifier(slots_n, k, _propose, table, hasher, dev)
        v.rejected.copy_(rejected)
        run = v._run_kernels if kernels else v._run
        out = run(x.to(dev), pad.to(dev), width_)
        results.append(
            (
                out[:n].cpu(),
                table.tokens[:slots_n].cpu(),
                v.rejected[:slots_n].cpu(),
                sorted(hasher.made),
            )
        )
    (d0, r0, j0, c0), (d1, r1, j1, c1) = results
    assert torch.equal(d0, d1) and torch.equal(r0, r1) and torch.equal(j0, j1) and c0 == c1
    assert c0 or not any(d and f for d, f in zip(drafts, final, strict=True))
