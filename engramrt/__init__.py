"""engramrt: an inference engine for Engram + mHC language models (DeepSeek-V4.1 family)."""

__version__ = "0.1.0"

from engramrt.model.checkpoint import CheckpointError, load_model, save_checkpoint
from engramrt.runner.stage import StageRunner

__all__ = ["__version__", "CheckpointError", "StageRunner", "load_model", "save_checkpoint"]
