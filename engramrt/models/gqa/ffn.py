"""The GQA family's FFNs: a SwiGLU MLP and a softmax-routed top-k MoE with shared experts."""

from __future__ import annotations

import torch
from torch import nn

from engramrt.model.layers import StackedLinear, silu_mul
from engramrt.tensor_parallel import SINGLE, TensorParallel


class GQAMLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x), with w1 and w3 stacked. With tensor parallelism a rank
    holds a slice of the features (``shards``), and its partial output is all-reduced unless
    ``reduce`` is False (an MoE reduces its experts' sum once)."""

    def __init__(
        self,
        dim: int,
        inter: int,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
        reduce: bool = True,
    ):
        super().__init__()
        lo, hi = tp.span(inter, "the FFN's intermediate size")
        self.tp = tp if reduce else SINGLE
        self.w13 = StackedLinear(self, "w13", dim, {"w1": hi - lo, "w3": hi - lo}, dtype)
        self.w2 = nn.Linear(hi - lo, dim, bias=False, dtype=dtype)
        self.shards = (
            {}
            if tp.size == 1
            else {
                "w1.weight": (0, lo, hi),
                "w3.weight": (0, lo, hi),
                "w2.weight": (1, lo, hi),
            }
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.w2(silu_mul(self.w13(x))))


class GQAMoE(nn.Module):
    """Softmax router, top-k experts (weights renormalised when asked), plus shared experts.
    With tensor parallelism every rank routes (the router is replicated) and holds a slice of
    every expert's features; the weighted sum is all-reduced once, in fp32."""

    def __init__(
        self,
        dim: int,
        inter: int,
        n_experts: int,
        top_k: int,
        n_shared: int,
        norm_topk: bool,
        dtype: torch.dtype,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        self.top_k, self.norm_topk, self.tp = top_k, norm_topk, tp
        self.gate = nn.Linear(dim, n_experts, bias=False, dtype=dtype)
        self.experts = nn.ModuleList(GQAMLP(dim, inter, dtype, tp, False) for _ in range(n_experts))
        self.shared_experts = GQAMLP(dim, inter * n_shared, dtype, tp, False) if n_shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores = self.gate(x).float().softmax(-1)
        weights, chosen = scores.topk(self.top_k, dim=-1)
        if self.norm_topk:
            weights = weights / weights.sum(-1, keepdim=True)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for e, expert in enumerate(self.experts):
            token, slot = torch.nonzero(chosen == e, as_tuple=True)
            if token.numel():
                out.index_add_(0, token, expert(x[token]).float() * weights[token, slot, None])
        if self.shared_experts is not None:
            out = out + self.shared_experts(x).float()
        return self.tp.all_reduce(out).to(x.dtype)
