"""The one-launch round trips (``engramrt.kernels.quant_roundtrip``) bit for bit against
``engramrt.models.deepseek_v41.quant``'s torch path (itself tested against Fraction oracles in
``tests/model/test_quant.py``): random values over a wide range, zero blocks, every grid point
and every midpoint between two (ties to even), values past saturation, bf16 and fp32."""

from __future__ import annotations

import pytest
import torch

from engramrt.kernels.quant_roundtrip import ACT, BLOCK_OF, FP4_E4M3, FP4_POW2, roundtrip
from engramrt.models.deepseek_v41 import quant

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TORCH = {
    ACT: quant.act_roundtrip,
    FP4_POW2: lambda x: quant.fp4_roundtrip(x, quant.POW2_SCALE),
    FP4_E4M3: lambda x: quant.fp4_roundtrip(x, quant.E4M3_SCALE),
}


def grid(kind: int) -> torch.Tensor:
    """The format's positive values: E4M3's finite ones, or E2M1's."""
    if kind == ACT:
        v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        return v[torch.isfinite(v) & (v > 0)].unique()
    return quant.E2M1_VALUES[1:8]


def adversarial(kind: int, dtype: torch.dtype) -> torch.Tensor:
    """Every grid point and every midpoint between two, both signs, in blocks whose amax makes
    the scale exactly one (times a random power of two), so they stay on points and ties after
    scaling; plus zero blocks and values past the top."""
    g = torch.Generator().manual_seed(kind)
    block, top = BLOCK_OF[kind], 256.0 if kind == ACT else 6.0
    points = grid(kind)
    points = points[points <= top]
    vals = torch.cat([points, (points[1:] + points[:-1]) / 2, points[:1] / 2])
    vals = torch.cat([vals, -vals])
    pieces = list(vals.split(block - 1))
    pieces[-1] = torch.cat([pieces[-1], torch.zeros(block - 1 - len(pieces[-1]))])
    blocks = [
        torch.cat([p, torch.tensor([top])]) * 2.0 ** torch.randint(-6, 6, (1,), generator=g)
        for p in pieces
    ]
    blocks += [torch.zeros(block), torch.linspace(-1e6, 1e6, block)]
    if len(blocks) % 2:
        blocks.append(torch.zeros(block))
    return torch.stack(blocks).reshape(-1, 2 * block).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", [ACT, FP4_POW2, FP4_E4M3])
def test_roundtrip_is_bitwise_the_torch_path(kind: int, dtype: torch.dtype) -> None:
    """Values equal, and signs: a negative value rounded to zero stays -0, as torch's casts
    keep it."""
    g = torch.Generator().manual_seed(7)
    wide = (
        torch.randn(33, 3 * BLOCK_OF[kind], generator=g)
        * 10.0 ** torch.randint(-5, 5, (33, 1), generator=g)
    ).to(dtype)
    for x in (wide, adversarial(kind, dtype)):
        want = TORCH[kind](x)
        got = roundtrip(x.to(DEVICE), kind).cpu()
        assert got.dtype == dtype
        assert torch.equal(got, want), (got - want).abs().max()
        assert torch.equal(torch.signbit(got), torch.signbit(want))  # a zero's sign too


def test_roundtrip_keeps_the_shape_and_refuses_partial_blocks() -> None:
    x = torch.randn(2, 3, 64, device=DEVICE)
    assert roundtrip(x, ACT).shape == x.shape
    assert roundtrip(x[:, :0], ACT).shape == (2, 0, 64)
    with pytest.raises(ValueError, match="multiple of 16"):
        roundtrip(torch.randn(4, 24, device=DEVICE), FP4_E4M3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_codes_are_act_quants(dtype: torch.dtype) -> None:
    """The codes and scales the FP8 tensor cores take, bit for bit ``quant.act_quant``'s, on
    wide random values and the adversarial grid (ties, zero blocks, saturation); the values
    FP4 weights take, bit for bit the round trip's in bf16 (exact there)."""
    from engramrt.kernels.quant_roundtrip import act_codes

    g = torch.Generator().manual_seed(11)
    wide = torch.randn(9, 96, generator=g) * 10.0 ** torch.randint(-5, 5, (9, 1), generator=g)
    wide[0, :5] = torch.tensor([-0.0, -1e-9, 0.0, 1e-9, 100.0])  # zeros keep their sign
    for x in (wide.to(dtype), adversarial(ACT, dtype)):
        codes, scale, values = act_codes(x.to(DEVICE), values=True)
        want_codes, want_scale = quant.act_quant(x)
        assert torch.equal(codes.cpu().view(torch.uint8), want_codes.view(torch.uint8))
        assert torch.equal(scale.cpu(), want_scale)
        want = quant.act_roundtrip(x.float())
        assert torch.equal(values.cpu().float(), want)  # exact in bf16
        assert act_codes(x.to(DEVICE))[2] is None
