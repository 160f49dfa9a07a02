"""Host tensors onto the GPU without waiting for the work queued there. Overlap scheduling
launches step N+1 while step N runs; a blocking copy, or a non-blocking one from pageable memory
(which the driver may stage by synchronising with the stream), would make the launch wait for
step N. A pinned source copies asynchronously, and PyTorch's caching host allocator keeps the
pinned block until the copy has run, so the source may go out of scope at once."""

from __future__ import annotations

import torch


def pinned(t: torch.Tensor) -> torch.Tensor:
    """``t`` in pinned memory where there is a GPU to copy it to (else ``t``)."""
    return t.pin_memory() if torch.cuda.is_available() else t


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``t`` on ``device``: from the host to a GPU asynchronously, otherwise as ``Tensor.to``
    (a tensor already there is returned as is)."""
    if t.device.type != "cpu" or torch.device(device).type != "cuda":
        return t.to(device)
    return pinned(t).to(device, non_blocking=True)
