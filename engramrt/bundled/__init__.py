"""The bundled default model, so every command runs out of the box: a small DeepSeek-V4.1 model
(every layer role, Engram, mHC, MoE, one DSpark stage) trained by ``engramrt.bundled.train``
(its held-out task files in ``tiny_v41/tasks``). The earlier GQA stand-in stays as a fixture of
tests and benchmarks (``GQA_MODEL_DIR``)."""

from pathlib import Path

_HERE = Path(__file__).parent
DEFAULT_MODEL_DIR = _HERE / "tiny_v41"
DEFAULT_TASKS_DIR = DEFAULT_MODEL_DIR / "tasks"
# the GQA + dense-FFN model with the same tokenizer (the V4.1 presets take their vocabulary
# fields from it)
GQA_MODEL_DIR = _HERE / "tiny_gqa"
# The Engram fields of the released DeepSeek-V4.1-Flash config, for layout checks and benchmarks.
FLASH_CONFIG = _HERE / "deepseek_v41_flash_config.json"


def resolve_model_dir(model: str | Path | None) -> Path:
    """A model directory to load: ``model``, or the bundled one."""
    return DEFAULT_MODEL_DIR if model is None else Path(model)
