"""The FP8 / FP4 linear that reads weights as stored (``engramrt.kernels.stored_linear``) against
a float64 product of the same exact values (activations through ``act_quant``, weights decoded
by ``quant``'s dequantisers, themselves tested against Fraction oracles): equal up to the order
of fp32 sums, on random shapes with partial tiles, split K and both formats."""

from __future__ import annotations

import pytest
import torch

from engramrt.kernels.stored_linear import stored_linear
from engramrt.model import quant

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SHAPES = [  # (fp4, M, N, K): partial N and K tiles, split K (few rows, long K), many rows
    (False, 1, 70, 96), (False, 3, 40, 1024), (False, 37, 96, 160),
    (True, 1, 48, 128), (True, 2, 64, 1088), (True, 33, 40, 64),
]  # fmt: skip


@pytest.mark.parametrize(("fp4", "m", "n", "k"), SHAPES)
def test_stored_linear_is_the_exact_product_up_to_sum_order(fp4, m, n, k) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, k) / k**0.5  # scales that vary
    stored, scale = quant.fp4_weight(w) if fp4 else quant.fp8_weight(w)
    a = quant.act_roundtrip(torch.randn(m, k, generator=g) * 3)
    dequant = quant.dequant_fp4_weight if fp4 else quant.dequant_fp8_weight
    exact = a.double() @ dequant(stored, scale, torch.float64).T
    got = stored_linear(a.to(DEVICE), stored.to(DEVICE), scale.to(DEVICE), fp4).cpu()
    # fp32 sums in another order: within a few ulps of the sum of |terms|
    bound = (a.double().abs() @ dequant(stored, scale, torch.float64).abs().T) * 2**-16
    assert got.dtype == torch.float32
    assert bool(((got.double() - exact).abs() <= bound).all())
    if DEVICE == "cuda":  # bf16 activations: the torch path's bf16 output, to one ulp
        got16 = stored_linear(a.to(DEVICE, torch.bfloat16), stored.to(DEVICE),
                              scale.to(DEVICE), fp4).cpu()  # fmt: skip
        want16 = quant.quantized_linear(a.bfloat16(), dequant(stored, scale, torch.bfloat16))
        torch.testing.assert_close(got16, want16, rtol=2**-7, atol=1e-6)


def test_a_wrong_scale_or_nibble_order_is_seen() -> None:
    """The oracle can tell: swapping each byte's nibbles, or one scale byte, moves the result."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(32, 64, generator=g)
    stored, scale = quant.fp4_weight(w)
    a = quant.act_roundtrip(torch.randn(2, 64, generator=g))
    base = stored_linear(a.to(DEVICE), stored.to(DEVICE), scale.to(DEVICE), True).cpu()
    b = stored.view(torch.uint8)
    swapped = ((b << 4) | (b >> 4)).view(torch.int8)
    assert not torch.equal(stored_linear(a.to(DEVICE), swapped.to(DEVICE), scale.to(DEVICE),
                                         True).cpu(), base)  # fmt: skip
    bumped = scale.view(torch.uint8).clone()
    bumped[5, 1] += 1
    assert not torch.equal(stored_linear(a.to(DEVICE), stored.to(DEVICE),
                                         bumped.view(torch.float8_e8m0fnu).to(DEVICE),
                                         True).cpu(), base)  # fmt: skip
