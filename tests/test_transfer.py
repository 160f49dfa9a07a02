"""engramrt.transfer: the same values wherever a tensor goes; a tensor already on its device is
not copied; on a GPU the host source is pinned (checked with ``-m gpu``)."""

from __future__ import annotations

import pytest
import torch

from engramrt.transfer import pinned, to_device


def test_to_device_on_the_host_keeps_values_and_identity() -> None:
    t = torch.arange(10, dtype=torch.int64)
    out = to_device(t, "cpu")
    assert out is t and torch.equal(pinned(t), t)


@pytest.mark.gpu
def test_to_device_pins_and_copies_to_the_gpu() -> None:
    t = torch.randint(0, 1000, (4096,))
    out = to_device(t, "cuda")
    assert out.is_cuda and torch.equal(out.cpu(), t)
    assert to_device(out, "cuda") is out  # already there: no pin of a device tensor
    assert pinned(t).is_pinned() and torch.equal(pinned(t), t)
