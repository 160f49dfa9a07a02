"""The model families engramrt serves, one line each, chosen by a config's ``attention_type``
(DeepSeek-V4.1's released configs give none and have ``compress_ratios``). The only place that
imports a family: everything else asks ``cfg.family`` (``engramrt.model.family``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from engramrt.config import ModelConfig
from engramrt.config_base import ConfigError, text_config
from engramrt.model.family import ModelFamily
from engramrt.models.deepseek_v41 import DeepSeekV41
from engramrt.models.gqa import GQA

FAMILIES: dict[str, ModelFamily] = {
    "gqa": GQA(),
    "v41": DeepSeekV41(),
}


def family_for(raw: Mapping[str, Any]) -> ModelFamily:
    cfg = text_config(raw)
    attention = cfg.get("attention_type", "v41" if "compress_ratios" in cfg else None)
    if attention not in FAMILIES:
        raise ConfigError(
            f"attention_type must be one of {list(FAMILIES)} (DeepSeek-V4.1's configs give "
            f"none and have compress_ratios), got {attention!r}"
        )
    return FAMILIES[attention]


def model_config(raw: Mapping[str, Any]) -> ModelConfig:
    """The config of whichever family ``raw`` names; errors name the field."""
    return family_for(raw).config(raw)
