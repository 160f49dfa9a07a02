"""engramrt: an inference engine for Engram + mHC language models (DeepSeek-V4.1 family)."""

__version__ = "0.1.0"

from engramrt.model.checkpoint import CheckpointError, load_model, save_checkpoint
from engramrt.session import Session

__all__ = ["__version__", "CheckpointError", "Session", "load_model", "save_checkpoint"]
