"""The decoder every family shares: the Engram + lagged-mHC skeleton around each layer's
attention and FFN, which its family supplies (``cfg.family``).

Every block does the same thing whatever fed it: its Engram first, if it owns one,
then attention collapsed with the pre-mix of the sublayer before it, then the FFN collapsed with
the attention's pre-mix. A pipeline stage only changes where ``(x, pre)`` come from and go to.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import nn

from engramrt.config import ModelConfig
from engramrt.engram import prefetch
from engramrt.engram.module import Engram
from engramrt.engram.table import EngramTable
from engramrt.kernels.linear import linear
from engramrt.model.context import ForwardContext
from engramrt.model.layers import RMSNorm
from engramrt.model.mhc import PreMix, collapse_norm, first_pre, mhc_post, mhc_pre
from engramrt.tensor_parallel import SINGLE, TensorParallel


def _hc_params(cfg: ModelConfig) -> tuple[nn.Parameter, nn.Parameter, nn.Parameter]:
    """One sublayer's mixing parameters (fn, base, scale), kept in fp32."""
    mix = cfg.hc_mix_dim
    return (
        nn.Parameter(torch.zeros(mix, cfg.hc_mult * cfg.hidden_size)),
        nn.Parameter(torch.zeros(mix)),
        nn.Parameter(torch.ones(3)),
    )


class Block(nn.Module):
    def __init__(
        self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, tp: TensorParallel = SINGLE
    ):
        super().__init__()
        self.layer_id = layer_id
        e = cfg.engram
        self.engram: Engram | None = None
        if layer_id in e.layer_ids:
            self.engram = Engram(e, e.layer_ids.index(layer_id), dtype=dtype, tp=tp)
            lo, hi = self.engram.row_span  # the rows this rank holds, until a checkpoint loads
            rows = torch.zeros(hi - lo, e.head_dim, dtype=dtype)
            self.engram.embed = EngramTable(rows, row_start=lo)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # the draft stages (past the backbone) keep the target features of these layers
        self.dspark_target = False
        self.attn, self.ffn = cfg.family.layer(cfg, layer_id, dtype, tp)
        self.hc_attn_fn, self.hc_attn_base, self.hc_attn_scale = _hc_params(cfg)
        self.hc_ffn_fn, self.hc_ffn_base, self.hc_ffn_scale = _hc_params(cfg)
        self.hc, self.iters, self.hc_eps = cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps
        self.norm_eps = cfg.rms_norm_eps
        self.engram_enabled = True  # False: the ablation of ``EngramMHCModel.disable_engram``

    def _pre(
        self,
        x: torch.Tensor,
        pre_prev: torch.Tensor,
        fn: torch.Tensor,
        scale: torch.Tensor,
        base: torch.Tensor,
        norm: RMSNorm,
        sublayer: nn.Module,
        keep_collapsed: bool = False,
    ) -> PreMix:
        return mhc_pre(
            x,
            pre_prev,
            fn,
            scale,
            base,
            norm.weight,
            self.hc,
            self.iters,
            self.hc_eps,
            self.norm_eps,
            keep_collapsed,
            getattr(sublayer, "norm_inputs", 0),
        )

    @staticmethod
    def _run(sublayer: nn.Module, a: PreMix, *args) -> torch.Tensor:
        """The sublayer on its normed input, with the ``inputs`` its norm's launch made for
        it when it asked (``norm_inputs``: what its linears read, quantised once there)."""
        if a.inputs is None:
            return sublayer(a.normed, *args)
        return sublayer(a.normed, *args, inputs=a.inputs)

    def forward(
        self, x: torch.Tensor, pre: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [T, hc, D]`` and the lagged ``pre [T, hc]`` in; the same pair out."""
        if self.engram is not None and self.engram_enabled:
            ids = ctx.engram_inputs(self.layer_id, self.engram.layer_index)
            ctx.trace("engram_in", self.layer_id, x)
            x = self.engram(x, ids, ctx.dead, prefetch.take(ctx, self.layer_id))
            ctx.trace("engram_out", self.layer_id, x)
            ctx.engram_ran.append(self.layer_id)
        if self.dspark_target:  # DSpark's feature: the copies' mean at this layer's input
            ctx.step_cache.setdefault("features", {})[self.layer_id] = x.mean(1)
        # attention collapses with the previous sublayer's pre, the FFN with attention's
        a = self._pre(
            x,
            pre,
            self.hc_attn_fn,
            self.hc_attn_scale,
            self.hc_attn_base,
            self.attn_norm,
            self.attn,
            keep_collapsed=ctx.tracer is not None,
        )
        if a.collapsed is not None:
            ctx.trace("attn_collapse_in", self.layer_id, a.collapsed)
        x = mhc_post(self._run(self.attn, a, ctx), x, a.post, a.comb)
        f = self._pre(
            x, a.pre, self.hc_ffn_fn, self.hc_ffn_scale, self.hc_ffn_base, self.ffn_norm, self.ffn
        )
        routed = (ctx.dead,) if getattr(self.ffn, "routes_images", False) else ()
        x = mhc_post(self._run(self.ffn, f, *routed), x, f.post, f.comb)
        return x, f.pre


class EngramMHCModel(nn.Module):
    """Holds layers ``layer_ids`` (all by default); the embedding and the head live only where
    the first and the last layer do, which is what a pipeline stage needs. ``tp``: this rank's
    place in its stage's tensor-parallel group; it holds a slice of the vocabulary (embedding
    rows and head rows) and of each layer (their ``shards``)."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.bfloat16,
        layer_ids: list[int] | None = None,
        tp: TensorParallel = SINGLE,
        dspark: bool = False,
    ):
        """``dspark``: with V4.1's DSpark stages (``mtp.*``, on the stage holding the last
        layer), whose target layers keep their features each step."""
        super().__init__()
        self.cfg, self.dtype, self.tp = cfg, dtype, tp
        ids = list(range(cfg.num_layers)) if layer_ids is None else list(layer_ids)
        cfg.family.check_stage(cfg, ids)
        self.layer_ids = ids
        v0, v1, _ = tp.padded_span(cfg.vocab_size)
        self.vocab_start = v0
        d, last = cfg.hidden_size, cfg.num_layers - 1 in ids
        # DSpark embeds its draft blocks with the same table, on the last stage
        self.embed = nn.Embedding(v1 - v0, d, dtype=dtype) if 0 in ids or dspark else None
        if 0 in ids:
            cfg.family.attach_images(self, dtype)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, dtype, tp) for i in ids})
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype) if last else None
        head_dtype = cfg.family.head_dtype(dtype)
        self.head = nn.Linear(d, v1 - v0, bias=False, dtype=head_dtype) if last else None
        self.shards = {}
        if tp.size > 1:
            self.shards = {
                f"{n}.weight": (0, v0, v1)
                for n in ("embed", "head")
                if getattr(self, n) is not None
            }
        self.mtp: nn.ModuleList | None = None
        if dspark:
            self.mtp = dspark_stages(cfg, ids, dtype, tp)
            for i in cfg.family.draft_targets(cfg):
                self.layers[str(i)].dspark_target = True

    def held_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor a state dict holds, named by module, as held in memory: no state-dict
        hook runs (saving rebuilds the checkpoint's order of FP4 bytes paired on a GPU: copies
        that counting bytes must not make)."""
        for prefix, module in self.named_modules():
            prefix = f"{prefix}." if prefix else ""
            yield from ((prefix + n, p) for n, p in module.named_parameters(recurse=False))
            for n, b in module.named_buffers(recurse=False):
                if n not in module._non_persistent_buffers_set:
                    yield prefix + n, b

    def checkpoint_slices(self) -> dict[str, tuple[int, int, int]]:
        """Checkpoint tensor -> ``(dim, lo, hi)``: the slice of it this rank holds (tensors not
        named are whole)."""
        out = {}
        for prefix, module in self.named_modules():
            for name, where in getattr(module, "shards", {}).items():
                out[f"{prefix}.{name}" if prefix else name] = where
        return out

    @property
    def cache_layer_ids(self) -> list[int]:
        """The layers whose caches this stage holds: its own and its DSpark stages'."""
        stages = self.cfg.family.draft_stages(self.cfg) if self.mtp is not None else []
        return self.layer_ids + stages

    @property
    def kv_heads(self) -> int:
        """KV heads per layer on this rank: its KV cache's width."""
        return next(iter(self.layers.values())).attn.kv_heads

    @property
    def engram_layer_ids(self) -> list[int]:
        return [i for i in self.layer_ids if i in self.cfg.engram.layer_ids]

    engram_enabled = True

    def disable_engram(self, disabled: bool = True) -> None:
        """The ablation ``--engram off`` asks for on purpose: every Engram layer skipped (the
        residual passes through), and the fail-closed check expects none to run; ``False``
        turns them back on (a benchmark's A/B)."""
        self.engram_enabled = not disabled
        for block in self.layers.values():
            block.engram_enabled = not disabled

    def embed_tokens(
        self, tokens: torch.Tensor, images: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream ``[T, hc, D]`` (the embedding in every copy) and the first pre-mix. Under
        tensor parallelism each rank embeds the tokens of its vocabulary slice and -0.0 for the
        others (the additive identity), so the all-reduce rebuilds each row bit for bit.
        ``images``: (``[T]`` each token's row of ``[N, D]`` image-span rows, or -1; the rows),
        which replace those tokens' embeddings (``ForwardContext.images``)."""
        if self.tp.solo:
            x = self.embed(tokens)
        else:
            local = tokens - self.vocab_start
            owned = (local >= 0) & (local < self.embed.num_embeddings)
            x = self.embed(torch.where(owned, local, 0)).masked_fill(~owned[:, None], -0.0)
            x = self.tp.all_reduce(x)
        if images is not None:
            at, rows = images
            x = torch.where((at >= 0)[:, None], rows[at.clamp(min=0)], x)
        hc = self.cfg.hc_mult
        return x[:, None, :].expand(-1, hc, -1).contiguous(), first_pre(len(tokens), hc, x.device)

    def forward_layers(
        self, x: torch.Tensor, pre: torch.Tensor, ctx: ForwardContext
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Run this model's layers, then fail closed if an Engram layer among them did not run."""
        ran_before = len(ctx.engram_ran)
        for block in self.layers.values():
            x, pre = block(x, pre, ctx)
        expected = self.engram_layer_ids if self.engram_enabled else []
        missing = sorted(set(expected) - set(ctx.engram_ran[ran_before:]))
        if missing:
            raise RuntimeError(f"Engram layers {missing} did not run in this forward")
        return x, pre

    def logits(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """Collapse with the last FFN pre-mix, normalise, project; fp32 logits."""
        return self.project(collapse_norm(x, pre, self.norm.weight, self.norm.eps))

    def project(self, y: torch.Tensor) -> torch.Tensor:
        """fp32 logits of normalised hidden states (every rank's vocabulary slice)."""
        return self.tp.gather(head_logits(y, self.head.weight), self.cfg.vocab_size)

    def forward(self, tokens: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        ctx.step_cache.clear()  # this step's alone (``StageRunner.forward`` does the same)
        x, pre = self.embed_tokens(tokens, ctx.images)
        return self.logits(*self.forward_layers(x, pre, ctx))


def dspark_stages(
    cfg: ModelConfig, layer_ids: list[int], dtype: torch.dtype, tp: TensorParallel
) -> nn.ModuleList:
    """The draft stages, on the stage that holds the last layer (``check_drafting``)."""
    cfg.family.check_drafting(cfg, layer_ids)
    stages = nn.ModuleList()
    for s, layer in enumerate(cfg.family.draft_stages(cfg)):
        block = Block(cfg, layer, dtype, tp)
        cfg.family.finish_draft_stage(block, cfg, s, dtype)
        stages.append(block)
    return stages


def head_logits(y: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 logits without an fp32 copy of the head each step (DeepSeek's 129k x 5120 head would
    be 2.6 GB of conversion a step): on CUDA a bf16 GEMM with fp32 output (cuBLAS accumulates in
    fp32 either way); CPUs have no such GEMM, so they multiply in fp32."""
    if weight.dtype == torch.float32:
        return linear(y.float(), weight)
    if y.is_cuda:
        return linear(y, weight, torch.float32)
    return linear(y.float(), weight.float())
