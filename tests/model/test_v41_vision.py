"""V4.1's vision tower and aligner (``models/deepseek_v41/vision.py``) against a restatement in
float64 written from the reference's description, not its code: every patch's angles from its
row and column, each head's attention as an explicit softmax over all patches, the aligner's
cells gathered index by index (zeros past the grid's edge), on random grids of odd and even
sizes; and the tensor names a released checkpoint stores."""

from __future__ import annotations

import math

import pytest
import torch

from engramrt.models.deepseek_v41.images import ImageGrid, VisionConfig
from engramrt.models.deepseek_v41.vision import NORM_EPS, Aligner, VisionTower

SMALL = VisionConfig(
    num_hidden_layers=2, hidden_size=32, num_attention_heads=4, intermediate_size=48, patch_size=2
)


def _randomise(module: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3 + (p.ndim == 1))


def _norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + NORM_EPS) * w


def _tower_oracle(tower: VisionTower, patches: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    cfg = tower.cfg
    sd = {k: v.double() for k, v in tower.state_dict().items()}
    heads, hd = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    n = rows * cols
    x = patches.double().reshape(n, -1) @ sd["patch_embed.proj.weight"].T
    x = x + sd["patch_embed.proj.bias"]
    # a patch's angle j: its row times frequency j for j < hd/4, its column times j - hd/4 after
    freqs = [cfg.rope_theta ** (-2 * j / (hd // 2)) for j in range(hd // 4)]
    angle = torch.tensor(
        [[(i // cols) * f for f in freqs] + [(i % cols) * f for f in freqs] for i in range(n)],
        dtype=torch.float64,
    )
    half = hd // 2
    for b in range(cfg.num_hidden_layers):
        w = {k.split(f"blocks.{b}.", 1)[1]: v for k, v in sd.items() if f"blocks.{b}." in k}
        h = _norm(x, w["norm1.weight"])
        qkv = h @ w["attn.wqkv.weight"].T + w["attn.wqkv.bias"]
        out = torch.zeros(n, cfg.hidden_size, dtype=torch.float64)
        turn = torch.polar(torch.ones_like(angle), angle)
        for head in range(heads):
            q, k, v = (qkv[:, i * cfg.hidden_size + head * hd :][:, :hd] for i in range(3))
            # element i of a head's first half and element i of its second: one complex number
            q, k = (torch.complex(t[:, :half], t[:, half:]) * turn for t in (q, k))
            q, k = (torch.cat([z.real, z.imag], dim=1) for z in (q, k))
            scores = q @ k.T / math.sqrt(hd)
            p = torch.exp(scores - scores.max(1, keepdim=True).values)
            out[:, head * hd : (head + 1) * hd] = (p / p.sum(1, keepdim=True)) @ v
        x = x + out @ w["attn.wo.weight"].T + w["attn.wo.bias"]
        h = _norm(x, w["norm2.weight"])
        gate, up = (h @ w["mlp.w1.weight"].T).chunk(2, dim=1)
        x = x + (gate * torch.sigmoid(gate) * up) @ w["mlp.w2.weight"].T
    return _norm(x, sd["norm.weight"])


def _aligner_oracle(al: Aligner, x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    d, c = al.d, x.shape[1]
    sd = {k: v.double() for k, v in al.state_dict().items()}
    cells = []
    for r0 in range(0, rows, d):
        for c0 in range(0, cols, d):
            feat = []
            for ch in range(c):
                for i in range(d):
                    for j in range(d):
                        r, q = r0 + i, c0 + j
                        feat.append(float(x[r * cols + q, ch]) if r < rows and q < cols else 0.0)
            cells.append(feat)
    h = torch.tensor(cells, dtype=torch.float64) @ sd["w1.weight"].T + sd["w1.bias"]
    h = 0.5 * h * (1 + torch.erf(h / math.sqrt(2)))
    return h @ sd["w2.weight"].T + sd["w2.bias"]


@pytest.mark.parametrize("seed", range(4))
def test_tower_and_aligner_equal_the_restatement_on_random_grids(seed: int) -> None:
    g = torch.Generator().manual_seed(100 + seed)
    rows, cols = (int(v) for v in torch.randint(1, 8, (2,), generator=g))
    p, d = SMALL.patch_size, SMALL.downsample_ratio
    grid = ImageGrid(rows * p, cols * p, -(-rows // d), -(-cols // d), p)
    tower, al = VisionTower(SMALL, torch.float32), Aligner(SMALL, 24, torch.float32)
    _randomise(tower, seed)
    _randomise(al, seed + 50)
    patches = torch.randn(rows * cols, 3, p, p, generator=g)
    with torch.no_grad():
        feats = tower(patches, grid)
        tokens = al(feats, grid)
    want = _tower_oracle(tower, patches, rows, cols)
    torch.testing.assert_close(feats.double(), want, rtol=1e-4, atol=1e-4)
    assert tokens.shape == (grid.rows * grid.cols, 24)
    torch.testing.assert_close(
        tokens.double(), _aligner_oracle(al, feats, rows, cols), rtol=1e-4, atol=1e-4
    )


def test_the_rotation_depends_on_where_a_patch_sits() -> None:
    """A tower whose attention sees only positions: one grid's rows read in another order give
    other features (a 1D or missing rotary embedding would give the same, permuted)."""
    tower = VisionTower(SMALL, torch.float32)
    _randomise(tower, 7)
    grid = ImageGrid(6, 6, 1, 1, 2)
    patches = torch.randn(9, 3, 2, 2, generator=torch.Generator().manual_seed(3))
    perm = torch.tensor([0, 3, 6, 1, 4, 7, 2, 5, 8])  # the grid transposed
    with torch.no_grad():
        a, b = tower(patches, grid), tower(patches[perm], grid)
    assert not torch.allclose(a[perm], b, atol=1e-3)


def test_a_patch_count_off_the_grid_is_refused() -> None:
    with pytest.raises(ValueError, match="5 patches for a grid of 2 x 3"):
        VisionTower(SMALL, torch.float32)(torch.zeros(5, 3, 2, 2), ImageGrid(4, 6, 1, 1, 2))


def test_tensor_names_and_shapes_are_the_released_checkpoints() -> None:
    """V41-ARCH's list for Flash: patch_embed [1024, 588], per block norm1, attn.wqkv and wo
    with biases, norm2, mlp.w1 [5632, 1024] and w2 without; the aligner's w1 and w2 with
    biases from 9 cells of 1024 to the model's 4096 (here) width."""
    cfg = VisionConfig(num_hidden_layers=2)
    with torch.device("meta"):
        tower, al = VisionTower(cfg, torch.bfloat16), Aligner(cfg, 4096, torch.bfloat16)
    shapes = {f"vision.{k}": tuple(v.shape) for k, v in tower.state_dict().items()}
    shapes |= {f"aligner.{k}": tuple(v.shape) for k, v in al.state_dict().items()}
    block = {
        "norm1.weight": (1024,),
        "attn.wqkv.weight": (3072, 1024),
        "attn.wqkv.bias": (3072,),
        "attn.wo.weight": (1024, 1024),
        "attn.wo.bias": (1024,),
        "norm2.weight": (1024,),
        "mlp.w1.weight": (5632, 1024),
        "mlp.w2.weight": (1024, 2816),
    }
    want = {
        "vision.patch_embed.proj.weight": (1024, 588),
        "vision.patch_embed.proj.bias": (1024,),
        "vision.norm.weight": (1024,),
        "aligner.w1.weight": (4096, 9216),
        "aligner.w1.bias": (4096,),
        "aligner.w2.weight": (4096, 4096),
        "aligner.w2.bias": (4096,),
    }
    want |= {f"vision.blocks.{b}.{k}": s for b in range(2) for k, s in block.items()}
    assert shapes == want
    assert (
        tower.norm.weight.dtype == torch.float32
        and tower.blocks[0].attn.wo.weight.dtype == torch.bfloat16
    )
