"""Seeded random weights for any config: the starting point of the bundled model's training
(``engramrt.bundled.train``) and the models of tests and benchmarks.

Scales are chosen so that every part matters: Engram tables and values of order one next to a
unit-RMS stream (the update is a visible fraction of the stream: docs/models/bundled.md), hc
mixes near an even collapse and an identity-leaning comb, and the usual 1/sqrt(fan-in) for
projections.
"""

from __future__ import annotations

import math

import torch

from engramrt.config import ModelConfig
from engramrt.engram.table import EngramTable, quantize_rows
from engramrt.model.checkpoint import _dequantise_at_load
from engramrt.model.decoder import EngramMHCModel
from engramrt.models import model_config

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


def kept_fp32(name: str) -> bool:
    """A V4.1 tensor stored in fp32 (hc mixes, attention sinks, routing biases, the vision
    tower's norms); the rest of the unquantised ones are bf16."""
    vision_norm = name.startswith("vision.") and name.endswith(("norm1.weight", "norm2.weight"))
    return (
        ".hc_" in name
        or name.endswith(("attn_sink", "gate.bias", "gate.bias_vl", "vision.norm.weight"))
        or vision_norm
    )


def seeded_v41_state(raw: dict, device: str = "cpu", seed: int = 0) -> dict[str, torch.Tensor]:
    """Every tensor of a V4.1 preset but the Engram tables, in the released formats: FP8 dense
    linears (``wo_a`` and the Engram's ``wkv`` too) with E8M0 block scales, FP4 experts, bf16
    router, head, compressor and indexer projections, fp32 biases, sinks and mixes; the DSpark
    stages' (``mtp.*``) too."""
    cfg = model_config(raw)
    with torch.device("meta"):
        model = EngramMHCModel(cfg, torch.bfloat16, dspark=bool(cfg.family.draft_stages(cfg)))
    meta = model.state_dict()
    gen = torch.Generator(device=device).manual_seed(seed)
    cpu_gen = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in meta.items():
        if ".engram.embed." in name or name.endswith(".scale"):
            continue  # tables: ``write_tables``; scales: with their weights
        scale_name = name.removesuffix(".weight") + ".scale"
        fp8 = t.dtype == torch.float8_e4m3fn or name.endswith(("wo_a.weight", "engram.wkv.weight"))
        if fp8 or t.dtype == torch.int8:
            shape = (t.shape[0], t.shape[1] * (2 if t.dtype == torch.int8 else 1))
            w = torch.randn(shape, generator=gen, device=device) * shape[1] ** -0.5
            pair = cfg.family.stored_weight(w, fp4=not fp8)
            state[name], state[scale_name] = (x.cpu() for x in pair)
            continue
        if name.endswith(("norm.weight", "_scale", "_base", "_fn")):
            value = _init(name, t.shape, cfg.hc_mult, cpu_gen)
        elif name.endswith(("attn_sink", "gate.bias", "gate.bias_vl")):
            value = torch.randn(t.shape, generator=cpu_gen) * (0.5 if "sink" in name else 0.01)
        elif name.endswith(("embed.weight", "q_weight", "k_weight")):
            value = torch.randn(t.shape, generator=gen, device=device)
        else:  # a linear layer [out, in]
            value = torch.randn(t.shape, generator=gen, device=device) * t.shape[-1] ** -0.5
        state[name] = value.cpu().float() if kept_fp32(name) else value.cpu().to(torch.bfloat16)
    return state


def seeded_v41_model(raw: dict, seed: int = SEED) -> EngramMHCModel:
    """A V4.1 model to train (``engramrt.bundled.train``): ``seeded_v41_state``'s weights in fp32,
    every FP8/FP4 linear with a trainable master (``StoredLinear.make_trainable``), the Engram
    tables fp32 normals (quantised when saved)."""
    cfg = model_config(raw)
    model = EngramMHCModel(cfg, torch.float32, dspark=bool(cfg.family.draft_stages(cfg)))
    state = seeded_v41_state(raw, "cpu", seed)
    held = model.state_dict()
    for scale in [n for n in state if n.endswith(".scale") and n not in held]:  # held dequantised
        _dequantise_at_load(state, scale)
    gen = torch.Generator().manual_seed(seed + 1)
    for k, i in enumerate(model.engram_layer_ids):
        rows = (cfg.engram.num_embeddings[k], cfg.engram.head_dim)
        model.layers[str(i)].engram.embed = EngramTable(torch.randn(rows, generator=gen))
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected or any(".engram.embed." not in n for n in missing):
        raise ValueError(f"seeded V4.1 state: missing {missing}, unexpected {unexpected}")
    for m in cfg.family.stored_linears(model):
        m.make_trainable()
    return model
