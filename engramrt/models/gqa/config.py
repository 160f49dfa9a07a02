"""The GQA family's own config fields: grouped-query attention with RoPE, a SwiGLU MLP or a
softmax-routed MoE (the fast test fixture and the 1B/4B presets)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from engramrt.config import ConfigError, get_field, int_field
from engramrt.config_base import text_config

FFN_TYPES = ("dense", "moe")


@dataclass(frozen=True)
class GQAConfig:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    ffn_type: str  # "dense" or "moe"
    intermediate_size: int = 0
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True


def gqa_config(raw: Mapping[str, Any]) -> GQAConfig:
    """Read and validate the fields; every failure names the offending field."""
    cfg = text_config(raw)
    ffn = cfg.get("ffn_type")
    if ffn not in FFN_TYPES:
        raise ConfigError(f"ffn_type must be one of {list(FFN_TYPES)}, got {ffn!r}")
    moe = ffn == "moe"
    out = GQAConfig(
        num_heads=int_field(cfg, "num_attention_heads", "n_heads"),
        num_kv_heads=int_field(cfg, "num_key_value_heads"),
        head_dim=int_field(cfg, "head_dim"),
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        ffn_type=ffn,
        intermediate_size=int_field(cfg, "intermediate_size") if not moe else 0,
        n_routed_experts=int_field(cfg, "n_routed_experts") if moe else 0,
        num_experts_per_tok=int_field(cfg, "num_experts_per_tok") if moe else 0,
        n_shared_experts=int(cfg.get("n_shared_experts", 0)) if moe else 0,
        moe_intermediate_size=int_field(cfg, "moe_intermediate_size") if moe else 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
    )
    if out.num_heads % out.num_kv_heads:
        raise ConfigError(
            f"num_attention_heads ({out.num_heads}) must be a multiple of num_key_value_heads "
            f"({out.num_kv_heads})"
        )
    if out.head_dim % 2:
        raise ConfigError(f"head_dim must be even for rotary embeddings, got {out.head_dim}")
    if moe and not 0 < out.num_experts_per_tok <= out.n_routed_experts:
        raise ConfigError(
            f"num_experts_per_tok must lie in [1, n_routed_experts={out.n_routed_experts}], "
            f"got {out.num_experts_per_tok}"
        )
    return out


def shared_widths(raw: Mapping[str, Any]) -> dict[str, Any]:
    """The skeleton's widths in this family's spelling (``engramrt.config.shared_config``)."""
    cfg = text_config(raw)
    return {
        "hidden_size": int_field(cfg, "hidden_size", "dim"),
        "num_layers": int_field(cfg, "num_hidden_layers", "n_layers"),
        "rms_norm_eps": float(get_field(cfg, "rms_norm_eps", "norm_eps")),
        "max_position_embeddings": int_field(cfg, "max_position_embeddings"),
    }
