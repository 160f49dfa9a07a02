"""The FP8 / FP4 linear that reads weights as stored (``engramrt.kernels.stored_linear``) against
a float64 product of the same exact values (activations through ``act_quant``, weights decoded
by ``quant``'s dequantisers, themselves tested against Fraction oracles): equal up to the order
of fp32 sums, on random shapes with partial tiles, split K and both formats."""

from __future__ import annotations

import pytest
import torch

from engramrt.kernels.stored_linear import (
    group_tile_rows,
    group_tiles,
    grouped_stored_linear,
    stored_linear,
)
from engramrt.models.deepseek_v41 import quant

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

SHAPES = [  # (fp4, M, N, K): partial N and K tiles, split K (few rows, long K), many rows
    (False, 1, 70, 96),
    (False, 3, 40, 1024),
    (False, 37, 96, 160),
    (True, 1, 48, 128),
    (True, 2, 64, 1088),
    (True, 33, 40, 64),
]


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
        got16 = stored_linear(
            a.to(DEVICE, torch.bfloat16), stored.to(DEVICE), scale.to(DEVICE), fp4
        ).cpu()
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
    assert not torch.equal(
        stored_linear(a.to(DEVICE), swapped.to(DEVICE), scale.to(DEVICE), True).cpu(), base
    )
    bumped = scale.view(torch.uint8).clone()
    bumped[5, 1] += 1
    assert not torch.equal(
        stored_linear(
            a.to(DEVICE), stored.to(DEVICE), bumped.view(torch.float8_e8m0fnu).to(DEVICE), True
        ).cpu(),
        base,
    )


@pytest.mark.parametrize("bm", [1, 4, 16])
def test_group_tiles_cover_each_experts_rows_once(bm: int) -> None:
    """Tiles against a brute-force listing: each expert's sorted rows cut into ``bm``-row
    tiles in order, then empty tiles; experts with no rows get none."""
    g = torch.Generator().manual_seed(bm)
    for _ in range(20):
        counts = torch.randint(0, 9, (6,), generator=g) * torch.randint(0, 2, (6,), generator=g)
        rows = int(counts.sum())
        want, start = [], 0
        for e, c in enumerate(counts.tolist()):
            want += [(e, lo, min(lo + bm, start + c)) for lo in range(start, start + c, bm)]
            start += c
        got = group_tiles(counts, rows, bm).tolist()
        assert len(got) == -(-rows // bm) + 6
        assert [tuple(t) for t in got[: len(want)]] == want
        assert all(lo == hi == 0 for _, lo, hi in got[len(want) :])


@pytest.mark.parametrize(
    ("fp4", "rows"),
    [(True, 5), (True, 40), (False, 30)],  # one-row tiles, then 16-row ones
)
def test_grouped_stored_linear_is_each_rows_expert_product(fp4, rows) -> None:
    """Rows sorted by expert (some experts without rows) against each row's own expert's exact
    product, within the fp32 sum-order bound."""
    g = torch.Generator().manual_seed(rows)
    e, n, k = 5, 48, 96 if fp4 else 64
    quantise = quant.fp4_weight if fp4 else quant.fp8_weight
    stored = [quantise(torch.randn(n, k, generator=g) / k**0.5) for _ in range(e)]
    dequant = quant.dequant_fp4_weight if fp4 else quant.dequant_fp8_weight
    expert = torch.randint(0, e - 1, (rows,), generator=g).sort().values  # expert 4: no rows
    counts = torch.bincount(expert, minlength=e)
    a = quant.act_roundtrip(torch.randn(rows, k, generator=g))
    w = torch.stack([s[0] for s in stored]).to(DEVICE)
    s = torch.stack([s[1] for s in stored]).to(DEVICE)
    tiles = group_tiles(counts, rows, group_tile_rows(rows, e, fp4)).to(DEVICE)
    got = grouped_stored_linear(a.to(DEVICE), w, s, fp4, tiles).cpu().double()
    full = [dequant(*st, torch.float64) for st in stored]
    exact = torch.stack([a[i].double() @ full[x].T for i, x in enumerate(expert.tolist())])
    bound = (
        torch.stack([a[i].double().abs() @ full[x].abs().T for i, x in enumerate(expert.tolist())])
        * 2**-16
    )
    assert bool(((got - exact).abs() <= bound).all())
