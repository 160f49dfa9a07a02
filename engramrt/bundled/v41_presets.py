"""DeepSeek-V4.1-shaped configs scaled down: Flash's released config with a preset's widths and
six layers, on the bundled tokenizer. ``v41-tiny`` is the bundled default model's
(``engramrt.bundled.train``); ``v41-small`` and ``v41-wide`` are the test and benchmark presets
(``benchmarks/make_models.py``)."""

from __future__ import annotations

import json

from engramrt.bundled import FLASH_CONFIG, GQA_MODEL_DIR
from engramrt.config import engram_config, load_json
from engramrt.engram.layout import search_primes

# V4.1 presets: the fields of Flash's text_config that change (the rest: Flash's own)
V41_SMALL = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "head_dim": 64,
    "qk_rope_head_dim": 16,
    "q_lora_rank": 64,
    "o_groups": 2,
    "o_lora_rank": 64,
    "sliding_window": 16,
    "index_n_heads": 4,
    "index_head_dim": 64,
    "index_topk": 8,
    "candidate_topk_blocks": 3,
    "candidate_block_size": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 64,
    "max_position_embeddings": 1024,
    "dspark_markov_rank": 32,
    "dspark_n_routed_experts": 4,
    "dspark_n_activated_experts": 2,
    "rope_scaling": {
        "original_max_position_embeddings": 32,
        "factor": 16,
        "beta_fast": 32,
        "beta_slow": 1,
    },
}
V41_WIDE = {
    "hidden_size": 5120,
    "num_attention_heads": 64,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1280,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "sliding_window": 128,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "index_topk": 512,
    "n_routed_experts": 16,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2304,
    "max_position_embeddings": 16384,
    "dspark_n_routed_experts": 16,
    "dspark_n_activated_experts": 3,
}
# the bundled default model (``engramrt.bundled.train``): v41-small's shape with selection sizes
# that cover its training windows (its indexers get no gradient: within them every compressed
# entry is attended), a longer window and wider experts
V41_TINY = {
    **V41_SMALL,
    "sliding_window": 32,
    "q_lora_rank": 128,
    "index_topk": 128,
    "candidate_topk_blocks": 9,
    "candidate_block_size": 16,
    "moe_intermediate_size": 128,
    "rope_scaling": {
        "original_max_position_embeddings": 128,
        "factor": 8,
        "beta_fast": 32,
        "beta_slow": 1,
    },
}
# v41-small sees (``models/deepseek_v41/vision.py``): a two-block tower at small widths, with
# Flash's patch and cell sizes and a budget that keeps a test image's span short
V41_SMALL_VISION = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "intermediate_size": 96,
    "patch_size": 14,
    "rope_theta": 10000,
    "downsample_ratio": 3,
    "max_image_tokens": 64,
    "min_pixels": 42 * 42,
    "max_wh_ratio": None,
}
V41_VISION = {"v41-small": V41_SMALL_VISION}
V41_PRESETS = {  # fields, engram layers, engram head dim, prime search start
    "v41-tiny": (V41_TINY, [1, 3], 32, 4096),
    "v41-small": (V41_SMALL, [1, 3], 32, 4096),
    "v41-wide": (V41_WIDE, [1, 3], 256, 320_000),
}
# six layers in Flash's order of roles: window, ratio-2 source, its reuse, the ratio-1
# candidate source, its reuse, a candidate-filtered re-indexer; one DSpark stage drafting from
# the last three (the noise id: the bundled tokenizer's pad token)
V41_LAYERS = {
    "num_hidden_layers": 6,
    "compress_ratios": [0, 2, 2, 1, 1, 1, 0],
    "kv_source_layer_ids": [1, 3],
    "index_source_layer_ids": [1, 3, 5],
    "candidate_source_layer_id": 3,
    "num_nextn_predict_layers": 1,
    "dspark_target_layer_ids": [3, 4, 5],
    "dspark_noise_token_id": 2,
}


def v41_preset_config(name: str) -> dict:
    """Flash's released config with a preset's widths and six layers, on the bundled tokenizer."""
    fields, engram_layers, engram_dim, start = V41_PRESETS[name]
    bundled = load_json(GQA_MODEL_DIR)["text_config"]
    raw = json.loads(FLASH_CONFIG.read_text())
    text = raw["text_config"]
    text.update(fields, **V41_LAYERS)
    keep = (
        "vocab_size",
        "bos_token_id",
        "eos_token_id",
        "engram_vocab_size",
        "engram_compressed_vocab_size",
        "engram_pad_token_id",
        "torch_dtype",
    )
    text.update(
        {k: bundled[k] for k in keep},
        engram_layer_ids=engram_layers,
        engram_head_dim=engram_dim,
        engram_vocab_size=start,
        engram_num_embeddings=[0] * len(engram_layers),
    )
    raw["image_token_id"] = load_json(GQA_MODEL_DIR)["image_token_id"]
    if name in V41_VISION:
        raw["vision_config"] = dict(V41_VISION[name])
    raw.pop("_comment", None)
    primes = search_primes(engram_config(raw))
    text["engram_num_embeddings"] = [sum(map(sum, layer)) for layer in primes]
    return raw
