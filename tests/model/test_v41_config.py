"""V4.1's configuration (``engramrt.models.deepseek_v41.config``): Flash's released config read in
both
spellings gives the same fields and the layer roles of V41-ARCH.md's table 1.2; the legal
pipeline cuts equal a brute-force restatement on random configurations (a cut is legal when no
later layer reads what an earlier one wrote); every inconsistency is an error naming its field."""

from __future__ import annotations

import json
import random

import pytest

from engramrt.bundled import FLASH_CONFIG
from engramrt.config import ConfigError
from engramrt.models.deepseek_v41.config import REINDEX, REUSE, SOURCE, WINDOW, v41_config

FLASH = json.loads(FLASH_CONFIG.read_text())["text_config"]

# the reference's inference/config.json spelling of the same fields
REFERENCE_NAMES = {
    "hidden_size": "dim",
    "num_hidden_layers": "n_layers",
    "num_attention_heads": "n_heads",
    "qk_rope_head_dim": "rope_head_dim",
    "sliding_window": "window_size",
    "kv_source_layer_ids": "kv_source_layers",
    "index_source_layer_ids": "index_source_layers",
    "candidate_source_layer_id": "candidate_source_layer",
    "rms_norm_eps": "norm_eps",
    "num_nextn_predict_layers": "n_mtp_layers",
    "num_experts_per_tok": "n_activated_experts",
    "moe_intermediate_size": "moe_inter_dim",
    "scoring_func": "score_func",
    "routed_scaling_factor": "route_scale",
}


def reference_spelling(hf: dict) -> dict:
    out = {REFERENCE_NAMES.get(k, k): v for k, v in hf.items() if k != "rope_scaling"}
    rope = hf["rope_scaling"]
    out.update(
        original_seq_len=rope["original_max_position_embeddings"],
        rope_factor=rope["factor"],
        beta_fast=rope["beta_fast"],
        beta_slow=rope["beta_slow"],
    )
    return out


def test_flash_in_both_spellings() -> None:
    hf, ref = v41_config({"text_config": FLASH}), v41_config(reference_spelling(FLASH))
    assert hf == ref
    assert (hf.n_layers, hf.n_mtp_layers, len(hf.compress_ratios)) == (40, 3, 43)
    assert (hf.original_seq_len, hf.rope_factor, hf.compress_rope_theta) == (65536, 16, 160000)


def test_flash_layer_roles_are_the_documented_ones() -> None:
    cfg = v41_config(FLASH)
    kinds = {
        kind: [r.layer for r in cfg.roles if r.kind == kind]
        for kind in (WINDOW, SOURCE, REINDEX, REUSE)
    }
    assert kinds[WINDOW] == [0, 1]
    assert kinds[SOURCE] == [2, 8, 14, 20]
    assert kinds[REINDEX] == [24, 28, 32, 36]
    assert len(kinds[REUSE]) == 30  # "30 layers that only reuse"
    assert [r.layer for r in cfg.roles if r.builds_candidates] == [20]
    by = {r.layer: r for r in cfg.roles}
    assert (by[5].kv_source, by[5].topk_from) == (2, 2)
    assert (by[19].kv_source, by[19].ratio) == (14, 2)
    assert (by[22].kv_source, by[22].topk_from, by[22].ratio) == (20, 20, 1)
    assert (by[24].kv_source, by[24].index_source, by[24].candidates_from) == (20, 20, 20)
    assert (by[27].kv_source, by[27].topk_from) == (20, 24)
    assert cfg.legal_cuts() == [1, 2, 8, 14, 20]  # the list for Flash


def _random_config(rng: random.Random) -> dict:
    """A consistent V4.1 schedule: window layers, then ratio-2 groups each opened by a
    source, then a ratio-1 candidate source, its reuse layers and re-indexing ones."""
    ratios, kv, index = [0] * rng.randint(0, 2), [], []
    for _ in range(rng.randint(0, 3)):
        kv.append(len(ratios))
        ratios += [2] * rng.randint(1, 4)
    cand = len(ratios)
    kv.append(cand)
    ratios += [1] * rng.randint(1, 3)
    for _ in range(rng.randint(0, 3)):
        index.append(len(ratios))
        ratios += [1] * rng.randint(1, 3)
    cfg = dict(
        FLASH,
        num_hidden_layers=len(ratios),
        compress_ratios=ratios,
        kv_source_layer_ids=kv,
        index_source_layer_ids=sorted(kv + index),
        candidate_source_layer_id=cand,
        num_nextn_predict_layers=0,
        engram_layer_ids=[0],
    )
    return cfg


def test_legal_cuts_equal_a_brute_force_restatement() -> None:
    """A cut before layer L is legal iff every layer from L on finds what it reads (the cache
    of the latest source of its ratio, the latest top-k, the candidate blocks) written at or
    after L: restated here from the schedule itself, not from the roles."""
    rng = random.Random(0)
    for _ in range(300):
        raw = _random_config(rng)
        cfg = v41_config(raw)
        ratios, kv = raw["compress_ratios"], set(raw["kv_source_layer_ids"])
        index, cand = set(raw["index_source_layer_ids"]), raw["candidate_source_layer_id"]
        want = []
        for cut in range(1, len(ratios)):
            ok = True
            for layer in range(cut, len(ratios)):
                if ratios[layer] == 0:
                    continue
                src = max(s for s in kv if s <= layer)
                indexer = max(s for s in index if s <= layer)
                needs = {src, indexer} | ({cand} if layer in index - kv else set())
                ok &= min(needs) >= cut
            if ok:
                want.append(cut)
        assert cfg.legal_cuts() == want, raw["compress_ratios"]


BAD = [
    ("spellings", {"dim": 4096}, "'dim'"),
    (
        "kv_not_index",
        {"index_source_layer_ids": [8, 14, 20, 24, 28, 32, 36]},
        "kv_source_layer_ids",
    ),
    ("candidate_ratio", {"candidate_source_layer_id": 14}, "candidate_source_layer_id"),
    ("reindex_early", {"index_source_layer_ids": [2, 8, 10, 14, 20]}, "re-indexes"),
    ("index_on_window", {"index_source_layer_ids": [1, 2, 8, 14, 20]}, "index_source_layer_ids"),
    ("no_source", {"kv_source_layer_ids": [8, 14, 20]}, "compress_ratios"),
    ("ratio_length", {"compress_ratios": [0, 2, 1]}, "compress_ratios"),
    ("ratio_value", {"compress_ratios": [0, 0] + [3] * 41}, "compress_ratios"),
    ("width", {"q_lora_rank": 1000}, "q_lora_rank"),
    ("rope", {"qk_rope_head_dim": 63}, "qk_rope_head_dim"),
    ("groups", {"o_groups": 7}, "o_groups"),
    ("topk", {"index_topk": 20000}, "index_topk"),
    ("experts", {"num_experts_per_tok": 400}, "num_experts_per_tok"),
    ("score", {"scoring_func": "softmax"}, "scoring_func"),
    ("missing", {"q_lora_rank": None}, "q_lora_rank"),
    ("unsorted", {"kv_source_layer_ids": [8, 2, 14, 20]}, "kv_source_layer_ids"),
]


@pytest.mark.parametrize(("change", "needle"), [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_inconsistencies_are_errors_naming_the_field(change: dict, needle: str) -> None:
    raw = {k: v for k, v in {**FLASH, **change}.items() if v is not None}
    with pytest.raises(ConfigError, match=needle):
        v41_config(raw)
