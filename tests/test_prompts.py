"""Prompt tokenisation follows the tokenizer files: BOS exactly where ``add_bos_token`` says,
chat templates tokenised without the tokenizer's own special tokens, and config errors that
name the file. The oracle is the ``tokenizers`` library on the same tokenizer.json, with the
rule restated here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.config import ConfigError
from engramrt.engram.token_map import load_tokenizer
from engramrt.prompts import PromptEncoder

TEXTS = ["hello", "", " The quick brown fox", "a\nb\tc", "<｜begin▁of▁sentence｜>x"]


def model_dir_with(tmp_path: Path, **changes) -> Path:
    """A copy of the bundled tokenizer files with ``tokenizer_config.json`` changed."""
    out = tmp_path / "m"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(GQA_MODEL_DIR / name, out / name)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.update(changes)
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


def test_no_bos_where_the_config_says_so() -> None:
    tok, enc = load_tokenizer(GQA_MODEL_DIR), PromptEncoder.load(GQA_MODEL_DIR)
    cfg = json.loads((GQA_MODEL_DIR / "tokenizer_config.json").read_text())
    assert cfg["add_bos_token"] is False and enc.bos_id is None
    for text in TEXTS:
        assert enc.text(text) == tok.encode(text).ids


@pytest.mark.parametrize("spelled", ["plain", "dict"])
def test_bos_where_the_config_asks_for_it(tmp_path: Path, spelled: str) -> None:
    """With ``add_bos_token: true`` every text prompt starts with the BOS id exactly once,
    also when the text itself starts with the BOS token's text."""
    bos = "<｜begin▁of▁sentence｜>"
    value = bos if spelled == "plain" else {"content": bos, "special": True}
    d = model_dir_with(tmp_path, add_bos_token=True, bos_token=value)
    tok, enc = load_tokenizer(d), PromptEncoder.load(d)
    bos_id = tok.token_to_id(bos)
    assert enc.bos_id == bos_id is not None
    for text in TEXTS:
        plain = tok.encode(text).ids
        want = plain if plain[:1] == [bos_id] else [bos_id, *plain]
        assert enc.text(text) == want


def test_chat_template_writes_its_own_bos(tmp_path: Path) -> None:
    """The bundled template starts with ``{{ bos_token }}``: one BOS, whatever add_bos_token
    says, and the ids are the rendered text's without the tokenizer's own specials."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    for d in (GQA_MODEL_DIR, model_dir_with(tmp_path, add_bos_token=True)):
        enc = PromptEncoder.load(d)
        ids = enc.chat(messages)
        bos_id = enc.tokenizer.token_to_id(enc.bos_token)
        assert ids[0] == bos_id and ids.count(bos_id) == 1
        text = enc.tokenizer.decode(ids, skip_special_tokens=False)
        assert text.startswith(enc.bos_token) and text.endswith("<｜Assistant｜>")
        assert "Be brief." in text and "Hi" in text


def test_config_errors_name_the_file(tmp_path: Path) -> None:
    d = model_dir_with(tmp_path, add_bos_token=True, bos_token="<not-a-token>")
    with pytest.raises(ConfigError, match="tokenizer_config.json.*<not-a-token>"):
        PromptEncoder.load(d)
    (d / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizer_config.json is not valid JSON"):
        PromptEncoder.load(d)
    (d / "tokenizer_config.json").unlink()  # no config: the tokenizer's own rules, no template
    enc = PromptEncoder.load(d)
    assert enc.bos_id is None and enc.text("hello") == load_tokenizer(d).encode("hello").ids
    with pytest.raises(ValueError, match="no chat template"):
        enc.chat([{"role": "user", "content": "Hi"}])


def test_without_special_tokens_no_bos(tmp_path: Path) -> None:
    """``special=False`` (vLLM's ``add_special_tokens: false``) is the text's own ids: no BOS
    even where the config adds one, and the tokenizer encoding without its specials."""
    d = model_dir_with(tmp_path, add_bos_token=True)
    tok, enc = load_tokenizer(d), PromptEncoder.load(d)
    for text in TEXTS:
        assert enc.text(text, special=False) == tok.encode(text, add_special_tokens=False).ids
    assert enc.text("hello", special=False)[:1] != [enc.bos_id]
    assert enc.text("hello")[:1] == [enc.bos_id]


def test_chat_flags(tmp_path: Path) -> None:
    """Without the generation prompt the template's ``add_generation_prompt`` branch is left
    out; ``special`` tokenises the rendered text as a text prompt (one BOS, not two)."""
    messages = [{"role": "user", "content": "Hi"}]
    enc = PromptEncoder.load(model_dir_with(tmp_path, add_bos_token=True))
    tok = enc.tokenizer
    with_prompt, without = enc.chat(messages), enc.chat(messages, add_generation_prompt=False)
    assert with_prompt == [*without, tok.token_to_id("<｜Assistant｜>")]
    assert enc.chat(messages, special=True) == with_prompt  # the template already wrote BOS
    assert with_prompt.count(enc.bos_id) == 1


def test_config_is_kept(tmp_path: Path) -> None:
    d = model_dir_with(tmp_path, extra_field=[1, 2])
    assert PromptEncoder.load(d).config == json.loads((d / "tokenizer_config.json").read_text())


def test_the_length_bound_holds_for_every_text_tried() -> None:
    """``max_token_bytes`` bounds the bytes any token stands for: random texts built from the
    vocabulary's own pieces, added tokens, bytes that are not UTF-8 pieces and long runs never
    have more bytes than tokens times the bound, and ``check_fits`` refuses only texts whose
    token count really exceeds the limit."""
    import random

    p = PromptEncoder.load(GQA_MODEL_DIR)
    k, tok = p.max_token_bytes, p.tokenizer
    assert k is not None and k >= 1
    rng = random.Random(0)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    for _ in range(300):
        parts = [
            tok.decode([rng.randrange(vocab)], skip_special_tokens=False)
            for _ in range(rng.randint(1, 40))
        ]
        parts += [chr(rng.randrange(32, 0x2FFF)) * rng.randint(1, 50) for _ in range(3)]
        rng.shuffle(parts)
        text = "".join(parts)
        ids = p.text(text, special=False)
        assert len(text.encode()) <= k * len(ids), text
        limit = rng.randint(1, 2 * len(ids))
        if len(text) > k * limit:  # the bound refuses: the count must really exceed it
            assert len(ids) > limit
            with pytest.raises(ValueError, match="maximum context length"):
                p.check_fits(text, limit)
        else:
            p.check_fits(text, limit)
