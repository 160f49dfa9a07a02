"""The bundled default model, so every command runs out of the box."""

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).parent / "tiny"
# The Engram fields of the released DeepSeek-V4.1-Flash config, for layout checks and benchmarks.
FLASH_CONFIG = Path(__file__).parent / "deepseek_v41_flash_config.json"


def resolve_model_dir(model: str | Path | None) -> Path:
    """A model directory to load; the bundled one (the default) gets its seeded weights."""
    path = DEFAULT_MODEL_DIR if model is None else Path(model)
    if path.resolve() == DEFAULT_MODEL_DIR.resolve():
        from engramrt.bundled.weights import materialize

        return materialize(DEFAULT_MODEL_DIR)
    return path
