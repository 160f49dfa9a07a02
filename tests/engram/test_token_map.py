"""Compressed token map on a hand-built vocabulary and on the bundled tokenizer."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.config import ConfigError, engram_config, load_json
from engramrt.engram.token_map import build_token_map, load_tokenizer, token_map_keys

# Each token with the key the token-map rules give it, worked out by hand.
VOCAB = [
    ("<pad>", "<pad>"),
    ("The", "the"),
    ("the", "the"),
    ("THE", "the"),
    ("  ", " "),  # whitespace-only tokens all collapse to " " (sentinel survives Strip)
    ("\t\n", " "),
    ("café", "cafe"),  # accents stripped
    ("Ｃａｆé", "cafe"),  # NFKC folds full-width forms
    ("\u0301", "\u0301"),  # normalizes to "", so the raw text is the key
    ("ﬁ", "fi"),  # NFKC ligature
    ("x", "x"),
]


def _word_level() -> Tokenizer:
    return Tokenizer(models.WordLevel({tok: i for i, (tok, _) in enumerate(VOCAB)}, "<pad>"))


def test_hand_built_vocab_keys_and_ids() -> None:
    """Keys follow the normalizer; ids are the order of first appearance of each key."""
    tok = _word_level()
    assert token_map_keys(tok) == [key for _, key in VOCAB]
    first: dict[str, int] = {}
    expected = [first.setdefault(key, len(first)) for _, key in VOCAB]
    assert build_token_map(tok).tolist() == expected


def test_size_check() -> None:
    tok = _word_level()
    with pytest.raises(ConfigError, match="engram_compressed_vocab_size is 3 .* has 7"):
        build_token_map(tok, expected_size=3)


def test_bundled_tokenizer_invariants() -> None:
    """On a real byte-level BPE: partial UTF-8 tokens key on their raw string, case and leading
    space merge, whitespace tokens share one id, and the size matches the config."""
    tok = load_tokenizer(GQA_MODEL_DIR)
    cfg = engram_config(load_json(GQA_MODEL_DIR))
    tmap = build_token_map(tok, cfg.compressed_vocab_size).tolist()
    keys = token_map_keys(tok)
    partial = [i for i in range(len(keys)) if "\ufffd" in tok.decode([i])]
    assert partial and all(keys[i] == tok.id_to_token(i) for i in partial)
    vocab = tok.get_vocab()
    assert tmap[vocab["Ġthe"]] == tmap[vocab["ĠThe"]]
    spaces = [vocab[t] for t in ("Ġ", "Ċ", "ĉ", "ĊĊ") if t in vocab]
    assert len(spaces) >= 3 and len({tmap[i] for i in spaces}) == 1
    seen = -1
    for cid in tmap:  # first-appearance order: a new id is always the next one
        assert cid <= seen + 1
        seen = max(seen, cid)
