"""Random-weight models with DeepSeek-V4.1's Engram and mHC shapes, scaled down, for measuring
the GPU path: about 1B and 4B parameters (hc 4, Engram at two layers, 24 hash columns of 256,
Engram tables of a few GB in fp8 + e8m0), on the bundled tokenizer; and a small 8-layer one for
checking every pipeline partition.

    python benchmarks/make_models.py --preset 1b --out /tmp/m1b [--device cuda]

Weights are drawn on ``--device`` (fast on a GPU) with the bundled model's scales, then written
as a sharded HF-style checkpoint that ``engramrt`` loads like any other.
"""

from __future__ import annotations

import argparse
import copy
import math
from pathlib import Path

import torch

from engramrt.bundled import DEFAULT_MODEL_DIR
from engramrt.bundled.weights import _init
from engramrt.config import engram_config, load_json, model_config
from engramrt.engram.layout import search_primes
from engramrt.engram.table import EngramTable
from engramrt.model.checkpoint import save_checkpoint
from engramrt.model.decoder import EngramMHCModel

PRESETS = {  # hidden, layers, heads, kv heads, ffn, engram layers, prime search start
    "tiny": (64, 3, 4, 2, 128, [0, 2], 128),
    "pp8": (512, 8, 8, 2, 1408, [1, 5], 40_000),  # small, for checking every 2-stage partition
    "1b": (2048, 16, 16, 4, 5632, [1, 8], 320_000),
    "4b": (3072, 36, 24, 8, 8192, [1, 14], 600_000),
}


def preset_config(name: str) -> dict:
    hidden, layers, heads, kv, ffn, engram_layers, start = PRESETS[name]
    raw = copy.deepcopy(load_json(DEFAULT_MODEL_DIR))
    text = raw["text_config"]
    text.update(
        hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=kv, head_dim=hidden // heads, intermediate_size=ffn,
        engram_layer_ids=engram_layers, engram_head_dim=256 if name != "tiny" else 32,
        engram_vocab_size=start, max_position_embeddings=8192 if name != "tiny" else 256,
        engram_num_embeddings=[0] * len(engram_layers),
    )  # fmt: skip
    primes = search_primes(engram_config(raw))
    text["engram_num_embeddings"] = [sum(map(sum, layer)) for layer in primes]
    return raw


def random_model(raw: dict, device: str, seed: int = 0) -> EngramMHCModel:
    cfg = model_config(raw)
    with torch.device("meta"):
        model = EngramMHCModel(cfg, torch.bfloat16)
    gen = torch.Generator(device=device).manual_seed(seed)
    state = {}
    for name, t in model.state_dict().items():
        if ".engram.embed." in name:
            continue
        if name.endswith(("norm.weight", "_scale", "_base")):  # small: the bundled recipe
            value = _init(name, t.shape, cfg.hc_mult, torch.Generator().manual_seed(seed))
        else:
            if name.endswith(("embed.weight", "q_weight", "k_weight")):
                std = 1.0
            elif name.endswith("_fn"):
                std = 0.02
            else:  # a linear layer [out, in]
                std = 1 / math.sqrt(t.shape[-1])
            value = torch.randn(t.shape, generator=gen, device=device) * std
        state[name] = value.float() if ".hc_" in name else value.to(torch.bfloat16)
    model.load_state_dict(state, strict=False, assign=True)
    for i in model.engram_layer_ids:
        rows, dim = cfg.engram.num_embeddings[cfg.engram.layer_ids.index(i)], cfg.engram.head_dim
        # random e4m3 bytes of magnitude ~1 (exponents 6..8, any mantissa, either sign) and
        # scales near 2**0: the same distribution as the bundled model's quantised normals
        byte = torch.randint(0x30, 0x48, (rows, dim), generator=gen, device=device,
                             dtype=torch.uint8)  # fmt: skip
        sign = torch.randint(0, 2, (rows, dim), generator=gen, device=device, dtype=torch.uint8)
        weight = (byte | (sign << 7)).view(torch.float8_e4m3fn)
        scale = torch.full((rows, dim // 32), 127, dtype=torch.uint8, device=device)
        model.layers[str(i)].engram.embed = EngramTable(weight, scale.view(torch.float8_e8m0fnu))
    return model.eval()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS), required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--max-shard-bytes", type=int, default=4 * 2**30)
    args = ap.parse_args()
    raw = preset_config(args.preset)
    model = random_model(raw, args.device)
    params = sum(t.numel() for t in model.state_dict().values() if t.element_size() > 1)
    tables = sum(t.numel() * t.element_size() for n, t in model.state_dict().items()
                 if ".engram.embed." in n)  # fmt: skip
    save_checkpoint(model, Path(args.out), raw, DEFAULT_MODEL_DIR, args.max_shard_bytes)
    print(
        f"{args.preset}: {params / 1e9:.2f} B dense parameters, Engram tables "
        f"{tables / 2**30:.2f} GiB -> {args.out}"
    )


if __name__ == "__main__":
    main()
