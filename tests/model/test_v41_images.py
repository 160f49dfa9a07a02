"""An image before V4.1's vision tower (``models/deepseek_v41/images.py``): the grid plan against
sizes worked out by hand from the reference's steps and against its invariants on random sizes
(the token budget, whole patches, the aligner's ceil), the patches against the pixels read one
by one, the padding centred, and decoding: EXIF orientation applied, a broken or oversized
image a ValueError saying why."""

from __future__ import annotations

import io
import math
import random

import numpy as np
import pytest
import torch

from engramrt.models.deepseek_v41.images import (
    IMAGE,
    IMAGE_END,
    IMAGE_NEW_LINE,
    IMAGE_START,
    PAD_COLOR,
    VisionConfig,
    decode,
    patches,
    plan_grid,
)

Image = pytest.importorskip("PIL.Image")
RELEASED = VisionConfig()


@pytest.mark.parametrize(
    ("size", "want"),
    [
        # 1008 = 72 patches a side, 24 cells: 24 x 25 + 2 = 602 tokens
        ((1000, 1000), (1008, 1008, 24, 24)),
        # under min_pixels: scaled by sqrt(295936 / 10^4) to 544, rounded up to 39 patches
        ((100, 100), (546, 546, 13, 13)),
        # 72 x 96 cells = 6,986 tokens: shrunk by 36 cells x 42 px / 4000 to 81 x 108 patches
        ((4000, 3000), (1134, 1512, 27, 36)),
    ],
)
def test_plans_worked_out_by_hand(size, want) -> None:
    grid = plan_grid(*size, RELEASED)
    assert (grid.height, grid.width, grid.rows, grid.cols) == want


@pytest.mark.parametrize(
    "cfg",
    [RELEASED, VisionConfig(max_image_tokens=64, min_pixels=0), VisionConfig(max_wh_ratio=4)],
)
def test_every_plan_keeps_the_budget_in_whole_patches(cfg: VisionConfig) -> None:
    rng = random.Random(cfg.max_image_tokens)
    p, d = cfg.patch_size, cfg.downsample_ratio
    for _ in range(2000):
        w, h = (int(math.exp(rng.uniform(0, math.log(12000)))) for _ in range(2))
        grid = plan_grid(w, h, cfg)
        assert grid.height % p == 0 and grid.width % p == 0 and grid.height and grid.width
        assert (grid.rows, grid.cols) == (-(-grid.patch_rows // d), -(-grid.patch_cols // d))
        assert grid.tokens <= cfg.max_image_tokens, (w, h, grid)
        types = grid.types().tolist()
        assert len(types) == grid.tokens == grid.rows * (grid.cols + 1) + 2
        assert types[0] == IMAGE_START and types[-1] == IMAGE_END
        body = types[1:-1]
        assert body == ([IMAGE] * grid.cols + [IMAGE_NEW_LINE]) * grid.rows
        ceil_grid = (math.ceil(h / p), math.ceil(w / p))
        if w * h >= cfg.min_pixels and (cfg.max_wh_ratio is None or w <= h * cfg.max_wh_ratio):
            rows, cols = (-(-n // d) for n in ceil_grid)
            if rows * (cols + 1) + 2 <= cfg.max_image_tokens:  # fits: only rounded up
                assert (grid.patch_rows, grid.patch_cols) == ceil_grid


def _rgb(w: int, h: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy(), "RGB"), pixels


def test_patches_are_the_pixels_in_reading_order() -> None:
    cfg = VisionConfig(patch_size=4, min_pixels=0)
    grid = plan_grid(20, 12, cfg)  # already whole patches: no resize, no pad
    image, pixels = _rgb(20, 12, 0)
    got = patches(image, grid, cfg)
    assert got.shape == (3 * 5, 3, 4, 4) and got.dtype == torch.float32
    for k in range(len(got)):
        r, c = divmod(k, 5)
        for ch in range(3):
            for i in range(4):
                for j in range(4):
                    want = (pixels[r * 4 + i, c * 4 + j, ch].item() / 255 - 0.5) / 0.5
                    assert got[k, ch, i, j].item() == pytest.approx(want, abs=1e-6)


def test_a_narrower_image_is_centred_in_the_pad_colour() -> None:
    cfg = VisionConfig(patch_size=4, min_pixels=0)
    image, _ = _rgb(8, 16, 1)
    grid = plan_grid(16, 16, cfg)
    x = patches(image, grid, cfg).reshape(4, 4, 3, 4, 4).permute(2, 0, 3, 1, 4).reshape(3, 16, 16)
    pad = torch.tensor(PAD_COLOR, dtype=torch.float32)[:, None, None] / 255 * 2 - 1
    assert torch.allclose(x[:, :, :4], pad.expand(3, 16, 4), atol=1e-6)
    assert torch.allclose(x[:, :, 12:], pad.expand(3, 16, 4), atol=1e-6)
    inner = torch.from_numpy(np.asarray(image, dtype=np.float32)).permute(2, 0, 1)
    assert torch.allclose(x[:, :, 4:12], inner / 255 * 2 - 1, atol=1e-6)  # same size: as is


def _encoded(image, fmt: str, **kw) -> bytes:
    out = io.BytesIO()
    image.save(out, fmt, **kw)
    return out.getvalue()


def test_decoding_applies_exif_orientation_and_names_what_is_wrong() -> None:
    image, _ = _rgb(6, 4, 2)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees clockwise to view
    turned = decode(_encoded(image, "PNG", exif=exif), max_pixels=100)
    assert turned.size == (4, 6) and turned.mode == "RGB"
    assert turned.tobytes() == image.transpose(Image.Transpose.ROTATE_270).tobytes()
    assert decode(_encoded(image, "PNG"), 100).tobytes() == image.tobytes()
    with pytest.raises(ValueError, match="24 pixels .* over 23"):
        decode(_encoded(image, "PNG"), max_pixels=23)
    with pytest.raises(ValueError, match="not a decodable image"):
        decode(b"GIF89a not really", 100)
    with pytest.raises(ValueError, match="not a decodable image"):
        decode(_encoded(image, "PNG")[:60], 100)  # cut short


def test_vision_config_from_a_checkpoint() -> None:
    released = {
        "model_type": "deepseek_v41_vision",
        "num_hidden_layers": 32,
        "hidden_size": 1024,
        "num_attention_heads": 16,
        "intermediate_size": 2816,
        "patch_size": 14,
        "rope_theta": 10000,
        "downsample_ratio": 3,
        "max_image_tokens": 1024,
        "min_pixels": 295936,
        "max_wh_ratio": None,
    }
    text = {"num_hidden_layers": 43, "hidden_size": 4096}  # the language model's, beside it
    assert VisionConfig.from_config({**text, "vision_config": released}) == RELEASED
    assert VisionConfig.from_config(text) is None
    off = {**released, "num_hidden_layers": 0}
    assert VisionConfig.from_config({**text, "vision_config": off}) is None
    with pytest.raises(ValueError, match="max_image_tokens"):
        VisionConfig.from_config({"vision_config": {**released, "max_image_tokens": 3}})
    # DeepSeek's inference/config.json spells them flat, beside the language model's keys
    flat = {
        "dim": 4096,
        "vision_n_layers": 32,
        "vision_dim": 1024,
        "vision_n_heads": 16,
        "vision_inter_dim": 2816,
        "vision_patch_size": 14,
        "vision_rope_theta": 10000.0,
        "vision_downsample_ratio": 3,
        "vision_max_n_token": 1024,
        "vision_min_pixels": 295936,
        "vision_max_wh_ratio": None,
    }
    assert VisionConfig.from_config({**text, **flat}) == RELEASED
    assert VisionConfig.from_config({**flat, "vision_n_layers": 0}) is None
    assert VisionConfig.from_config({**flat, "vision_max_n_token": 64}).max_image_tokens == 64
