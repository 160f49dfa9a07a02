"""DeepSeek-V4.1's MoE, as its reference computes it (``../shared/V41-ARCH.md`` 2): the torch
path, on weights kept in their stored formats (routed experts FP4, the shared expert FP8) and
dequantised per use.

- Router: logits of the fp32 input against the gate weight (fp32), scores ``sqrt(softplus)``;
  experts chosen by score + bias (the image-span bias for image tokens where the checkpoint has
  one), no groups; equal values choose the lower expert id (a stable sort: the reference leaves
  ties to ``topk``). Weights: the chosen raw scores (no bias), normalised (+1e-20) when more
  than one is chosen, times ``route_scale``.
- Expert: SwiGLU, the up branch clamped to [-limit, limit], the gate branch from above; the
  routing weight multiplies before the down projection; every linear quantises its input first
  (``quant.quantized_linear``).
- The output: each chosen expert's bf16 output added in fp32 in ascending expert id, then the
  shared expert's, then cast to the input's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engramrt.model.quant import StoredLinear
from engramrt.tensor_parallel import SINGLE, TensorParallel
from engramrt.v41_config import V41Config


class Expert(nn.Module):
    """``span``: the intermediate features a tensor-parallel rank holds (w1/w3 rows, w2
    columns); its output is then a partial sum."""

    def __init__(
        self, dim: int, inter: int, fp4: bool, limit: float, span: tuple[int, int] | None = None
    ):
        super().__init__()
        self.w1 = StoredLinear(inter, dim, fp4, rows=span)
        self.w2 = StoredLinear(dim, inter, fp4, cols=span)
        self.w3 = StoredLinear(inter, dim, fp4, rows=span)
        self.limit = limit

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        gate = self.w1(x).float().clamp(max=self.limit)
        up = self.w3(x).float().clamp(-self.limit, self.limit)
        h = F.silu(gate) * up
        if weight is not None:
            h = weight * h
        return self.w2(h.to(x.dtype))


class Gate(nn.Module):
    """The router's weight (kept fp32: the reference routes on fp32 inputs) and its selection
    bias, under the checkpoint's names (``ffn.gate.weight``, ``ffn.gate.bias``)."""

    def __init__(self, cfg: V41Config, image_bias: bool = False):
        super().__init__()
        e = cfg.n_routed_experts
        self.weight = nn.Parameter(torch.zeros(e, cfg.dim), requires_grad=False)
        self.register_buffer("bias", torch.zeros(e))
        self.register_buffer("bias_vl", torch.zeros(e) if image_bias else None)


class V41MoE(nn.Module):
    """With tensor parallelism every rank routes (the gate is replicated) and holds a slice of
    every expert's features, the shared one's too; the fp32 sum is all-reduced once."""

    def __init__(self, cfg: V41Config, image_bias: bool = False, tp: TensorParallel = SINGLE):
        super().__init__()
        self.k, self.route_scale, self.tp = cfg.n_activated_experts, cfg.route_scale, tp
        self.gate = Gate(cfg, image_bias)
        span = None if tp.size == 1 else tp.span(cfg.moe_inter_dim, "moe_intermediate_size")
        self.experts = nn.ModuleList(
            Expert(cfg.dim, cfg.moe_inter_dim, True, cfg.swiglu_limit, span)
            for _ in range(cfg.n_routed_experts)
        )
        self.shared_experts = Expert(cfg.dim, cfg.moe_inter_dim, False, cfg.swiglu_limit, span)

    def route(
        self, x: torch.Tensor, image: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[T, k]`` fp32, expert ids ``[T, k]``) of each token."""
        gate = self.gate
        scores = F.softplus(F.linear(x.float(), gate.weight.float())).sqrt()
        bias = gate.bias
        if image is not None and gate.bias_vl is not None:
            bias = torch.where(image.unsqueeze(-1), gate.bias_vl, bias)
        ids = torch.sort(scores + bias, dim=-1, descending=True, stable=True).indices[:, : self.k]
        weights = scores.gather(1, ids)
        if self.k > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return weights * self.route_scale, ids

    def forward(self, x: torch.Tensor, image: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[T, dim]``; ``image`` ``[T]`` bool (image-span tokens) or None."""
        weights, ids = self.route(x, image)
        y = torch.zeros_like(x, dtype=torch.float32)
        for e in torch.unique(ids).tolist():  # ascending expert id
            rows, slot = torch.where(ids == e)
            y[rows] += self.experts[e](x[rows], weights[rows, slot, None])
        y += self.shared_experts(x)
        return self.tp.all_reduce(y).to(x.dtype)
