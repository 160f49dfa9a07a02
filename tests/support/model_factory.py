"""Small seeded test models on the bundled tokenizer (compressed vocab 600)."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.bundled.weights import seeded_model
from engramrt.config import engram_config, load_json
from engramrt.engram.layout import search_primes
from engramrt.model.checkpoint import save_checkpoint
from engramrt.model.decoder import EngramMHCModel
from engramrt.models import model_config


def make_raw_config(**overrides) -> dict:
    """The bundled config, made smaller (hidden 64, tables of a few thousand rows) and
    overridable; engram_num_embeddings is recomputed from the primes."""
    raw = copy.deepcopy(load_json(GQA_MODEL_DIR))
    text = raw["text_config"]
    text.update(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=96,
        engram_head_dim=32,
        engram_vocab_size=128,
        max_position_embeddings=256,
    )
    text.update(overrides)
    text["engram_num_embeddings"] = [0] * len(text["engram_layer_ids"])
    primes = search_primes(engram_config(raw))
    text["engram_num_embeddings"] = [sum(map(sum, layer)) for layer in primes]
    return raw


def make_model(
    seed: int = 0, dtype: torch.dtype = torch.float32, fp8_tables: bool = False, **overrides
) -> tuple[EngramMHCModel, dict]:
    raw = make_raw_config(**overrides)
    return seeded_model(model_config(raw), seed, dtype, fp8_tables), raw


def save_model(model: EngramMHCModel, raw: dict, out: Path, **kw) -> Path:
    return save_checkpoint(model, out, raw, tokenizer_dir=GQA_MODEL_DIR, **kw)
