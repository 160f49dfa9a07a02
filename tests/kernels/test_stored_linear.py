"""The FP8 / FP4 linear that reads weights as stored (``engramrt.kernels.stored_linear``) against
a float64 product of the same exact values (activations through ``act_quant``, weights decoded
by ``quant``'s dequantisers, themselves tested against Fraction oracles): equal up to the order
of fp32 sums, on random shapes with partial tiles, split K, both formats and FP4 rows of odd
block counts. The kernel reads FP4 bytes paired (``quant.pair_fp4``, the layout the MoE makes
at load); the oracles decode the checkpoint's order."""

from __future__ import annotations

import pytest
import torch

from engramrt.kernels import stored_linear as module
from engramrt.kernels.stored_linear import (
    Added,
    group_tile_rows,
    group_tiles,
    grouped_stored_linear,
    grouped_values_linear,
    stored_linear,
)
from engramrt.models.deepseek_v41 import quant
from engramrt.models.deepseek_v41.moe import ExpertPairs

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def held(stored: torch.Tensor, fp4: bool) -> torch.Tensor:
    """A stored weight as the kernel reads it: FP4 paired, FP8 as stored."""
    return quant.pair_fp4(stored) if fp4 else stored


SHAPES = [  # (fp4, M, N, K): partial N and K tiles, split K (few rows, long K), many rows
    (False, 1, 70, 96),
    (False, 3, 40, 1024),
    (False, 37, 96, 160),
    (True, 1, 48, 128),
    (True, 2, 64, 1088),
    (True, 33, 40, 64),
    (True, 3, 40, 160),  # five blocks: a pair, a pair, the odd one
    (True, 17, 72, 32),  # one block: only the odd one
    (True, 2, 64, 2080),  # 65 blocks: the odd one ends the last split
]


@pytest.mark.parametrize(("fp4", "m", "n", "k"), SHAPES)
def test_stored_linear_is_the_exact_product_up_to_sum_order(fp4, m, n, k) -> None:
    _assert_exact_product(fp4, m, n, k)


@pytest.mark.parametrize(("fp4", "blocks"), [(True, 4), (False, 1), (False, 2), (False, 4)])
def test_longer_loads_and_more_splits_give_the_product(fp4, blocks, monkeypatch) -> None:
    """Settings with 1, 2 or 4 blocks a step (each step's scales loaded in the one before, and
    read as columns) and three splits (the odd last FP4 block inside the last split, after
    whole pairs): the same oracle."""
    monkeypatch.setattr(module, "settings", lambda *a: (64, blocks, 4, 3, 3))
    _assert_exact_product(fp4, 3, 40, 2080)


def _assert_exact_product(fp4: bool, m: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 1, k) / k**0.5  # scales that vary
    stored, scale = quant.fp4_weight(w) if fp4 else quant.fp8_weight(w)
    a = quant.act_roundtrip(torch.randn(m, k, generator=g) * 3)
    dequant = quant.dequant_fp4_weight if fp4 else quant.dequant_fp8_weight
    exact = a.double() @ dequant(stored, scale, torch.float64).T
    w = held(stored, fp4).to(DEVICE)
    got = stored_linear(a.to(DEVICE), w, scale.to(DEVICE), fp4).cpu()
    # fp32 sums in another order: within a few ulps of the sum of |terms|; a GPU's FP8 tensor
    # cores add a block's 32 products keeping about 14 bits (DeepSeek-V3's report, sec. 3.3.2;
    # DeepSeek's own FP8 GEMMs take the same), so within 2**-12 of it there
    ulps = 2**-12 if DEVICE == "cuda" else 2**-16
    bound = (a.double().abs() @ dequant(stored, scale, torch.float64).abs().T) * ulps
    assert got.dtype == torch.float32
    assert bool(((got.double() - exact).abs() <= bound).all())
    if DEVICE == "cuda":  # bf16 activations: the same bound, plus the bf16 output's rounding
        got16 = stored_linear(a.to(DEVICE, torch.bfloat16), w, scale.to(DEVICE), fp4).cpu()
        assert bool(((got16.double() - exact).abs() <= bound + exact.abs() * 2**-8).all())


def test_a_wrong_scale_or_nibble_order_is_seen() -> None:
    """The oracle can tell: the checkpoint's order unpaired, swapping each byte's nibbles, or
    one scale byte, moves the result."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(32, 64, generator=g)
    stored, scale = quant.fp4_weight(w)
    a = quant.act_roundtrip(torch.randn(2, 64, generator=g))
    paired = quant.pair_fp4(stored)
    base = stored_linear(a.to(DEVICE), paired.to(DEVICE), scale.to(DEVICE), True).cpu()
    b = paired.view(torch.uint8)
    swapped = ((b << 4) | (b >> 4)).view(torch.int8)
    for wrong in (stored, swapped):
        got = stored_linear(a.to(DEVICE), wrong.to(DEVICE), scale.to(DEVICE), True).cpu()
        assert not torch.equal(got, base)
    bumped = scale.view(torch.uint8).clone()
    bumped[5, 1] += 1
    assert not torch.equal(
        stored_linear(
            a.to(DEVICE), paired.to(DEVICE), bumped.view(torch.float8_e8m0fnu).to(DEVICE), True
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
    [(True, 5), (True, 40), (False, 90)],  # 16-row tiles; 64-row ones (90 > 16 x 5)
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
    w = held(torch.stack([s[0] for s in stored]), fp4).to(DEVICE)
    s = torch.stack([s[1] for s in stored]).to(DEVICE)
    tiles = group_tiles(counts, rows, group_tile_rows(rows, e)).to(DEVICE)
    got = grouped_stored_linear(a.to(DEVICE), w, s, fp4, tiles).cpu().double()
    full = [dequant(*st, torch.float64) for st in stored]
    exact = torch.stack([a[i].double() @ full[x].T for i, x in enumerate(expert.tolist())])
    bound = torch.stack(
        [a[i].double().abs() @ full[x].abs().T for i, x in enumerate(expert.tolist())]
    ) * (2**-12 if DEVICE == "cuda" else 2**-16)  # as above
    assert bool(((got - exact).abs() <= bound).all())


@pytest.mark.parametrize("fp4", [True, False])
def test_every_stored_byte_decodes_exactly(fp4: bool) -> None:
    """Identity activations read the weight back: every output is one product, so the kernel's
    decoding (E2M1 codes moved into bf16 with their scale, two a bf16x2 multiply on a GPU;
    E4M3 bytes as they are) must give ``dequant``'s values bit for bit, over all 256 byte
    values and varied scales (FP4's up to the largest the kernel takes, 2**1)."""
    k = 64
    n = 256 // (k // 2) * 2 if fp4 else 256 // k * 32
    g = torch.Generator().manual_seed(3)
    every = torch.randperm(256, generator=g).to(torch.uint8)
    if fp4:
        stored = every.repeat(n * k // 2 // 256 + 1)[: n * k // 2].view(n, k // 2).view(torch.int8)
        top = quant.FP4_KERNEL_MAX_SCALE
        scale = torch.randint(top - 40, top + 1, (n, k // 32), generator=g, dtype=torch.uint8)
        scale[0, 0] = top  # the largest: values up to 12
        want = quant.dequant_fp4_weight(stored, scale.view(torch.float8_e8m0fnu), torch.float32)
    else:
        codes = every[(every & 0x7F) != 0x7F]  # E4M3's NaNs are no weight
        stored = codes.repeat(n * k // len(codes) + 1)[: n * k].view(n, k)
        stored = stored.view(torch.float8_e4m3fn)
        scale = torch.randint(100, 140, (n // 32, k // 32), generator=g, dtype=torch.uint8)
        want = quant.dequant_fp8_weight(stored, scale.view(torch.float8_e8m0fnu), torch.float32)
    eye = torch.eye(k)
    got = stored_linear(
        eye.to(DEVICE),
        held(stored, fp4).to(DEVICE),
        scale.view(torch.float8_e8m0fnu).to(DEVICE),
        fp4,
    )
    assert torch.equal(got.cpu(), want.T)


@pytest.mark.parametrize("fp4", [True, False])
def test_a_row_gives_the_same_bits_in_any_batch(fp4: bool) -> None:
    """Batch invariance: each row's output alone equals, bit for bit, the same row among other
    random rows (in batches of several sizes, at any place), with split K: the launch
    settings come from the weight's shape alone and the splits add in a fixed order."""
    g = torch.Generator().manual_seed(5 + fp4)
    n, k = 96, 256  # 8 blocks: two splits
    stored, scale = (quant.fp4_weight if fp4 else quant.fp8_weight)(
        torch.randn(n, k, generator=g) / k**0.5
    )
    stored, scale = held(stored, fp4).to(DEVICE), scale.to(DEVICE)
    x = torch.randn(24, k, generator=g).to(DEVICE, _dtype())
    alone = torch.cat([stored_linear(x[i : i + 1], stored, scale, fp4) for i in range(24)])
    for rows in (2, 17, 24):
        perm = torch.randperm(24, generator=g)[:rows].to(DEVICE)
        assert torch.equal(stored_linear(x[perm], stored, scale, fp4), alone[perm])


def test_grouped_rows_gather_in_the_kernel() -> None:
    """``rows``: the kernel reads each sorted row's token from ``x`` (quantised once a token)
    and gives what the rows gathered beforehand give, bit for bit; so do the sorted (token,
    expert) pairs with ``top_k``."""
    g = torch.Generator().manual_seed(9)
    e, n, k, tokens = 4, 40, 64, 7
    stored = [quant.fp4_weight(torch.randn(n, k, generator=g) / 8) for _ in range(e)]
    w = quant.pair_fp4(torch.stack([s[0] for s in stored])).to(DEVICE)
    s = torch.stack([s[1] for s in stored]).to(DEVICE)
    ids = torch.randint(0, e, (tokens, 2), generator=g)
    order = torch.sort(ids.flatten(), stable=True).indices
    counts = torch.bincount(ids.flatten(), minlength=e)
    x = torch.randn(tokens, k, generator=g).to(DEVICE, _dtype())
    rows = (order // 2).to(DEVICE)
    tiles = group_tiles(counts, len(rows), group_tile_rows(len(rows), e)).to(DEVICE)
    got = grouped_stored_linear(x, w, s, True, tiles, rows)
    want = grouped_stored_linear(x[rows], w, s, True, tiles)
    assert torch.equal(got, want)
    pairs = grouped_stored_linear(x, w, s, True, tiles, order.to(DEVICE), top_k=2)
    assert torch.equal(pairs, want)  # the sorted pairs themselves, each token's at pair // 2


@pytest.mark.parametrize("fp4", [True, False])
def test_tiles_and_split_programs_do_the_same_operations(fp4: bool, monkeypatch) -> None:
    """Many rows take 64-row tiles and sum their K ranges in one program; few take 16-row tiles
    and a program a range: a row's bits are the same either way (what lets a prefill's rows
    equal a decode step's)."""
    g = torch.Generator().manual_seed(21 + fp4)
    stored, scale = (quant.fp4_weight if fp4 else quant.fp8_weight)(_tiling_values(80, 256, g))
    stored, scale = held(stored, fp4).to(DEVICE), scale.to(DEVICE)
    x = _tiling_values(20, 256, g).to(DEVICE, _dtype())
    few = stored_linear(x, stored, scale, fp4)  # 16-row tiles, a program a split
    monkeypatch.setattr(module, "LARGE_ROWS", 0)
    monkeypatch.setattr(module, "SPREAD_BELOW", 0)
    assert torch.equal(stored_linear(x, stored, scale, fp4), few)


@pytest.mark.parametrize("spread", [True, False])
def test_added_rows_are_the_moe_combine_after_the_product(spread: bool, monkeypatch) -> None:
    """``Added``: each output row the fp32 sum of its routed rows in ascending expert id, then
    its own product rounded to their dtype, as ``ExpertPairs.combine`` and the add after it
    (the MoE's torch path), bit for bit; by the program of each split's last arrival and by
    one program summing the splits in turn; stored in fp32 (TP ranks) or the activation dtype
    (rounded once)."""
    if not spread:
        monkeypatch.setattr(module, "SPREAD_BELOW", 0)
    g = torch.Generator().manual_seed(13)
    tokens, experts, k, n, d = 9, 7, 3, 130, 256
    stored, scale = quant.fp8_weight(torch.randn(n, d, generator=g) / 16)
    stored, scale = stored.to(DEVICE), scale.to(DEVICE)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
    pairs = ExpertPairs(ids, experts)
    routed = torch.randn(tokens * k, n, generator=g).to(_dtype())
    x = torch.randn(tokens, d, generator=g).to(DEVICE, _dtype())
    want = pairs.combine(routed) + stored_linear(x, stored, scale, False).cpu().float()
    added = Added(routed.to(DEVICE), pairs.by_id.to(DEVICE))
    out = torch.empty(tokens, n, device=DEVICE)
    assert stored_linear(x, stored, scale, False, out, added) is out
    assert torch.equal(out.cpu(), want)
    rounded = stored_linear(x, stored, scale, False, torch.empty_like(x[:, :n]), added).cpu()
    if DEVICE == "cuda":  # rounded once, to nearest
        assert torch.equal(rounded, want.to(_dtype()))
    with pytest.raises(ValueError, match="added rows"):
        stored_linear(x, stored, scale, False, out, Added(routed[:, :8], pairs.by_id))


def _dtype() -> torch.dtype:
    return torch.bfloat16 if DEVICE == "cuda" else torch.float32


def _tiling_values(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """Inputs for a test that one row's bits do not depend on its tile. On a GPU random ones:
    the tensor cores sum a block in an order fixed by the instruction. On a CPU small integers,
    whose every sum is exact: Triton's interpreter takes a block's product from numpy, whose
    order of sums follows the tile's shape (an ulp apart on some machines), so there the test
    holds the rows, blocks and splits each tile reads, not their order."""
    if DEVICE == "cuda":
        return torch.randn(rows, cols, generator=g) / 16
    return torch.randint(-7, 8, (rows, cols), generator=g).float()


@pytest.mark.parametrize("fp4", [True, False])
def test_grouped_rows_give_the_same_bits_in_16_and_64_row_tiles(fp4: bool) -> None:
    """A few rows of each expert take 16-row tiles, many take 64-row ones (a verify step's rows
    beside a decode step's): each row's bits are the same in either."""
    g = torch.Generator().manual_seed(31 + fp4)
    e, n, k, rows = 2, 48, 256, 80
    stored = [
        (quant.fp4_weight if fp4 else quant.fp8_weight)(_tiling_values(n, k, g)) for _ in range(e)
    ]
    w = held(torch.stack([s[0] for s in stored]), fp4).to(DEVICE)
    s = torch.stack([s[1] for s in stored]).to(DEVICE)
    expert = torch.randint(0, e, (rows,), generator=g).sort().values
    x = _tiling_values(rows, k, g).to(DEVICE, _dtype())

    def run(pick: torch.Tensor) -> tuple[torch.Tensor, int]:
        counts = torch.bincount(expert[pick], minlength=e)
        bm = group_tile_rows(len(pick), e)
        tiles = group_tiles(counts, len(pick), bm).to(DEVICE)
        return grouped_stored_linear(x[pick.to(DEVICE)], w, s, fp4, tiles), bm

    many, bm_many = run(torch.arange(rows))
    few_rows = torch.cat([torch.nonzero(expert == i).flatten()[:5] for i in range(e)])
    few, bm_few = run(few_rows)
    assert (bm_few, bm_many) == (16, 64)
    assert torch.equal(few, many[few_rows.to(DEVICE)])


def test_a_weight_off_16_bytes_is_refused_and_a_loaded_one_copied_onto_them() -> None:
    """The kernel reads weights by TMA, which needs them to start on 16 bytes: a weight that
    does not is refused with an error saying so, and one loaded into a ``StoredLinear`` (a
    CPU's view into a safetensors file may start anywhere) is copied onto 16 bytes, the same
    bytes; an aligned one is kept as it is (no copy of a GPU's weights)."""
    gen = torch.Generator().manual_seed(5)
    raw = torch.randint(0, 120, (8 + 64 * 64,), dtype=torch.uint8, generator=gen).to(DEVICE)
    off = raw[8:].view(64, 64).view(torch.float8_e4m3fn)
    assert off.data_ptr() % 16
    scale = torch.full((2, 2), 127, dtype=torch.uint8, device=DEVICE)
    x = torch.randn(2, 64, generator=gen).to(DEVICE)
    with pytest.raises(ValueError, match="16 bytes"):
        stored_linear(x, off, scale, False)
    layer = quant.StoredLinear(64, 64).to(DEVICE)
    layer.load_state_dict({"weight": off, "scale": scale.view(torch.float8_e8m0fnu)}, assign=True)
    assert layer.weight.data_ptr() % 16 == 0
    assert torch.equal(layer.weight.view(torch.uint8), off.view(torch.uint8))
    aligned = off.clone()
    layer.load_state_dict(
        {"weight": aligned, "scale": scale.view(torch.float8_e8m0fnu)}, assign=True
    )
    assert layer.weight.data_ptr() == aligned.data_ptr()


@pytest.mark.parametrize(
    ("m", "groups", "n", "k"),
    [(1, 2, 64, 96), (5, 3, 32, 1024), (70, 2, 96, 160), (2, 8, 128, 256)],
)
def test_grouped_values_are_each_groups_exact_product(m, groups, n, k) -> None:
    """V4.1's ``wo_a`` read as stored: the activation's values as they are (bf16 on a GPU,
    fp32 in the interpreter) through each group's own rows of an FP8 weight, against the
    float64 einsum over the dequantised weight (the reference's bf16 copy holds the same
    values): equal up to the order of fp32 sums (products of 8- and 4-bit significands are
    exact); and a row's bits alone are its bits among the others (in a 64-row tile too on a
    GPU; the interpreter's fp32 products of other shapes may sum in another order)."""
    gen = torch.Generator().manual_seed(m + groups + n + k)
    w = torch.randn(groups * n, k, generator=gen) * torch.logspace(-2, 1, k) / k**0.5
    stored, scale = quant.fp8_weight(w)
    x = (torch.randn(m, groups, k, generator=gen) * 3).to(_dtype())
    deq = quant.dequant_fp8_weight(stored, scale, torch.float64).unflatten(0, (groups, n))
    exact = torch.einsum("mgk,gnk->mgn", x.double(), deq)
    stored, scale = stored.to(DEVICE), scale.to(DEVICE)
    got = grouped_values_linear(x.to(DEVICE), stored, scale, groups).cpu()
    assert got.shape == (m, groups, n) and got.dtype == x.dtype
    bound = torch.einsum("mgk,gnk->mgn", x.double().abs(), deq.abs()) * 2**-16
    if DEVICE == "cuda":  # and the bf16 output's rounding
        bound = bound + exact.abs() * 2**-8
    assert bool(((got.double() - exact).abs() <= bound).all())
    for i in {0, m // 2, m - 1} if DEVICE == "cuda" or m <= 64 else ():
        alone = grouped_values_linear(x[i : i + 1].to(DEVICE), stored, scale, groups).cpu()
        assert torch.equal(alone, got[i : i + 1])


def test_grouped_values_refuse_a_misfit_input() -> None:
    """An activation whose groups or width do not fit the weight is an error naming both."""
    stored, scale = quant.fp8_weight(torch.randn(128, 64))
    stored, scale = stored.to(DEVICE), scale.to(DEVICE)
    for shape in ((2, 4, 64), (2, 2, 32), (2, 128)):
        x = torch.randn(shape).to(DEVICE, _dtype())
        with pytest.raises(ValueError, match="groups of whole 32-feature scale blocks"):
            grouped_values_linear(x, stored, scale, 2)


def test_a_tile_narrower_than_the_tensor_cores_is_refused(monkeypatch) -> None:
    """Tiles of fewer than 16 features run in the interpreter and fault on a GPU (a weight of
    70 features once got 2-feature tiles): the launch refuses them here, where the tests run."""
    stored, scale = quant.fp8_weight(torch.randn(70, 96))
    x = torch.randn(2, 96).to(DEVICE, _dtype())
    monkeypatch.setattr(module, "settings", lambda *a: (8, 1, 4, 3, 1))
    with pytest.raises(ValueError, match="feature tile of 8"):
        stored_linear(x, stored.to(DEVICE), scale.to(DEVICE), False)
