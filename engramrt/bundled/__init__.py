"""The bundled default model, so every command runs out of the box."""

from pathlib import Path

DEFAULT_MODEL_DIR = Path(__file__).parent / "tiny"


def resolve_model_dir(model: str | Path | None) -> Path:
    return DEFAULT_MODEL_DIR if model is None else Path(model)
