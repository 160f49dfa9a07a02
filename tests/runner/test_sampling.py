"""Sampler: greedy at temperature 0, nucleus set by top-p, frequencies follow the softmax; rows
of logits that are not finite are flagged."""

from __future__ import annotations

import math

import pytest
import torch

from engramrt.runner.batch import NewRequest, SampleRow, StepBatch
from engramrt.runner.sampler import Sampler, sample
from engramrt.runner.slots import SlotTable


def test_greedy_is_argmax() -> None:
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    assert torch.equal(sample(logits, 0.0, 1.0, None), logits.argmax(-1))


def test_top_p_keeps_the_smallest_nucleus() -> None:
    """probs 0.5/0.3/0.2: top_p 0.5 keeps only the first, 0.8 the first two (boundary
    excluded: the cumulative mass before a token must be < top_p for it to stay)."""
    logits = torch.tensor([[0.5, 0.3, 0.2]]).log().repeat(2000, 1)
    gen = torch.Generator().manual_seed(1)
    assert set(sample(logits, 1.0, 0.5, gen).tolist()) == {0}
    assert set(sample(logits, 1.0, 0.8, gen).tolist()) == {0, 1}
    assert set(sample(logits, 1.0, 0.81, gen).tolist()) == {0, 1, 2}


def test_frequencies_follow_temperature_softmax() -> None:
    logits = torch.tensor([[1.0, 0.0, -1.0]])
    gen = torch.Generator().manual_seed(2)
    draws = sample(logits.repeat(20000, 1), 2.0, 1.0, gen)
    freq = torch.bincount(draws, minlength=3).float() / draws.numel()
    torch.testing.assert_close(freq, torch.softmax(logits[0] / 2.0, -1), atol=0.015, rtol=0)


@pytest.mark.parametrize(("t", "p"), [(-0.5, 1.0), (1.0, 0.0), (1.0, 1.5)])
def test_invalid_parameters(t: float, p: float) -> None:
    with pytest.raises(ValueError):
        sample(torch.zeros(1, 3), t, p, None)


def test_rows_that_are_not_finite_are_flagged_with_the_tokens() -> None:
    """Each sample's flag says whether its logits were finite before any mask: NaN and +inf
    rows are flagged whether the row samples greedily or not, a NaN past the tokenizer (where
    the mask puts -inf) is not, and an empty run samples nothing and is not; every token drawn
    lies inside the tokenizer, NaN rows' too."""
    vocab, limit = 40, 32
    sampler = Sampler(SlotTable(torch.device("cpu"), None, True), token_limit=limit)
    rows = [SampleRow(), SampleRow(temperature=1.0), SampleRow(), SampleRow(), SampleRow()]
    admitted = [NewRequest(s, [5], 1, 0, sampling=r) for s, r in enumerate(rows)]
    batch = StepBatch([5] * 4, [0, 1, 2, 3, 4], [1, 1, 1, 0, 1], [0] * 5, admitted=admitted)
    sampler.slots.admit(batch.admitted, vocab)
    logits = torch.randn(5, vocab, generator=torch.Generator().manual_seed(0))
    logits[0, limit + 3] = math.nan  # past the tokenizer: masked, never sampled
    logits[1] = math.nan
    logits[2, 7] = math.inf
    logits[4, :limit] = math.nan
    result = sampler(logits, batch)
    assert result.finite == [True, False, False, True, False]
    assert result.tokens[3] == -1
    assert all(0 <= t < limit for i, t in enumerate(result.tokens) if i != 3)
