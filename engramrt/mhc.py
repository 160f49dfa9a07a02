"""Manifold-constrained hyper-connections: hc parallel residual copies, mixed around
every sublayer by a Sinkhorn-normalised matrix. All mixing math runs in fp32."""

from __future__ import annotations

import torch

from engramrt.kernels import use_triton


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
    if use_triton(mixes.device) and hc & (hc - 1) == 0:
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
