"""The GQA family: grouped-query attention with RoPE over a paged K/V cache, a SwiGLU MLP or a
softmax-routed MoE, inside the shared Engram + lagged-mHC skeleton. Any pipeline cut is legal;
no draft stages; weights in bf16 or fp32."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from engramrt.config import ModelConfig, shared_config
from engramrt.model.family import ModelFamily
from engramrt.models.gqa.attention import GQAAttention, kv_head_span
from engramrt.models.gqa.cache import GQACache
from engramrt.models.gqa.config import GQAConfig, gqa_config, shared_widths
from engramrt.models.gqa.ffn import GQAMLP, GQAMoE
from engramrt.tensor_parallel import TensorParallel


class GQA(ModelFamily):
    name = "gqa"

    def config(self, raw: Mapping[str, Any]) -> ModelConfig:
        return shared_config(raw, self, gqa_config(raw), **shared_widths(raw))

    def layer(
        self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, tp: TensorParallel
    ) -> tuple[nn.Module, nn.Module]:
        g: GQAConfig = cfg.body
        d = cfg.hidden_size
        attn = GQAAttention(cfg, layer_id, dtype, tp)
        if g.ffn_type == "moe":
            ffn: nn.Module = GQAMoE(
                d,
                g.moe_intermediate_size,
                g.n_routed_experts,
                g.num_experts_per_tok,
                g.n_shared_experts,
                g.norm_topk_prob,
                dtype,
                tp,
            )
        else:
            ffn = GQAMLP(d, g.intermediate_size, dtype, tp)
        return attn, ffn

    def check_tensor_parallel(self, cfg: ModelConfig, tp: TensorParallel) -> None:
        """Query heads, KV heads (or their replicas) and FFN features, as ``layer`` splits
        them."""
        g: GQAConfig = cfg.body
        tp.span(g.num_heads, "num_attention_heads")
        kv_head_span(g.num_kv_heads, tp)
        inter = g.moe_intermediate_size if g.ffn_type == "moe" else g.intermediate_size
        tp.span(inter, "the FFN's intermediate size")

    def new_cache(self, model, num_blocks, block_size, max_len, num_slots, snapshots, slack):
        device = next(model.parameters()).device
        return GQACache(
            model.layer_ids,
            num_blocks,
            block_size,
            model.kv_heads,
            model.cfg.body.head_dim,
            model.dtype,
            device,
            max_len,
            num_slots,
        )

    def block_bytes(self, model, layers: list[int], block_size: int) -> int:
        """K and V of one block in ``layers``."""
        row = model.kv_heads * model.cfg.body.head_dim * model.dtype.itemsize
        return block_size * row * 2 * len(layers)

    def decode_read_bytes(self, model, context: int) -> int:
        return self.block_bytes(model, model.layer_ids, context)

    def capture_limit(self, model, max_tokens: int) -> int | None:
        if model.cfg.body.ffn_type == "moe":
            print("engramrt: MoE routing is not graph-capturable yet; decoding eagerly", flush=True)
            return None
        return max_tokens
