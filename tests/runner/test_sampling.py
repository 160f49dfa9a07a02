"""Sampler: greedy at temperature 0, nucleus set by top-p, frequencies follow the softmax."""

from __future__ import annotations

import pytest
import torch

from engramrt.runner.sampler import sample


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
