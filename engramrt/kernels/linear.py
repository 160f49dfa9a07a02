"""Every dense product of a model, in one place: torch's (cuBLAS) by default, or under
``--batch-invariant`` on a GPU the kernel whose rows do not depend on the step's other rows
(``dense_linear``). Torch only here (the kernel module, which needs Triton, is imported when
used)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engramrt.kernels import batch_invariant


def linear(x: torch.Tensor, weight: torch.Tensor, out_dtype: torch.dtype | None = None):
    """``x @ weight.T`` (``weight`` [N, K], or [G, N, K] applied per group of ``x [..., G,
    K]``), out in ``out_dtype`` (default ``x``'s): every dense product of a model. Under
    ``--batch-invariant`` on a GPU, the kernel whose rows do not depend on the step's other rows
    (``engramrt.kernels.dense_linear``); else torch's (cuBLAS)."""
    if batch_invariant(x.device):
        from engramrt.kernels.dense_linear import dense_linear

        return dense_linear(x, weight, out_dtype)
    if weight.dim() == 3:
        y = torch.einsum("...gk,gnk->...gn", x, weight)
    elif out_dtype is not None and x.is_cuda and out_dtype != x.dtype:
        return torch.mm(x.flatten(0, -2), weight.t(), out_dtype=out_dtype).unflatten(
            0, x.shape[:-1]
        )
    else:
        y = F.linear(x, weight)
    return y if out_dtype is None else y.to(out_dtype)


class Linear(nn.Linear):
    """``nn.Linear`` without bias through ``linear``."""

    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype | None = None):
        super().__init__(in_features, out_features, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)
