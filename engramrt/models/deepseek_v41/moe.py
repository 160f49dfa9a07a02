"""DeepSeek-V4.1's MoE, as its reference computes it (restated in ``tests/model/test_v41_moe.py``):
the torch path, on weights kept in their stored formats (routed experts FP4, the shared expert
FP8) and dequantised per use.

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

On CUDA the router after its logits and the grouping of the (token, expert) pairs by expert are
Triton launches (``engramrt.kernels.moe_routing``) that give the torch ops' bits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engramrt.kernels import NORM_VALUES, use_triton
from engramrt.kernels.linear import linear
from engramrt.model.layers import take_rows
from engramrt.models.deepseek_v41 import quant
from engramrt.models.deepseek_v41.config import V41Config
from engramrt.models.deepseek_v41.quant import StoredLinear
from engramrt.tensor_parallel import SINGLE, TensorParallel


def clamped_swiglu(
    gate: torch.Tensor, up: torch.Tensor, limit: float, weight: torch.Tensor | None = None
) -> torch.Tensor:
    """``silu(gate) * up`` in fp32, the gate clamped from above and the up branch to
    [-limit, limit], times the routing weight when given."""
    h = F.silu(gate.float().clamp(max=limit)) * up.float().clamp(-limit, limit)
    return h if weight is None else weight * h


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
        h = clamped_swiglu(self.w1(x), self.w3(x), self.limit, weight)
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


def route_logits(
    logits: torch.Tensor,
    bias: torch.Tensor,
    k: int,
    route_scale: float,
    bias_vl: torch.Tensor | None = None,
    image: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights ``[T, k]`` fp32, expert ids ``[T, k]``) of the gate's fp32 logits ``[T, E]`` in
    torch: the reference's router off CUDA, and the routing kernel's oracle."""
    scores = F.softplus(logits).sqrt()
    if image is not None and bias_vl is not None:
        bias = torch.where(image.unsqueeze(-1), bias_vl, bias)
    ids = torch.sort(scores + bias, dim=-1, descending=True, stable=True).indices[:, :k]
    weights = scores.gather(1, ids)
    if k > 1:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * route_scale, ids


class ExpertPairs:
    """A step's (token, expert) pairs sorted by expert, stably (each expert's tokens ascending):
    ``order`` [T * k] the flat pair (``token * k + slot``) at each sorted row, ``counts`` [E]
    the rows of each expert, ``by_id`` [T, k] each token's rows in ascending expert id, and
    with ``tile_rows`` the grouped expert kernel's row tiles (``tiles``), all on the device (no
    sync). On CUDA one Triton launch builds them without a sort (``moe_routing.expert_rows``);
    elsewhere torch sorts, the kernel's oracle."""

    def __init__(self, ids: torch.Tensor, experts: int, tile_rows: int | None = None):
        self.shape = ids.shape
        if use_triton(ids.device):
            from engramrt.kernels.moe_routing import expert_rows

            r = expert_rows(ids, experts, tile_rows)
            self.order, self.counts, self.by_id, self.tiles = r.order, r.counts, r.by_id, r.tiles
            return
        sort = torch.sort(ids.flatten(), stable=True)
        self.order = sort.indices
        self.counts = torch.zeros(experts, dtype=torch.int64, device=ids.device)
        self.counts.scatter_add_(0, sort.values, torch.ones_like(sort.values))  # bincount syncs
        place = torch.empty_like(self.order)  # where each pair's row went in the sort
        place[self.order] = torch.arange(len(place), device=ids.device)
        self.by_id = place.view(self.shape).gather(1, ids.argsort(dim=1, stable=True))
        self.tiles = None
        if tile_rows is not None:
            from engramrt.kernels.stored_linear import group_tiles

            self.tiles = group_tiles(self.counts, len(self.order), tile_rows)

    def combine(self, out: torch.Tensor) -> torch.Tensor:
        """Sorted rows' outputs [T * k, D] as each token's fp32 sum over its experts in
        ascending id (the order the reference adds them in)."""
        y = torch.zeros(self.shape[0], out.shape[-1], dtype=torch.float32, device=out.device)
        for j in range(self.shape[1]):
            y = y + take_rows(out, self.by_id[:, j])
        return y


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
        self.stack: tuple[torch.Tensor, ...] | None = None  # ``_stacked``
        self.routes_images = image_bias  # the block passes the step's image-span mask
        # the norm before makes the experts' codes and values and the router's fp32 row
        self.norm_inputs = NORM_VALUES

    def _grouped(
        self,
        x: torch.Tensor,
        weights: torch.Tensor,
        ids: torch.Tensor,
        inputs=None,
    ) -> torch.Tensor:
        """The experts as ``Expert.forward`` computes them, without a host sync, in five
        launches: the routed experts' gate/up projection grouped over the (token, expert) pairs
        sorted by expert (``x`` quantised once for every expert), the shared expert's; one
        launch of the SwiGLU, routing weight and the down projections' quantisation for both;
        the routed down projection grouped; the shared one, whose epilogue adds each token's
        routed outputs in ascending expert id and then its own (the torch path's order). Out:
        fp32 sums (``x``'s dtype on one rank: the sums rounded once). ``inputs``: ``x``'s codes
        and values from the norm's launch."""
        from engramrt.kernels.moe_epilogues import swiglu_codes
        from engramrt.kernels.stored_linear import (
            Added,
            Codes,
            group_tile_rows,
            grouped_stored_linear,
            stored_linear,
        )

        w13, s13, w2, s2, shared13, shared_s13 = self._stacked()
        q = quant.shared_input(x, inputs, values=True)  # codes: shared expert; values: routed
        experts = len(self.experts)
        pairs = ExpertPairs(ids, experts, group_tile_rows(ids.numel(), experts))
        (tokens, k), shared, limit = ids.shape, self.shared_experts, self.shared_experts.limit
        p = tokens * k  # the routed rows, then the shared expert's
        h = torch.empty(p + tokens, w13.shape[1], dtype=x.dtype, device=x.device)
        grouped_stored_linear(q, w13, s13, True, pairs.tiles, pairs.order, k, top_k=k, out=h[:p])
        stored_linear(q, shared13, shared_s13, False, out=h[p:])
        codes, scale, values = swiglu_codes(h, limit, weights, pairs.order, True, weighted=p)
        h = Codes(codes[:p], scale[:p], x.dtype, values[:p])
        routed = grouped_stored_linear(h, w2, s2, True, pairs.tiles, None, k)
        # one rank's sums are the output: stored in x's dtype (ranks add theirs in fp32)
        y = torch.empty(
            x.shape, dtype=x.dtype if self.tp.size == 1 else torch.float32, device=x.device
        )
        h = Codes(codes[p:], scale[p:], x.dtype)
        return stored_linear(
            h, shared.w2.weight, shared.w2.scale, False, y, Added(routed, pairs.by_id)
        )

    def _looped(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The torch path: each routed expert over its tokens' rows (ascending, as ``_grouped``
        sorts them)."""
        pairs = ExpertPairs(ids, len(self.experts))
        counts = pairs.counts.tolist()
        xs = take_rows(x, pairs.order // ids.shape[1]).split(counts)
        ws = take_rows(weights.reshape(-1, 1), pairs.order).split(counts)
        outs = [self.experts[e](xs[e], ws[e]) for e, n in enumerate(counts) if n]
        return pairs.combine(torch.cat(outs) if outs else x.new_zeros(0, x.shape[-1]))

    def _stacked(self) -> tuple[torch.Tensor, ...]:
        """Every routed expert's weights in one tensor per kind (``w1`` above ``w3`` per
        expert, then ``w2``; FP4 bytes paired for the kernel), with their scales, and the
        shared expert's ``w1`` above its ``w3``; built at the first use on a device (the
        warm-up, at load), after which each expert's tensors are views of them (one copy in
        memory)."""
        if self.stack is None or self.stack[0].device != self.experts[0].w1.weight.device:
            ex, n = self.experts, self.experts[0].w1.weight.shape[0]
            s13 = torch.stack([torch.cat([e.w1.scale, e.w3.scale]) for e in ex])
            s2 = torch.stack([e.w2.scale for e in ex])
            for kind, scales in (("w1/w3", s13), ("w2", s2)):  # a sync each, not three an expert
                quant.check_fp4_scales(scales, f"the routed experts' {kind}")
            for e in ex:
                for m in (e.w1, e.w2, e.w3):
                    m.pair(checked=True)
            w13 = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in ex])
            w2 = torch.stack([e.w2.weight for e in ex])
            parts = [w13, s13, w2, s2]
            for i, e in enumerate(ex):
                e.w1.weight, e.w3.weight, e.w1.scale, e.w3.scale = (
                    w13[i, :n],
                    w13[i, n:],
                    s13[i, :n],
                    s13[i, n:],
                )
                e.w2.weight, e.w2.scale = w2[i], s2[i]
            parts += quant.stack_outputs(self.shared_experts.w1, self.shared_experts.w3)
            self.stack = tuple(parts)
        return self.stack

    def route(
        self, x: torch.Tensor, image: torch.Tensor | None = None, wide: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights ``[T, k]`` fp32, expert ids ``[T, k]``) of each token: the gate's fp32
        logits, then ``route_logits`` (on CUDA its kernel, ``moe_routing.route``: one launch, the
        same bits). ``wide``: ``x`` in fp32 already (the norm's launch made it)."""
        gate = self.gate
        logits = linear(x.float() if wide is None else wide, gate.weight.float())
        if use_triton(x.device):
            from engramrt.kernels.moe_routing import route as routed
        else:
            routed = route_logits
        return routed(logits, gate.bias, self.k, self.route_scale, gate.bias_vl, image)

    @property
    def grouped_tokens(self) -> int:
        """The most tokens a step of this layer is captured in a CUDA graph with (the sizes
        the start-up captures); larger steps run the same launches eagerly."""
        return len(self.experts) * quant.STORED_KERNEL_ROWS // self.k

    def warm_up(self, dtype: torch.dtype) -> None:
        """Compile the stored-format kernel's variants a step can meet (the row tile follows the
        rows an expert averages, and routing decides that while serving; the engine's warm-up
        steps repeat one token, so every token goes to the same experts): the grouped experts
        and the shared one at one token and at more than a small tile takes, and the router."""
        from engramrt.kernels.stored_linear import BM, LARGE_ROWS

        device = self.gate.weight.device
        if not use_triton(device):  # the torch path compiles nothing (and keeps FP4 unpaired)
            return
        many = max(LARGE_ROWS, BM * len(self.experts) // self.k) + 1
        for tokens in (1, many):
            x = torch.zeros(tokens, self.gate.weight.shape[1], dtype=dtype, device=device)
            ids = torch.arange(tokens * self.k, device=device).view(tokens, -1) % len(self.experts)
            weights = torch.ones(tokens, self.k, device=device)
            self._grouped(x, weights, ids)
            self.route(x)  # the router's launch (its variant the count's alone)

    def forward(
        self, x: torch.Tensor, image: torch.Tensor | None = None, inputs=None
    ) -> torch.Tensor:
        """``x`` ``[T, dim]``; ``image`` ``[T]`` bool (image-span tokens) or None; ``inputs``:
        ``x``'s codes, values and fp32 row from the norm's launch (``norm_inputs``)."""
        weights, ids = self.route(x, image, None if inputs is None else inputs.wide)
        # a GPU: grouped launches of any size (no host sync, graph-safe); the torch path loops
        if use_triton(x.device):
            y = self._grouped(x, weights, ids, inputs)
        else:
            y = self._looped(x, weights, ids) + self.shared_experts(x)
        return self.tp.all_reduce(y).to(x.dtype)
