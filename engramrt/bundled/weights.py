"""Weights of the bundled tiny model: generated from a fixed seed on first use, then cached as a
normal HF-style directory so they load through the same path as any checkpoint.

Scales are chosen so that every part matters: Engram tables and values of order one next to a
unit-RMS stream (the update is a visible fraction of the stream, see the README), hc mixes near
an even collapse and an identity-leaning comb, and the usual 1/sqrt(fan-in) for projections.
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch

from engramrt.config import ModelConfig, load_json, model_config
from engramrt.engram.table import EngramTable, quantize_rows
from engramrt.model.checkpoint import save_checkpoint
from engramrt.model.decoder import EngramMHCModel

SEED = 10007
RECIPE_VERSION = 1  # bump when the initialisation below changes


def cache_root() -> Path:
    return Path(os.environ.get("ENGRAMRT_CACHE", Path.home() / ".cache" / "engramrt"))


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


def generate(model_dir: Path, out_dir: Path) -> None:
    """Write config, tokenizer and seeded weights (fp8 Engram tables, bf16 rest) to ``out_dir``."""
    raw = load_json(model_dir)
    save_checkpoint(seeded_model(model_config(raw)), out_dir, raw, tokenizer_dir=model_dir)


def materialize(model_dir: Path) -> Path:
    """The cached directory with weights for the bundled ``model_dir``; generated if absent."""
    digest = hashlib.sha256(f"{SEED}:{RECIPE_VERSION}".encode())
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        digest.update((model_dir / name).read_bytes())
    target = cache_root() / f"{model_dir.name}-{digest.hexdigest()[:12]}"
    if (target / "model.safetensors").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        generate(model_dir, tmp)
        os.replace(tmp, target)  # atomic; a concurrent first use simply loses the race
    except OSError:
        if not (target / "model.safetensors").is_file():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target
