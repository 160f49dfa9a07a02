"""An image as DeepSeek-V4.1's vision tower and its prompt see it (the reference's
``image_processor.py``): decoded with Pillow (EXIF orientation applied, RGB), its size planned into
a patch grid for the ViT and, after the aligner's ``d x d`` downsample, a token grid that the
prompt spells ``[IMAGE_START] + ([IMAGE] * w + [IMAGE_NEW_LINE]) * h + [IMAGE_END]``: every
position of the span carries the image token id; the types tell them apart, and the IMAGE slots
take the aligner's rows in reading order.

What a request's image becomes before the model (``vision.py`` is the tower; the first stage's
``runner/images.py`` puts its rows in the prompt). The one deliberate difference from the
reference: the EXIF orientation is applied (the reference reads the stored pixels as they are).
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import torch

from engramrt.config_base import ConfigError

# token types of an image span (the reference's); text is -1
TEXT, IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = -1, 0, 1, 2, 3
PAD_COLOR = (127, 127, 127)  # what the reference pads with: 0 after normalisation, nearly


# the reference's flat config keys, by the HF vision_config names used here
FLAT = {
    "vision_n_layers": "num_hidden_layers",
    "vision_dim": "hidden_size",
    "vision_n_heads": "num_attention_heads",
    "vision_inter_dim": "intermediate_size",
    "vision_patch_size": "patch_size",
    "vision_rope_theta": "rope_theta",
    "vision_downsample_ratio": "downsample_ratio",
    "vision_max_n_token": "max_image_tokens",
    "vision_min_pixels": "min_pixels",
    "vision_max_wh_ratio": "max_wh_ratio",
}


@dataclass(frozen=True)
class VisionConfig:
    """``vision_config`` of a V4.1 checkpoint (the released values as defaults)."""

    num_hidden_layers: int = 32
    hidden_size: int = 1024
    num_attention_heads: int = 16
    intermediate_size: int = 2816
    patch_size: int = 14
    rope_theta: float = 10000.0
    downsample_ratio: int = 3
    max_image_tokens: int = 1024
    min_pixels: int = 295936
    max_wh_ratio: int | None = None

    @classmethod
    def from_config(cls, raw: dict) -> VisionConfig | None:
        """The tower a model config asks for: its ``vision_config`` (HF's names) or, without
        one, the reference's flat ``vision_*`` keys (DeepSeek's ``inference/config.json``);
        None where it has no tower (no vision fields, or 0 layers)."""
        nested = raw.get("vision_config")
        if isinstance(nested, dict):
            raw = nested
        else:
            raw = {FLAT[k]: v for k, v in raw.items() if k in FLAT}
        if int(raw.get("num_hidden_layers") or 0) == 0:
            return None
        fields = {k: raw[k] for k in cls.__dataclass_fields__ if raw.get(k) is not None}
        cfg = cls(**fields)
        if cfg.patch_size < 1 or cfg.downsample_ratio < 1 or cfg.max_image_tokens < 5:
            raise ConfigError(
                "vision_config: patch_size and downsample_ratio must be >= 1 and "
                f"max_image_tokens >= 5 (one row of one token), got {cfg}"
            )
        return cfg


@dataclass(frozen=True)
class ImageGrid:
    """What an image is resized to (``height`` x ``width`` pixels, whole patches) and the token
    grid (``rows`` x ``cols``) the aligner makes of its patches."""

    height: int
    width: int
    rows: int
    cols: int
    patch: int

    @property
    def patch_rows(self) -> int:
        return self.height // self.patch

    @property
    def patch_cols(self) -> int:
        return self.width // self.patch

    @property
    def tokens(self) -> int:
        """Positions of the span in the prompt: a newline after each row, a start and an end."""
        return span_tokens(self.rows, self.cols)

    def types(self) -> torch.Tensor:
        """The span's token types in order (int64)."""
        row = [IMAGE] * self.cols + [IMAGE_NEW_LINE]
        return torch.tensor([IMAGE_START, *row * self.rows, IMAGE_END], dtype=torch.int64)


def span_tokens(rows: int, cols: int) -> int:
    return rows * (cols + 1) + 2


def _token_grid(height: int, width: int, cfg: VisionConfig) -> tuple[int, int]:
    p, d = cfg.patch_size, cfg.downsample_ratio
    return math.ceil(height // p / d), math.ceil(width // p / d)


def _within_budget(height: float, width: float, cfg: VisionConfig) -> tuple[int, int]:
    """The pixel size (whole patches) of an image of aspect ``height / width`` whose token grid
    fits ``max_image_tokens``: the largest whole number of aligner cells a side that
    ``rows * (cols + 1) + 2`` allows, scaled back to the image; a side under one cell takes a
    single row or column."""
    p, budget = cfg.patch_size, cfg.max_image_tokens
    cell = p * cfg.downsample_ratio
    aspect = height / width
    cols = math.sqrt((budget - 2) / aspect + 0.25) - 0.5  # rows * (cols + 1) = budget - 2
    rows = cols * aspect
    if cols < 1.0:  # very tall: one column
        return (budget - 2) // 2 * cell, cell
    if rows < 1.0:  # very wide: one row
        return cell, (budget - 3) * cell
    scale = min(math.floor(cols) * cell / width, math.floor(rows) * cell / height)
    return math.floor(height * scale / p) * p, math.floor(width * scale / p) * p


def plan_grid(width: int, height: int, cfg: VisionConfig) -> ImageGrid:
    """The reference's plan for an image of ``width`` x ``height`` pixels, in its order: the
    width capped at ``max_wh_ratio`` heights, an image under ``min_pixels`` scaled up to it,
    each side rounded up to whole patches, and the whole shrunk if its token grid would exceed
    ``max_image_tokens``."""
    if width < 1 or height < 1:
        raise ValueError(f"an image needs pixels, got {width} x {height}")
    p = cfg.patch_size
    if cfg.max_wh_ratio is not None and width > height * cfg.max_wh_ratio:
        width = height * cfg.max_wh_ratio
    if width * height < cfg.min_pixels:
        up = (cfg.min_pixels / (width * height)) ** 0.5
        width, height = int(width * up), int(height * up)
    best_h, best_w = math.ceil(height / p) * p, math.ceil(width / p) * p
    rows, cols = _token_grid(best_h, best_w, cfg)
    if span_tokens(rows, cols) > cfg.max_image_tokens:
        best_h, best_w = _within_budget(height, width, cfg)
        rows, cols = _token_grid(best_h, best_w, cfg)
    return ImageGrid(best_h, best_w, rows, cols, p)


def decode(data: bytes, max_pixels: int):
    """``data``'s image (a ``PIL.Image`` in RGB, EXIF orientation applied); a ValueError saying
    why where it is not an image, has no pixels or more than ``max_pixels``. The size is checked
    before the pixels are decoded."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(data)) as src:
            w, h = src.size
            if w * h == 0:
                raise ValueError(f"the image has no pixels ({w} x {h})")
            if w * h > max_pixels:
                raise ValueError(f"the image has {w * h} pixels ({w} x {h}), over {max_pixels}")
            return ImageOps.exif_transpose(src).convert("RGB")
    except Image.DecompressionBombError as exc:  # Pillow's own cap, past ours
        raise ValueError(f"the image has too many pixels: {exc}") from None
    except (UnidentifiedImageError, OSError) as exc:
        raise ValueError(f"not a decodable image: {exc}") from None


def fit(image, grid: ImageGrid, cfg: VisionConfig):
    """``image`` (RGB) at the grid's size as uint8 ``[height, width, 3]``: padded to it,
    centred, in ``PAD_COLOR`` (Pillow's bicubic fit), or stretched to it where the image is
    ``max_wh_ratio`` heights wide or more."""
    import numpy as np
    from PIL import ImageOps

    size = (grid.width, grid.height)
    if cfg.max_wh_ratio is not None and image.width >= cfg.max_wh_ratio * image.height:
        image = image.resize(size)
    else:
        image = ImageOps.pad(image, size, color=PAD_COLOR)
    return np.asarray(image, dtype=np.uint8)


def to_patches(pixels: torch.Tensor, patch: int) -> torch.Tensor:
    """Fitted pixels (uint8 ``[height, width, 3]``) as the ViT reads them: ``[rows * cols, 3,
    p, p]`` in reading order, values ``(x / 255 - 0.5) / 0.5`` in fp32 (the model rounds them
    to its dtype, as the reference to bf16)."""
    h, w, _ = pixels.shape
    x = pixels.permute(2, 0, 1).float() / 255
    x = (x - 0.5) / 0.5
    rows, cols = h // patch, w // patch
    x = x.reshape(3, rows, patch, cols, patch).permute(1, 3, 0, 2, 4)
    return x.reshape(rows * cols, 3, patch, patch)


def patches(image, grid: ImageGrid, cfg: VisionConfig) -> torch.Tensor:
    """``image`` (RGB) as the ViT reads it: ``fit``, then ``to_patches``."""
    return to_patches(torch.from_numpy(fit(image, grid, cfg).copy()), grid.patch)
