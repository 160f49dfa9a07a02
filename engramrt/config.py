"""Model configuration read from a HF-style ``config.json``.

DeepSeek-V4.1 nests the language-model fields under ``text_config`` while smaller models keep
them flat; both are accepted so one loader serves released checkpoints and test models alike.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from engramrt.config_base import ConfigError, text_config
from engramrt.v41_config import V41Config, v41_config


@dataclass(frozen=True)
class EngramConfig:
    """The Engram fields of a model config."""

    layer_ids: tuple[int, ...]
    num_embeddings: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    vocab_size: int  # where the prime search starts; not a token vocabulary
    pad_token_id: int
    compressed_vocab_size: int
    hidden_size: int
    hc_mult: int
    rms_norm_eps: float
    image_token_id: int | None = None

    @property
    def n_hash_cols(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def num_layers(self) -> int:
        return len(self.layer_ids)


def _get(cfg: Mapping[str, Any], name: str, *aliases: str) -> Any:
    for key in (name, *aliases):
        if key in cfg:
            return cfg[key]
    raise ConfigError(f"config field {name!r} is missing")


def _int_list(cfg: Mapping[str, Any], name: str) -> tuple[int, ...]:
    value = _get(cfg, name)
    if isinstance(value, int):
        value = [value]
    if not isinstance(value, list | tuple) or not all(isinstance(v, int) for v in value):
        raise ConfigError(f"config field {name!r} must be a list of integers, got {value!r}")
    return tuple(value)


def _int(cfg: Mapping[str, Any], name: str, *aliases: str) -> int:
    value = _get(cfg, name, *aliases)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"config field {name!r} must be an integer, got {value!r}")
    return value


def engram_config(raw: Mapping[str, Any]) -> EngramConfig:
    """Read and validate the Engram fields; every failure names the offending field."""
    cfg = text_config(raw)
    eps = float(_get(cfg, "rms_norm_eps", "norm_eps"))
    image = cfg.get("image_token_id")
    out = EngramConfig(
        layer_ids=_int_list(cfg, "engram_layer_ids"),
        num_embeddings=_int_list(cfg, "engram_num_embeddings"),
        max_ngram_size=_int(cfg, "engram_max_ngram_size"),
        n_heads=_int(cfg, "engram_n_heads"),
        head_dim=_int(cfg, "engram_head_dim"),
        vocab_size=_int(cfg, "engram_vocab_size"),
        pad_token_id=_int(cfg, "engram_pad_token_id", "engram_pad_id"),
        compressed_vocab_size=_int(cfg, "engram_compressed_vocab_size"),
        hidden_size=_int(cfg, "hidden_size", "dim"),
        hc_mult=_int(cfg, "hc_mult"),
        rms_norm_eps=eps,
        image_token_id=None if image is None else int(image),
    )
    _validate(out)
    return out


def _validate(c: EngramConfig) -> None:
    if c.max_ngram_size < 2:
        raise ConfigError(f"engram_max_ngram_size must be >= 2, got {c.max_ngram_size}")
    if c.n_heads < 2:
        raise ConfigError(f"engram_n_heads must be >= 2, got {c.n_heads}")
    if not c.layer_ids:
        raise ConfigError("engram_layer_ids must not be empty")
    if any(b <= a for a, b in zip(c.layer_ids, c.layer_ids[1:], strict=False)):
        raise ConfigError(f"engram_layer_ids must be sorted and unique, got {list(c.layer_ids)}")
    if min(c.layer_ids) < 0:
        raise ConfigError(f"engram_layer_ids must be >= 0, got {list(c.layer_ids)}")
    if len(c.num_embeddings) != len(c.layer_ids):
        raise ConfigError(
            f"engram_num_embeddings has {len(c.num_embeddings)} entries but engram_layer_ids "
            f"has {len(c.layer_ids)}"
        )
    for attr, field in (
        ("head_dim", "engram_head_dim"),
        ("vocab_size", "engram_vocab_size"),
        ("compressed_vocab_size", "engram_compressed_vocab_size"),
        ("hidden_size", "hidden_size"),
        ("hc_mult", "hc_mult"),
    ):
        if getattr(c, attr) < 1:
            raise ConfigError(f"{field} must be >= 1, got {getattr(c, attr)}")
    if c.pad_token_id < 0:
        raise ConfigError(f"engram_pad_token_id must be >= 0, got {c.pad_token_id}")


def load_json(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found")
    try:
        with path.open() as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path} is not valid JSON: {exc}") from None


V41 = "v41"  # DeepSeek-V4.1's own attention (``engramrt.v41_config``)
ATTENTION_TYPES = ("gqa", V41)
FFN_TYPES = ("dense", "moe")


@dataclass(frozen=True)
class ModelConfig:
    """What the decoder needs; built only for configs engramrt can run exactly."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float
    rms_norm_eps: float
    max_position_embeddings: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    attention_type: str
    ffn_type: str
    engram: EngramConfig
    n_routed_experts: int = 0
    num_experts_per_tok: int = 0
    n_shared_experts: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    v41: V41Config | None = None  # V4.1's attention and MoE fields (attention_type "v41")

    @property
    def hc_mix_dim(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult


def model_config(raw: Mapping[str, Any]) -> ModelConfig:
    cfg = text_config(raw)
    attention = cfg.get("attention_type", V41 if "compress_ratios" in cfg else None)
    if attention not in ATTENTION_TYPES:
        raise ConfigError(
            f"attention_type must be one of {list(ATTENTION_TYPES)} (DeepSeek-V4.1's configs give "
            f"none and have compress_ratios), got {attention!r}"
        )
    if attention == V41:
        return _v41_model_config(raw, cfg)
    ffn = cfg.get("ffn_type")
    if ffn not in FFN_TYPES:
        raise ConfigError(f"ffn_type must be one of {list(FFN_TYPES)}, got {ffn!r}")
    eos = cfg.get("eos_token_id")
    out = ModelConfig(
        vocab_size=_int(cfg, "vocab_size"),
        hidden_size=_int(cfg, "hidden_size", "dim"),
        num_layers=_int(cfg, "num_hidden_layers", "n_layers"),
        num_heads=_int(cfg, "num_attention_heads", "n_heads"),
        num_kv_heads=_int(cfg, "num_key_value_heads"),
        head_dim=_int(cfg, "head_dim"),
        intermediate_size=_int(cfg, "intermediate_size") if ffn == "dense" else 0,
        rope_theta=float(cfg.get("rope_theta", 10000.0)),
        rms_norm_eps=float(_get(cfg, "rms_norm_eps", "norm_eps")),
        max_position_embeddings=_int(cfg, "max_position_embeddings"),
        hc_mult=_int(cfg, "hc_mult"),
        hc_sinkhorn_iters=_int(cfg, "hc_sinkhorn_iters"),
        hc_eps=float(_get(cfg, "hc_eps")),
        attention_type=attention,
        ffn_type=ffn,
        engram=engram_config(raw),
        n_routed_experts=_int(cfg, "n_routed_experts") if ffn == "moe" else 0,
        num_experts_per_tok=_int(cfg, "num_experts_per_tok") if ffn == "moe" else 0,
        n_shared_experts=int(cfg.get("n_shared_experts", 0)) if ffn == "moe" else 0,
        moe_intermediate_size=_int(cfg, "moe_intermediate_size") if ffn == "moe" else 0,
        norm_topk_prob=bool(cfg.get("norm_topk_prob", True)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        torch_dtype=str(cfg.get("torch_dtype", "bfloat16")),
    )
    _validate_model(out)
    return out


def _v41_model_config(raw: Mapping[str, Any], cfg: dict[str, Any]) -> ModelConfig:
    """A V4.1 config: its attention and MoE fields (``v41``, both spellings), the rest as for
    any model; one shared latent of ``head_dim`` is the KV (one KV head)."""
    v = v41_config(raw)
    eos = cfg.get("eos_token_id")
    out = ModelConfig(
        vocab_size=_int(cfg, "vocab_size"),
        hidden_size=v.dim,
        num_layers=v.n_layers,
        num_heads=v.n_heads,
        num_kv_heads=1,
        head_dim=v.head_dim,
        intermediate_size=0,
        rope_theta=v.rope_theta,
        rms_norm_eps=v.norm_eps,
        max_position_embeddings=_int(cfg, "max_position_embeddings", "max_seq_len"),
        hc_mult=_int(cfg, "hc_mult"),
        hc_sinkhorn_iters=_int(cfg, "hc_sinkhorn_iters"),
        hc_eps=float(_get(cfg, "hc_eps")),
        attention_type=V41,
        ffn_type="moe",
        engram=engram_config(raw),
        n_routed_experts=v.n_routed_experts,
        num_experts_per_tok=v.n_activated_experts,
        n_shared_experts=v.n_shared_experts,
        moe_intermediate_size=v.moe_inter_dim,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        torch_dtype=str(cfg.get("torch_dtype", "bfloat16")),
        v41=v,
    )
    _validate_model(out)
    if v.n_shared_experts != 1:
        raise ConfigError(f"n_shared_experts must be 1 for V4.1, got {v.n_shared_experts}")
    return out


def _validate_model(c: ModelConfig) -> None:
    if c.num_heads % c.num_kv_heads:
        raise ConfigError(
            f"num_attention_heads ({c.num_heads}) must be a multiple of num_key_value_heads "
            f"({c.num_kv_heads})"
        )
    if c.head_dim % 2:
        raise ConfigError(f"head_dim must be even for rotary embeddings, got {c.head_dim}")
    if max(c.engram.layer_ids) >= c.num_layers:
        raise ConfigError(
            f"engram_layer_ids {list(c.engram.layer_ids)} must be < num_hidden_layers "
            f"({c.num_layers})"
        )
    if c.engram.hidden_size != c.hidden_size or c.engram.hc_mult != c.hc_mult:
        raise ConfigError("hidden_size/hc_mult disagree between the model and its Engram")
    if c.ffn_type == "moe" and not 0 < c.num_experts_per_tok <= c.n_routed_experts:
        raise ConfigError(
            f"num_experts_per_tok must lie in [1, n_routed_experts={c.n_routed_experts}], "
            f"got {c.num_experts_per_tok}"
        )
    if c.hc_sinkhorn_iters < 1:
        raise ConfigError(f"hc_sinkhorn_iters must be >= 1, got {c.hc_sinkhorn_iters}")
