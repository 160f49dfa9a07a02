"""The configuration every model family shares, read from a HF-style ``config.json``: the
Engram's fields and the skeleton's (vocabulary, widths, mHC). A family's own fields are its
``body`` (``engramrt.models``).

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


def get_field(cfg: Mapping[str, Any], name: str, *aliases: str) -> Any:
    for key in (name, *aliases):
        if key in cfg:
            return cfg[key]
    raise ConfigError(f"config field {name!r} is missing")


def _int_list(cfg: Mapping[str, Any], name: str) -> tuple[int, ...]:
    value = get_field(cfg, name)
    if isinstance(value, int):
        value = [value]
    if not isinstance(value, list | tuple) or not all(isinstance(v, int) for v in value):
        raise ConfigError(f"config field {name!r} must be a list of integers, got {value!r}")
    return tuple(value)


def int_field(cfg: Mapping[str, Any], name: str, *aliases: str) -> int:
    value = get_field(cfg, name, *aliases)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"config field {name!r} must be an integer, got {value!r}")
    return value


def engram_config(raw: Mapping[str, Any]) -> EngramConfig:
    """Read and validate the Engram fields; every failure names the offending field."""
    cfg = text_config(raw)
    eps = float(get_field(cfg, "rms_norm_eps", "norm_eps"))
    image = cfg.get("image_token_id")
    out = EngramConfig(
        layer_ids=_int_list(cfg, "engram_layer_ids"),
        num_embeddings=_int_list(cfg, "engram_num_embeddings"),
        max_ngram_size=int_field(cfg, "engram_max_ngram_size"),
        n_heads=int_field(cfg, "engram_n_heads"),
        head_dim=int_field(cfg, "engram_head_dim"),
        vocab_size=int_field(cfg, "engram_vocab_size"),
        pad_token_id=int_field(cfg, "engram_pad_token_id", "engram_pad_id"),
        compressed_vocab_size=int_field(cfg, "engram_compressed_vocab_size"),
        hidden_size=int_field(cfg, "hidden_size", "dim"),
        hc_mult=int_field(cfg, "hc_mult"),
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


@dataclass(frozen=True)
class ModelConfig:
    """What every model family shares. ``body`` holds the family's own fields and ``family``
    its code: the face the engine, runner and commands see (``engramrt.model.family``); both
    come from the registry (``engramrt.models.model_config``), built only for configs that
    engramrt can run exactly."""

    family: Any  # an ``engramrt.model.family.ModelFamily`` (that layer imports this one)
    body: Any
    vocab_size: int
    hidden_size: int
    num_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    engram: EngramConfig
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    torch_dtype: str = "bfloat16"
    notes: tuple[str, ...] = ()  # what the config said that is read as something else

    @property
    def hc_mix_dim(self) -> int:
        return (2 + self.hc_mult) * self.hc_mult


def shared_config(
    raw: Mapping[str, Any],
    family: Any,
    body: Any,
    hidden_size: int,
    num_layers: int,
    rms_norm_eps: float,
    max_position_embeddings: int,
) -> ModelConfig:
    """The shared fields around a family's ``body``; a family gives the widths it read in its
    own spelling."""
    cfg = text_config(raw)
    eos = cfg.get("eos_token_id")
    torch_dtype, notes = _dtype(cfg)
    out = ModelConfig(
        family=family,
        body=body,
        vocab_size=int_field(cfg, "vocab_size"),
        hidden_size=hidden_size,
        num_layers=num_layers,
        rms_norm_eps=rms_norm_eps,
        max_position_embeddings=max_position_embeddings,
        hc_mult=int_field(cfg, "hc_mult"),
        hc_sinkhorn_iters=int_field(cfg, "hc_sinkhorn_iters"),
        hc_eps=float(get_field(cfg, "hc_eps")),
        engram=engram_config(raw),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=eos[0] if isinstance(eos, list) else eos,
        torch_dtype=torch_dtype,
        notes=notes,
    )
    _validate_model(out)
    _check_token_ids(cfg, out.vocab_size)
    return out


COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
# dtypes a quantised checkpoint may declare for its stored weights; engramrt computes in bfloat16
STORAGE_DTYPES = ("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")


def _dtype(cfg: Mapping[str, Any]) -> tuple[str, tuple[str, ...]]:
    """``torch_dtype`` (newer transformers write ``dtype``): a compute dtype as it is, a storage
    dtype read as bfloat16 with a note saying so, anything else an error naming the field."""
    name = "torch_dtype" if "torch_dtype" in cfg or "dtype" not in cfg else "dtype"
    value = cfg.get(name, "bfloat16")
    if value in COMPUTE_DTYPES:
        return value, ()
    if value in STORAGE_DTYPES:
        return "bfloat16", (f"config field {name!r} is {value!r}, a storage dtype: using bfloat16",)
    raise ConfigError(
        f"config field {name!r} must be one of {list(COMPUTE_DTYPES + STORAGE_DTYPES)}, "
        f"got {value!r}"
    )


def _check_token_ids(cfg: Mapping[str, Any], vocab_size: int) -> None:
    """``eos_token_id`` (an id or a list of ids) and ``bos_token_id`` name tokens of the model's
    vocabulary: an id past it could never be sampled, so generation would never stop on it."""
    for name in ("bos_token_id", "eos_token_id"):
        value = cfg.get(name)
        for token in value if isinstance(value, list) else [value]:
            if token is None:
                continue
            if not isinstance(token, int) or isinstance(token, bool):
                raise ConfigError(f"config field {name!r} must be an integer, got {value!r}")
            if not 0 <= token < vocab_size:
                raise ConfigError(
                    f"config field {name!r} is {token}, outside the vocabulary "
                    f"[0, {vocab_size}) (vocab_size)"
                )


def _validate_model(c: ModelConfig) -> None:
    if max(c.engram.layer_ids) >= c.num_layers:
        raise ConfigError(
            f"engram_layer_ids {list(c.engram.layer_ids)} must be < num_hidden_layers "
            f"({c.num_layers})"
        )
    if c.engram.hidden_size != c.hidden_size or c.engram.hc_mult != c.hc_mult:
        raise ConfigError("hidden_size/hc_mult disagree between the model and its Engram")
    if c.hc_sinkhorn_iters < 1:
        raise ConfigError(f"hc_sinkhorn_iters must be >= 1, got {c.hc_sinkhorn_iters}")
