"""DeepSeek-V4.1's vision tower: a ViT that attends over one image's patches at once (no causal
mask) with a 2D rotary embedding, and the aligner that folds each ``d x d`` cell of its output
into one row of the language model's width. Its tensors carry the checkpoint's names
(``vision.*``, ``aligner.*``), so a released checkpoint loads into it as stored.

The reference's rounding points are kept: bf16 linears, each norm in fp32 rounded once, the
rotation in fp32 rounded once, attention in the model's dtype. ``images.patches`` gives its
input; the span the aligner's rows fill is ``images.ImageGrid``'s.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engramrt.model.layers import rms_norm
from engramrt.models.deepseek_v41.images import ImageGrid, VisionConfig

NORM_EPS = 1e-6  # the reference's RMSNorm default: vision_config names none


def rotary_angles(rows: int, cols: int, head_dim: int, theta: float) -> torch.Tensor:
    """The angles of each patch [rows * cols, head_dim / 2] in fp32: the first half of the
    frequencies turn with the patch's row, the second half with its column."""
    quarter = head_dim // 4
    inv_freq = 1.0 / theta ** (torch.arange(0, 2 * quarter, 2, dtype=torch.float32) / (2 * quarter))
    r = torch.arange(rows, dtype=torch.float32).repeat_interleave(cols)
    c = torch.arange(cols, dtype=torch.float32).repeat(rows)
    return torch.cat([r[:, None] * inv_freq, c[:, None] * inv_freq], dim=1)


def rotate(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """``x`` [n, heads, head_dim] turned by ``angles`` [n, head_dim / 2]: element i of the first
    half paired with element i of the second (the halves' layout), in fp32, rounded once."""
    a, b = x.float().chunk(2, dim=-1)
    cos, sin = angles.cos()[:, None], angles.sin()[:, None]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1).to(x.dtype)


class VisionNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, NORM_EPS)


class VisionAttention(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype):
        super().__init__()
        self.heads = cfg.num_attention_heads
        self.wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, dtype=dtype)
        self.wo = nn.Linear(cfg.hidden_size, cfg.hidden_size, dtype=dtype)

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.wqkv(x).view(n, 3, self.heads, -1).unbind(1)
        q, k = rotate(q, angles), rotate(k, angles)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1))
        return self.wo(o.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    """SwiGLU with gate and up stacked in ``w1`` (gate first), no biases."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype):
        super().__init__()
        inter = cfg.intermediate_size
        self.w1 = nn.Linear(cfg.hidden_size, 2 * inter, bias=False, dtype=dtype)
        self.w2 = nn.Linear(inter, cfg.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype):
        super().__init__()
        self.norm1, self.norm2 = VisionNorm(cfg.hidden_size), VisionNorm(cfg.hidden_size)
        self.attn = VisionAttention(cfg, dtype)
        self.mlp = VisionMLP(cfg, dtype)

    def forward(self, x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), angles)
        return x + self.mlp(self.norm2(x))


class PatchEmbed(nn.Module):
    def __init__(self, cfg: VisionConfig, dtype: torch.dtype):
        super().__init__()
        self.proj = nn.Linear(3 * cfg.patch_size**2, cfg.hidden_size, dtype=dtype)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.flatten(1).to(self.proj.weight.dtype))


class VisionTower(nn.Module):
    """``vision.*``: one image's patches [n, 3, p, p] (``images.patches``) to [n, hidden]."""

    def __init__(self, cfg: VisionConfig, dtype: torch.dtype):
        super().__init__()
        self.cfg = cfg
        self.patch_embed = PatchEmbed(cfg, dtype)
        self.blocks = nn.ModuleList(VisionBlock(cfg, dtype) for _ in range(cfg.num_hidden_layers))
        self.norm = VisionNorm(cfg.hidden_size)

    def forward(self, patches: torch.Tensor, grid: ImageGrid) -> torch.Tensor:
        if patches.shape[0] != grid.patch_rows * grid.patch_cols:
            raise ValueError(
                f"{patches.shape[0]} patches for a grid of {grid.patch_rows} x {grid.patch_cols}"
            )
        head_dim = self.cfg.hidden_size // self.cfg.num_attention_heads
        angles = rotary_angles(grid.patch_rows, grid.patch_cols, head_dim, self.cfg.rope_theta)
        x = self.patch_embed(patches)
        angles = angles.to(x.device)
        for block in self.blocks:
            x = block(x, angles)
        return self.norm(x)


class Aligner(nn.Module):
    """``aligner.*``: the tower's output on its patch grid, cut into ``d x d`` cells (the grid
    padded with zeros on the right and bottom to whole cells), each cell's features concatenated
    channel by channel (a channel's ``d * d`` values in reading order), then a GELU MLP to the
    model's width: one row per IMAGE slot of the span, in reading order."""

    def __init__(self, cfg: VisionConfig, dim: int, dtype: torch.dtype):
        super().__init__()
        self.d = cfg.downsample_ratio
        self.w1 = nn.Linear(cfg.hidden_size * self.d**2, dim, dtype=dtype)
        self.w2 = nn.Linear(dim, dim, dtype=dtype)

    def forward(self, x: torch.Tensor, grid: ImageGrid) -> torch.Tensor:
        d, h, w = self.d, grid.patch_rows, grid.patch_cols
        x = x.view(h, w, -1).permute(2, 0, 1)
        x = F.pad(x, (0, -w % d, 0, -h % d))
        cells = F.unfold(x[None], d, stride=d)[0].T  # [rows * cols, channels * d * d]
        return self.w2(F.gelu(self.w1(cells)))


def attach(model: nn.Module, cfg: VisionConfig, dtype: torch.dtype) -> None:
    """``model``'s tower (``vision``), aligner (``aligner``) and the span's learned rows
    (``image_start``, ``image_end``, ``image_newline``), under the checkpoint's names."""
    dim = model.cfg.hidden_size
    model.vision = VisionTower(cfg, dtype)
    model.aligner = Aligner(cfg, dim, dtype)
    for name in ("image_start", "image_end", "image_newline"):
        setattr(model, name, nn.Parameter(torch.zeros(dim, dtype=dtype), requires_grad=False))


def encode(model: nn.Module, patches: torch.Tensor, grid: ImageGrid) -> torch.Tensor:
    """One image's span as the prompt's embedding rows [``grid.tokens``, dim] in the model's
    dtype: the learned start, newline and end rows around the aligner's rows in reading order
    (``ImageGrid.types``)."""
    rows = model.aligner(model.vision(patches, grid), grid)
    cols = grid.cols
    start, newline, end = model.image_start, model.image_newline, model.image_end
    lines = torch.cat([rows.view(grid.rows, cols, -1), newline.expand(grid.rows, 1, -1)], dim=1)
    return torch.cat([start[None], lines.flatten(0, 1), end[None]]).to(model.dtype)
