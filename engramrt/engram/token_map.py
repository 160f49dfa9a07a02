"""Compressed token map: tokens that normalise to the same text share one Engram id."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, normalizers

from engramrt.config import ConfigError

_SENTINEL = "\ue000"  # keeps a whitespace-only token alive through Strip()


def engram_normalizer() -> normalizers.Normalizer:
    return normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), _SENTINEL),
            normalizers.Strip(),
            normalizers.Replace(_SENTINEL, " "),
        ]
    )


def token_map_keys(tokenizer: Tokenizer) -> list[str]:
    """The dictionary key of every token id, in id order (exposed so engines can diff keys)."""
    norm = engram_normalizer()
    keys = []
    for token_id in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:  # a partial UTF-8 byte sequence: key on the raw vocab string
            key = tokenizer.id_to_token(token_id)
            if key is None:
                raise ConfigError(f"tokenizer has no token for id {token_id}")
        else:
            key = norm.normalize_str(text) or text
        keys.append(key)
    return keys


def build_token_map(tokenizer: Tokenizer, expected_size: int | None = None) -> torch.Tensor:
    """``token_map[len(tokenizer)]`` int64: compressed id = order of first appearance of the key."""
    ids: dict[str, int] = {}
    out = [ids.setdefault(key, len(ids)) for key in token_map_keys(tokenizer)]
    if expected_size is not None and len(ids) != expected_size:
        raise ConfigError(
            f"engram_compressed_vocab_size is {expected_size} but the tokenizer's compressed "
            f"token map has {len(ids)} entries"
        )
    return torch.tensor(out, dtype=torch.int64)


def load_tokenizer(model_dir: str | Path) -> Tokenizer:
    path = Path(model_dir) / "tokenizer.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found")
    return read_tokenizer(path)


def read_tokenizer(path: str | Path) -> Tokenizer:
    """``Tokenizer.from_file``, whose failures (a bare ``Exception``: "Model missing", a JSON
    syntax error) are a ConfigError naming the file: the commands' one-line error, exit 2."""
    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers library raises nothing more specific
        raise ConfigError(f"{path} is not a valid tokenizer file: {exc}") from None
