"""Engram core: layout, compressed token map, hashing + history, tables and the gated module."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer

from engramrt.config import engram_config, load_json
from engramrt.engram.hashing import EngramHasher
from engramrt.engram.history import NgramHistory
from engramrt.engram.layout import EngramLayout
from engramrt.engram.module import Engram, engram_gate, gate_from_dot
from engramrt.engram.table import EngramTable, dequantize_rows, shard_row_range
from engramrt.engram.token_map import build_token_map, load_tokenizer


def load_hasher(
    model_dir: str | Path,
    num_slots: int = 1,
    device: torch.device | str = "cpu",
    mm_pad_start: int | None = None,
) -> tuple[EngramHasher, Tokenizer]:
    """Layout, token map and history for a HF-style model directory."""
    cfg = engram_config(load_json(model_dir))
    tokenizer = load_tokenizer(model_dir)
    token_map = build_token_map(tokenizer, cfg.compressed_vocab_size)
    hasher = EngramHasher(EngramLayout.from_config(cfg), token_map, num_slots, device, mm_pad_start)
    return hasher, tokenizer


__all__ = [
    "Engram",
    "EngramHasher",
    "EngramLayout",
    "EngramTable",
    "NgramHistory",
    "build_token_map",
    "dequantize_rows",
    "engram_gate",
    "gate_from_dot",
    "load_hasher",
    "load_tokenizer",
    "shard_row_range",
]
