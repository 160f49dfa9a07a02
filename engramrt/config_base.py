"""What every config reader shares: the error that names a field, and the flattening of
``text_config`` (DeepSeek-V4.1 nests its language-model fields there; smaller models keep them
flat)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A config field is missing or violates a rule; the message names the field."""


def text_config(raw: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten ``text_config`` over the top level (top-level keys such as image_token_id stay)."""
    merged = {k: v for k, v in raw.items() if k != "text_config"}
    merged.update(raw.get("text_config") or {})
    return merged
