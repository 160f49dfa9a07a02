"""Random-weight models with DeepSeek-V4.1's Engram and mHC shapes, scaled down, for measuring
the GPU path: about 1B and 4B parameters (hc 4, Engram at two layers, 24 hash columns of 256,
Engram tables of a few GB in fp8 + e8m0), on the bundled tokenizer; a small 8-layer one for
checking every pipeline partition; and ``4b-bigtables``, the 4B model with ~64 GiB of tables,
more than an H200 can hold beside a useful KV cache (for host-memory tables). The ``v41-*``
presets have DeepSeek-V4.1's own attention and MoE, written in its released formats (FP8 dense
linears with 32 x 32 E8M0 scales, FP4 experts, bf16 router, head and compressors):
``v41-small`` (six layers, one of each role in Flash's order, small widths, selection sizes
below its test prompts, YaRN active) and ``v41-wide`` (Flash's widths, six layers, 16 experts).

    python benchmarks/make_models.py --preset 1b --out /tmp/m1b [--device cuda]

Weights are drawn on ``--device`` (fast on a GPU) with the bundled model's scales, then written
as a sharded HF-style checkpoint that ``engramrt`` loads like any other. The tables are written
to their own file a chunk of rows at a time, as they are drawn: never whole in memory.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import struct
from pathlib import Path

import torch
from safetensors import safe_open

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.bundled.v41_presets import V41_PRESETS, v41_preset_config
from engramrt.bundled.weights import _init, seeded_v41_state
from engramrt.config import engram_config, load_json
from engramrt.engram.layout import search_primes
from engramrt.model.checkpoint import INDEX, save_state
from engramrt.model.decoder import EngramMHCModel
from engramrt.models import model_config

PRESETS = {  # hidden, layers, heads, kv heads, ffn, engram layers, prime search start
    "tiny": (64, 3, 4, 2, 128, [0, 2], 128),
    "pp8": (512, 8, 8, 2, 1408, [1, 5], 40_000),  # small, for checking every 2-stage partition
    "1b": (2048, 16, 16, 4, 5632, [1, 8], 320_000),
    "4b": (3072, 36, 24, 8, 8192, [1, 14], 600_000),
    "4b-bigtables": (3072, 36, 24, 8, 8192, [1, 14], 5_400_000),
}
TABLES_FILE = "engram-tables.safetensors"
CHUNK_ROWS = 1 << 18


def preset_config(name: str) -> dict:
    if name in V41_PRESETS:
        return v41_preset_config(name)
    hidden, layers, heads, kv, ffn, engram_layers, start = PRESETS[name]
    raw = copy.deepcopy(load_json(GQA_MODEL_DIR))
    text = raw["text_config"]
    text.update(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=hidden // heads,
        intermediate_size=ffn,
        engram_layer_ids=engram_layers,
        engram_head_dim=256 if name != "tiny" else 32,
        engram_vocab_size=start,
        max_position_embeddings=8192 if name != "tiny" else 256,
        engram_num_embeddings=[0] * len(engram_layers),
    )
    primes = search_primes(engram_config(raw))
    text["engram_num_embeddings"] = [sum(map(sum, layer)) for layer in primes]
    return raw


def random_model(raw: dict, device: str, seed: int = 0) -> EngramMHCModel:
    """Every weight but the Engram tables (``write_tables`` draws those)."""
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
        model.layers[str(i)].engram.embed = None  # drawn and written by ``write_tables``
    return model.eval()


def table_rows(rows: int, dim: int, seed: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 bytes of magnitude ~1 (exponents 6..8, any mantissa, either sign) and
    scales of 2**0: the distribution of the bundled model's quantised normals."""
    gen = torch.Generator(device=device).manual_seed(seed)
    byte = torch.randint(0x30, 0x48, (rows, dim), generator=gen, device=device, dtype=torch.uint8)
    sign = torch.randint(0, 2, (rows, dim), generator=gen, device=device, dtype=torch.uint8)
    scale = torch.full((rows, dim // 32), 127, dtype=torch.uint8, device=device)
    return byte | (sign << 7), scale


def write_tables(raw: dict, path: Path, device: str, seed: int = 0) -> dict[str, list]:
    """Every Engram table of ``raw``'s model, drawn ``CHUNK_ROWS`` rows at a time and written
    straight to safetensors file ``path`` (header first: the shapes are known). The tensors
    written, with their shapes."""
    cfg = model_config(raw)
    entries, offset = {}, 0
    for k, i in enumerate(cfg.engram.layer_ids):
        rows, dim = cfg.engram.num_embeddings[k], cfg.engram.head_dim
        for part, dtype, cols in (("weight", "F8_E4M3", dim), ("scale", "F8_E8M0", dim // 32)):
            end = offset + rows * cols
            entries[f"layers.{i}.engram.embed.{part}"] = {
                "dtype": dtype,
                "shape": [rows, cols],
                "data_offsets": [offset, end],
            }
            offset = end
    header = json.dumps(entries).encode()
    header += b" " * (-len(header) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        for k in range(len(cfg.engram.layer_ids)):
            rows, dim = cfg.engram.num_embeddings[k], cfg.engram.head_dim
            scales = []
            for n, lo in enumerate(range(0, rows, CHUNK_ROWS)):
                w, sc = table_rows(min(CHUNK_ROWS, rows - lo), dim, seed + 7919 * k + n, device)
                f.write(w.cpu().numpy().tobytes())
                scales.append(sc.cpu())
            f.write(torch.cat(scales).numpy().tobytes())  # 1/32 of the weight: small enough
    return {name: e["shape"] for name, e in entries.items()}


def write_model(raw: dict, out: Path, device: str, max_shard_bytes: int) -> tuple[int, int]:
    """The whole checkpoint: the dense weights through ``save_checkpoint``, the tables
    streamed to their own file, one index over both. (dense parameters, table bytes)"""
    if model_config(raw).family.stored_formats:  # V4.1: its released formats
        state = seeded_v41_state(raw, device)
    else:
        model = random_model(raw, device)
        state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        del model
    params = sum(
        t.numel() * (2 if t.dtype == torch.int8 else 1)
        for n, t in state.items()
        if not n.endswith(".scale")
    )
    save_state(state, out, raw, GQA_MODEL_DIR, max_shard_bytes)
    del state
    tables = write_tables(raw, out / TABLES_FILE, device)
    index_path = out / INDEX
    if index_path.is_file():
        index = json.loads(index_path.read_text())
    else:  # one dense file: an index that names it
        with safe_open(out / "model.safetensors", framework="pt") as st:
            index = {"metadata": {}, "weight_map": dict.fromkeys(st.keys(), "model.safetensors")}
    index["weight_map"].update(dict.fromkeys(tables, TABLES_FILE))
    index_path.write_text(json.dumps(index, indent=1))
    return params, sum(math.prod(shape) for shape in tables.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--preset",
        choices=sorted([*PRESETS, *V41_PRESETS]),
        required=True,
        help="the model: tiny, pp8 (8 layers, for every 2-stage partition), 1b, 4b, "
        "4b-bigtables (~64 GiB of tables), or a v41-* preset (DeepSeek-V4.1's own layers)",
    )
    ap.add_argument("--out", required=True, help="the model directory to write")
    ap.add_argument(
        "--device",
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where the random weights are drawn (default: cuda where there is one, else cpu)",
    )
    ap.add_argument(
        "--max-shard-bytes",
        type=int,
        default=4 * 2**30,
        help="the largest safetensors shard of the dense weights, in bytes (default: 4 GiB)",
    )
    args = ap.parse_args()
    raw = preset_config(args.preset)
    params, tables = write_model(raw, Path(args.out), args.device, args.max_shard_bytes)
    print(
        f"{args.preset}: {params / 1e9:.2f} B dense parameters, Engram tables "
        f"{tables / 2**30:.2f} GiB -> {args.out}"
    )


if __name__ == "__main__":
    main()
