"""Speculative decoding's device half (``engramrt.runner.verify``): the n-gram lookup over the
token rows against the host's lookup (padded as the engine pads), and a lagging run moved back
on the device against the same run built from its true start."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engramrt.engine.speculative import SpecConfig
from engramrt.model.context import ForwardContext, GraphShape, KVCache
from engramrt.runner.verify import Verifier, ngram_drafts


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


@pytest.mark.parametrize("pad", [None, GraphShape(False, 4 * 5, 4, 4), GraphShape(True, 8, 8)])
def test_a_lagging_run_moves_back_to_its_true_start(pad) -> None:
    """Runs built from optimistic starts (every draft of the verify run before them counted
    as accepted), moved back on the device by the drafts their slots rejected, equal the runs
    built from their true starts: positions, cache rows, context lengths, starts; padding
    (a graph's) untouched."""
    rng = np.random.default_rng(1)
    kv = KVCache([0], 96, 4, 1, 8, torch.float32, "cpu", 48, 8)
    tables = kv.fixed_tables()
    n = pad.requests - 1 if pad is not None else 5
    run = 1 if pad is not None and pad.decode else 5
    slots = rng.permutation(8)[:n].tolist()
    true = rng.integers(0, 36, n).tolist()
    lag = rng.integers(0, 2, n).tolist()
    verifier = Verifier(8, 4, lambda *a: None, None, None, torch.device("cpu"))
    verifier.rejected[:8] = torch.from_numpy(rng.integers(0, 5, 8))
    rejected = verifier.rejected.tolist()
    start = [t + lg * rejected[s] for t, lg, s in zip(true, lag, slots, strict=True)]
    runs = [run] * n
    built = ForwardContext.for_runs(slots, runs, start, kv, tables, "cpu", 12, pad, lag=lag)
    verifier.shift(built)
    want = ForwardContext.for_runs(slots, runs, true, kv, tables, "cpu", 12, pad, lag=[0] * n)
    for name in ("positions", "slot_mapping", "context_lens", "start_pos_t", "flat"):
        if name == "flat":  # everything but the lag flags themselves
            built.lag.zero_()
        assert torch.equal(getattr(built, name), getattr(want, name)), name
    assert lag.count(1) and (built.slot_mapping == -1).any() == (pad is not None)
