"""The bundled default model, so every command runs out of the box: a small Engram + mHC model
trained by ``engramrt.bundled.train`` (its held-out task files in ``tiny/tasks``)."""

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).parent / "tiny"
DEFAULT_TASKS_DIR = DEFAULT_MODEL_DIR / "tasks"
# The Engram fields of the released DeepSeek-V4.1-Flash config, for layout checks and benchmarks.
FLASH_CONFIG = Path(__file__).parent / "deepseek_v41_flash_config.json"


def resolve_model_dir(model: str | Path | None) -> Path:
    """A model directory to load: ``model``, or the bundled one."""
    return DEFAULT_MODEL_DIR if model is None else Path(model)
