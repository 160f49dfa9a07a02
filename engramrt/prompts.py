"""Text to token ids exactly as the model's tokenizer files say, for the server and every
command, so that a client tokenising with the same tokenizer (lm-eval's Hugging Face backend,
say) gets the same ids: the tokenizer's own post-processor, plus BOS only where
``tokenizer_config.json`` sets ``add_bos_token``; chat templates write their own special tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from engramrt.config import ConfigError
from engramrt.engram.token_map import load_tokenizer


def _token_text(value) -> str:
    """A special token as tokenizer configs spell it: a string or ``{"content": ...}``."""
    return value.get("content", "") if isinstance(value, dict) else value or ""


@dataclass
class PromptEncoder:
    tokenizer: Tokenizer
    bos_id: int | None = None  # prepended to text prompts (``add_bos_token``)
    chat_template: str | None = None
    bos_token: str = ""
    eos_token: str = ""
    config: dict = field(default_factory=dict)  # tokenizer_config.json as read (/tokenizer_info)
    # the most input bytes one token can stand for; None: the tokenizer can drop input
    # (a normaliser, a pre-tokenizer that removes), so text length bounds no token count
    max_token_bytes: int | None = None

    @classmethod
    def load(cls, model_dir: str | Path, tokenizer: Tokenizer | None = None) -> PromptEncoder:
        tok = tokenizer or load_tokenizer(model_dir)
        path = Path(model_dir) / "tokenizer_config.json"
        try:
            cfg = json.loads(path.read_text()) if path.is_file() else {}
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path} is not valid JSON: {exc}") from None
        bos, eos = _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))
        bos_id = None
        if cfg.get("add_bos_token"):
            bos_id = tok.token_to_id(bos) if bos else None
            if bos_id is None:
                raise ConfigError(
                    f"{path} sets add_bos_token but its bos_token {bos!r} is not a token of "
                    "tokenizer.json"
                )
        return cls(tok, bos_id, cfg.get("chat_template"), bos, eos, cfg, max_token_bytes(tok))

    def check_fits(self, text: str, max_tokens: int) -> None:
        """A text whose length alone proves it holds more than ``max_tokens`` tokens is an
        error before it is tokenised (a 20 MB prompt costs tens of seconds of CPU otherwise):
        each token stands for at most ``max_token_bytes`` bytes, and a text has at least as
        many bytes as characters."""
        k = self.max_token_bytes
        if k is not None and len(text) > k * max_tokens:
            raise ValueError(
                f"the text's {len(text)} characters are more than {max_tokens} tokens can hold "
                f"(a token of this tokenizer stands for at most {k} bytes): this model's maximum "
                f"context length is {max_tokens} tokens"
            )

    def text(self, text: str, special: bool = True) -> list[int]:
        """``special`` False (vLLM's ``add_special_tokens``) gives the text's own ids: no BOS,
        nothing from the post-processor, as a client splitting a prompt into pieces needs."""
        ids = self._encode(text, special)
        if special and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id, *ids]
        return ids

    def chat(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        special: bool = False,
        max_tokens: int | None = None,
    ) -> list[int]:
        """The chat template rendered (with the generation prompt unless told otherwise), then
        tokenised without the tokenizer's own special tokens (the template wrote those it
        wants), or, with ``special``, as a text prompt; ``max_tokens``: ``check_fits`` first."""
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        env = ImmutableSandboxedEnvironment()
        text = env.from_string(self.chat_template).render(
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        if max_tokens is not None:
            self.check_fits(text, max_tokens)
        return self.text(text) if special else self._encode(text, special=False)

    def _encode(self, text: str, special: bool) -> list[int]:
        """``encode_batch`` of one text: the same ids as ``encode``, but it releases the GIL,
        so a long prompt tokenised on a worker thread leaves the server's other threads free."""
        return self.tokenizer.encode_batch([text], add_special_tokens=special)[0].ids


# pre-tokenizers and normalisers that keep every input byte in some token (others, e.g.
# ``Whitespace`` or a ``Split`` that removes, drop input, and no length bound holds)
_KEEPING = {"ByteLevel", "Metaspace", "Digits", "Split", "Punctuation", "UnicodeScripts"}


def _keeps_input(part: dict | None) -> bool:
    if part is None:
        return True
    if part.get("type") == "Sequence":
        return all(_keeps_input(p) for p in part.get("pretokenizers", part.get("normalizers", [])))
    return part.get("type") in _KEEPING and part.get("behavior") != "Removed"


def max_token_bytes(tokenizer: Tokenizer) -> int | None:
    """The most input bytes one token stands for (``PromptEncoder.max_token_bytes``): its
    piece's UTF-8 length bounds it (a byte-level piece has one character per byte, a
    byte-fallback piece more), added tokens included; None where the tokenizer may drop
    input (any normaliser but an empty sequence, a pre-tokenizer that removes)."""
    spec = json.loads(tokenizer.to_str())
    normalizer = spec.get("normalizer")
    if normalizer is not None and not (
        normalizer.get("type") == "Sequence" and not normalizer.get("normalizers")
    ):
        return None
    if not _keeps_input(spec.get("pre_tokenizer")):
        return None
    return max(len(piece.encode()) for piece in tokenizer.get_vocab(with_added_tokens=True))
