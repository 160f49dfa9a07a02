"""Seeded random weights for any config: the starting point of the bundled model's training
(``engramrt.bundled.train``) and the models of tests and benchmarks.

Scales are chosen so that every part matters: Engram tables and values of order one next to a
unit-RMS stream (the update is a visible fraction of the stream, see the README), hc mixes near
an even collapse and an identity-leaning comb, and the usual 1/sqrt(fan-in) for projections.
"""

from __future__ import annotations

import math

import torch

from engramrt.config import ModelConfig
from engramrt.engram.table import EngramTable, quantize_rows
from engramrt.model.decoder import EngramMHCModel

SEED = 10007


def _init(name: str, shape: torch.Size, hc: int, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    if name.endswith("_scale"):
        return torch.full(shape, 0.1)
    if name.endswith("_base"):  # pre -> 1/hc each, post -> 1, comb logits -> identity-leaning
        base = torch.zeros(shape)
        base[:hc] = math.log(1 / (hc - 1))
        base[2 * hc :] = 4.0 * torch.eye(hc).flatten()
        return base
    if name.endswith("_fn"):
        return torch.randn(shape, generator=gen) * 0.02
    if name == "embed.weight" or name.endswith("engram.embed.weight"):
        return torch.randn(shape, generator=gen)
    if name.endswith(("q_weight", "k_weight")):
        return torch.randn(shape, generator=gen)
    return torch.randn(shape, generator=gen) * shape[-1] ** -0.5  # linear [out, in]


def seeded_model(
    cfg: ModelConfig, seed: int = SEED, dtype: torch.dtype = torch.bfloat16, fp8_tables: bool = True
) -> EngramMHCModel:
    """A model with deterministic random weights (hc parameters fp32, Engram tables fp8 + e8m0
    scales or plain ``dtype``)."""
    with torch.device("meta"):
        skeleton = EngramMHCModel(cfg, torch.float32)
    gen = torch.Generator().manual_seed(seed)
    model = EngramMHCModel(cfg, dtype)
    state = {}
    for name, t in sorted(skeleton.state_dict().items()):
        value = _init(name, t.shape, cfg.hc_mult, gen)
        state[name] = value if ".hc_" in name else value.to(dtype)
    for i in model.engram_layer_ids:
        table = state.pop(f"layers.{i}.engram.embed.weight")
        args = quantize_rows(table.float()) if fp8_tables else (table,)
        model.layers[str(i)].engram.embed = EngramTable(*args)
    model.load_state_dict(state, strict=False)
    return model.eval()
