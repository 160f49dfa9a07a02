"""Manifold-constrained hyper-connections: hc parallel residual copies, mixed around
every sublayer by a Sinkhorn-normalised matrix. All mixing math runs in fp32.

The model calls three entry points: ``mhc_pre`` and ``mhc_post`` around each sublayer and
``collapse_norm`` before the head. Each is composed of the reference functions below and runs
them on the CPU; on CUDA (power-of-two hc) it runs the fused kernels of
``engramrt.kernels.mhc_fused`` instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch

from engramrt.kernels import use_triton
from engramrt.model.layers import rms_norm

if TYPE_CHECKING:  # the kernels need Triton; the CPU path never imports them
    from engramrt.kernels.mhc_fused import NormInputs


def hc_mixes(x: torch.Tensor, fn: torch.Tensor, eps: float) -> torch.Tensor:
    """``x [T, hc, D]``, ``fn [(2+hc)*hc, hc*D]`` -> ``[T, (2+hc)*hc]``; one rsqrt per token
    over all copies."""
    xf = x.float().flatten(1)
    r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (xf @ fn.float().t()) * r


def hc_split_sinkhorn(
    mixes: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    hc: int,
    iters: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Split mixes into ``pre [T, hc]``, ``post [T, hc]`` and ``comb [T, hc, hc]``.

    comb is a softmax (+eps) followed by one column normalisation and ``iters - 1`` row/column
    pairs, so its last step makes columns sum to one: comb[j][k] sends copy j into copy k.
    On CUDA one Triton launch does all of it (``engramrt.kernels.mhc_sinkhorn``).
    """
    if _fused(mixes.device, hc):
        from engramrt.kernels.mhc_sinkhorn import split_sinkhorn

        return split_sinkhorn(mixes, scale, base, hc, iters, eps)
    z = mixes.float()
    pre = torch.sigmoid(z[:, :hc] * scale[0] + base[:hc]) + eps
    post = 2 * torch.sigmoid(z[:, hc : 2 * hc] * scale[1] + base[hc : 2 * hc])
    logits = (z[:, 2 * hc :] * scale[2] + base[2 * hc :]).view(-1, hc, hc)
    e = torch.exp(logits - logits.amax(-1, keepdim=True))
    comb = e / e.sum(-1, keepdim=True) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return pre, post, comb


def hc_pre(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Collapse ``[T, hc, D]`` to ``[T, D]``: Σ_j w_j · x_j in fp32, summed in copy order,
    rounded once to x's dtype."""
    acc = weights[:, 0, None] * x[:, 0].float()
    for j in range(1, x.shape[1]):
        acc = acc + weights[:, j, None] * x[:, j].float()
    return acc.to(x.dtype)


def hc_post(
    y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """Expand a sublayer output ``y [T, D]`` back into the copies:
    out_k = post_k · y + Σ_j comb[j][k] · residual_j, rounded once."""
    mixed = torch.bmm(comb.transpose(1, 2), residual.float())
    return (post[..., None] * y.float()[:, None, :] + mixed).to(residual.dtype)


def first_pre(tokens: int, hc: int, device: torch.device | str) -> torch.Tensor:
    """The pre-mix the first layer's attention collapses with: one-hot copy 0."""
    pre = torch.zeros(tokens, hc, dtype=torch.float32, device=device)
    pre[:, 0] = 1.0
    return pre


def _fused(device: torch.device, hc: int) -> bool:
    return use_triton(device) and hc & (hc - 1) == 0


class PreMix(NamedTuple):
    """The pre side of one sublayer: its normalised input, its own ``post``/``comb``, the
    ``pre`` the next sublayer collapses with (lagged mHC), and the collapsed row before the
    norm when asked for (tracers)."""

    normed: torch.Tensor
    pre: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor
    collapsed: torch.Tensor | None
    # on a GPU, what the linears after the norm read, made in the norm's launch when the
    # sublayer asks; None: they quantise ``normed`` themselves
    inputs: NormInputs | None = None


def mhc_pre(
    x: torch.Tensor,
    pre_prev: torch.Tensor,
    fn: torch.Tensor,
    scale: torch.Tensor,
    base: torch.Tensor,
    norm_weight: torch.Tensor,
    hc: int,
    iters: int,
    hc_eps: float,
    norm_eps: float,
    keep_collapsed: bool = False,
    quant: int = 0,
) -> PreMix:
    """Split the mixes of ``x [T, hc, D]`` into (pre, post, comb), collapse ``x`` with the
    previous sublayer's ``pre_prev [T, hc]`` and RMS-normalise the rounded collapsed row.
    ``norm_eps`` is both the mixes' and the norm's eps (the model's rms_norm_eps). ``quant``
    (``kernels.NORM_CODES`` or ``NORM_VALUES``): on a GPU, the normed rows' ``inputs`` too."""
    if _fused(x.device, hc):
        from engramrt.kernels import mhc_fused

        return PreMix(
            *mhc_fused.mhc_pre(
                x,
                pre_prev,
                fn,
                scale,
                base,
                norm_weight,
                hc,
                iters,
                hc_eps,
                norm_eps,
                keep_collapsed,
                quant,
            )
        )
    mixes = hc_mixes(x, fn, norm_eps)
    pre, post, comb = hc_split_sinkhorn(mixes, scale, base, hc, iters, hc_eps)
    collapsed = hc_pre(x, pre_prev)
    normed = rms_norm(collapsed, norm_weight, norm_eps)
    return PreMix(normed, pre, post, comb, collapsed if keep_collapsed else None)


def mhc_post(
    y: torch.Tensor, residual: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """``hc_post``; on CUDA one launch."""
    if _fused(residual.device, residual.shape[1]):
        from engramrt.kernels import mhc_fused

        return mhc_fused.mhc_post(y, residual, post, comb)
    return hc_post(y, residual, post, comb)


def collapse_norm(
    x: torch.Tensor, pre: torch.Tensor, norm_weight: torch.Tensor, norm_eps: float
) -> torch.Tensor:
    """The last collapse and the final RMSNorm, before the head; on CUDA one launch."""
    if _fused(x.device, x.shape[1]):
        from engramrt.kernels import mhc_fused

        return mhc_fused.collapse_norm(x, pre, norm_weight, norm_eps)
    return rms_norm(hc_pre(x, pre), norm_weight, norm_eps)
