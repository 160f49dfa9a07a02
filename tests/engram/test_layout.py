"""Layout values of the released DeepSeek-V4.1-Flash config and config validation."""

from __future__ import annotations

import copy
import json

import pytest

from engramrt.bundled import FLASH_CONFIG
from engramrt.config import ConfigError, engram_config
from engramrt.engram.layout import EngramLayout, is_prime

FLASH = json.loads(FLASH_CONFIG.read_text())

# The released config's values, recomputed independently of engramrt.
FLASH_PRIMES = [
    [
        16000057,
        16000079,
        16000081,
        16000097,
        16000121,
        16000129,
        16000133,
        16000183,
        16000189,
        16000207,
        16000211,
        16000253,
        16000277,
        16000289,
        16000307,
        16000321,
        16000339,
        16000381,
        16000393,
        16000399,
        16000403,
        16000409,
        16000447,
        16000463,
    ],
    [
        16000477,
        16000487,
        16000499,
        16000507,
        16000511,
        16000573,
        16000609,
        16000627,
        16000667,
        16000669,
        16000693,
        16000697,
        16000711,
        16000729,
        16000759,
        16000769,
        16000781,
        16000799,
        16000813,
        16000819,
        16000841,
        16000877,
        16000879,
        16000889,
    ],
]
FLASH_MULTIPLIERS = [
    [76632096046245, 4839876093313, 35959672319349, 73987337458391],
    [67716810739261, 51510806800915, 30921347202721, 82619226485591],
]


@pytest.fixture(scope="module")
def flash() -> EngramLayout:
    return EngramLayout.from_config(engram_config(FLASH))


def test_flash_primes(flash: EngramLayout) -> None:
    """All 48 primes, in (layer, n-gram, head) order, never reused."""
    assert [list(p) for p in flash.primes] == FLASH_PRIMES
    flat = [p for layer in flash.primes for p in layer]
    assert len(set(flat)) == 48 and all(is_prime(p) for p in flat)


def test_flash_table_sizes_and_offsets(flash: EngramLayout) -> None:
    """Offsets are exclusive prefix sums and each layer's buckets fill its table exactly."""
    for layer, rows in enumerate((384006168, 384016682)):
        primes, offsets = flash.primes[layer], flash.offsets[layer]
        assert offsets[0] == 0
        for c in range(1, 24):
            assert offsets[c] == offsets[c - 1] + primes[c - 1]
        assert flash.column_bounds(layer)[-1] == rows == sum(primes)


def test_flash_multipliers(flash: EngramLayout) -> None:
    """Seeded by the global layer id, bounded by the compressed vocab, odd, no overflow."""
    assert [list(m) for m in flash.multipliers] == FLASH_MULTIPLIERS
    for row in flash.multipliers:
        assert all(m % 2 == 1 and (99092 - 1) * m < 2**63 for m in row)


def test_pad_id_alias_and_flat_config() -> None:
    """`engram_pad_id` is accepted, and a flat config reads like a nested one."""
    flat = {**FLASH["text_config"], "image_token_id": 129264}
    flat["engram_pad_id"] = flat.pop("engram_pad_token_id")
    assert engram_config(flat) == engram_config(FLASH)


def _broken(**fields) -> dict:
    raw = copy.deepcopy(FLASH)
    raw["text_config"].update(fields)
    return raw


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"engram_num_embeddings": [384006169, 384016682]}, "engram_num_embeddings[0]"),
        ({"engram_max_ngram_size": 1}, "engram_max_ngram_size"),
        ({"engram_n_heads": 1}, "engram_n_heads"),
        ({"engram_layer_ids": [14, 1]}, "engram_layer_ids"),
        ({"engram_layer_ids": [1, 1]}, "engram_layer_ids"),
        ({"engram_num_embeddings": [384006168]}, "engram_num_embeddings"),
        ({"engram_head_dim": "256"}, "engram_head_dim"),
        ({"engram_layer_ids": []}, "engram_layer_ids"),
    ],
)
def test_invalid_config_names_the_field(fields: dict, named: str) -> None:
    with pytest.raises(ConfigError, match=named.replace("[", r"\[").replace("]", r"\]")):
        EngramLayout.from_config(engram_config(_broken(**fields)))


def test_missing_field_is_named() -> None:
    raw = copy.deepcopy(FLASH)
    del raw["text_config"]["engram_compressed_vocab_size"]
    with pytest.raises(ConfigError, match="engram_compressed_vocab_size"):
        engram_config(raw)
