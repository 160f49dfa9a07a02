"""Engram embedding table against a pure-Python fp8/e8m0 oracle.

The oracle decodes float8_e4m3fn and e8m0 bytes bit by bit in float64 (``math.ldexp``) and rounds
once to bf16; nothing in it calls the code under test.
"""

from __future__ import annotations

import functools
import math
import operator

import numpy as np
import pytest
import torch

from engramrt.config import EngramConfig
from engramrt.engram.layout import EngramLayout, search_primes
from engramrt.engram.table import EngramTable, dequantize_rows, shard_row_range
from tests.support.fp8_oracle import e4m3_value, e8m0_value

BLOCK = 32
NAN_BYTES = (0x7F, 0xFF)


# ----------------------------------------------------------------------------- oracle


def oracle_dequant(w_bytes: np.ndarray, s_bytes: np.ndarray) -> torch.Tensor:
    """``[rows, dim]`` e4m3 bytes, ``[rows, dim/32]`` e8m0 bytes -> bf16, rounded once."""
    rows, dim = w_bytes.shape
    vals = [
        [
            math.ldexp(e4m3_value(int(w_bytes[r, d])), int(s_bytes[r, d // BLOCK]) - 127)
            for d in range(dim)
        ]
        for r in range(rows)
    ]
    return torch.tensor(vals, dtype=torch.float64).to(torch.bfloat16)


def random_fp8_bytes(rng: np.random.Generator, rows: int, dim: int) -> np.ndarray:
    """Random e4m3 bytes, NaN bytes replaced, with some -0.0 (0x80) and +0.0 entries."""
    w = rng.integers(0, 256, size=(rows, dim), dtype=np.uint8)
    nan = np.isin(w, NAN_BYTES)
    w[nan] = rng.integers(0, 0x7F, size=int(nan.sum()), dtype=np.uint8)
    flat = w.reshape(-1)
    picks = rng.choice(flat.size, size=max(2, flat.size // 16), replace=False)
    flat[picks[: len(picks) // 2]] = 0x80
    flat[picks[len(picks) // 2 :]] = 0x00
    return w


def random_scale_bytes(rng: np.random.Generator, rows: int, blocks: int) -> np.ndarray:
    """Random e8m0 bytes over the whole finite range, always including 0, 1 and 254."""
    s = rng.integers(0, 255, size=(rows, blocks), dtype=np.uint8)
    flat = s.reshape(-1)
    flat[:3] = (0, 1, 254)
    return s


def keep_finite(w: np.ndarray, s: np.ndarray) -> np.ndarray:
    """Where the block scale is >= 2**120, cap the weight below 2.0 so the product fits bf16."""
    w = w.copy()
    big = np.repeat(s >= 247, BLOCK, axis=1)
    w[big] = (w[big] & 0x80) | (w[big] & 0x3F)  # exponent field <= 7: |value| < 2
    return w


def fp8_table_bytes(seed: int, rows: int, dim: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    s = random_scale_bytes(rng, rows, dim // BLOCK)
    w = keep_finite(random_fp8_bytes(rng, rows, dim), s)
    return w, s


def as_fp8(w: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(w.copy()).view(torch.float8_e4m3fn)


def as_e8m0(s: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(s.copy()).view(torch.float8_e8m0fnu)


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a float tensor, so comparisons see signs of zero and exact bits."""
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype])


def assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = (bits(got) != bits(want)).nonzero()
    assert diff.numel() == 0, f"{len(diff)} mismatches, first at {diff[0].tolist()}: " + (
        f"got {got[tuple(diff[0])].item()!r}, want {want[tuple(diff[0])].item()!r}"
    )


# ----------------------------------------------------------------------------- decode


def test_table_oracle_decoder_known_values():
    """Guards the oracle itself: fixed facts of the e4m3 / e8m0 formats."""
    assert e4m3_value(0x38) == 1.0
    assert e4m3_value(0x7E) == 448.0
    assert e4m3_value(0x01) == 2.0**-9
    assert e4m3_value(0x08) == 2.0**-6
    assert math.copysign(1.0, e4m3_value(0x80)) == -1.0 and e4m3_value(0x80) == 0.0
    assert e4m3_value(0xC0) == -2.0
    assert math.isnan(e4m3_value(0x7F)) and math.isnan(e4m3_value(0xFF))
    assert e8m0_value(127) == 1.0 and e8m0_value(0) == 2.0**-127
    assert math.isnan(e8m0_value(255))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_table_dequantize_rows_matches_oracle_bitwise(seed):
    """dequantize_rows == e4m3 * 2**(e-127) rounded once to bf16; random bytes + edge scales."""
    w, s = fp8_table_bytes(seed, rows=48, dim=128)
    got = dequantize_rows(as_fp8(w), as_e8m0(s))
    want = oracle_dequant(w, s)
    assert torch.isfinite(want.float()).all()
    assert_bitwise(got, want)


def test_table_dequantize_all_weight_bytes_under_edge_scales():
    """Every non-NaN e4m3 byte under scale bytes 0, 1, 127 and 254 (capped weights for 254)."""
    all_bytes = np.array([b for b in range(256) if b not in NAN_BYTES], dtype=np.uint8)
    pad = (-len(all_bytes)) % BLOCK
    row = np.concatenate([all_bytes, np.zeros(pad, dtype=np.uint8)])
    for scale in (0, 1, 127, 200, 254):
        s = np.full((1, len(row) // BLOCK), scale, dtype=np.uint8)
        w = keep_finite(row[None, :], s)
        assert_bitwise(dequantize_rows(as_fp8(w), as_e8m0(s)), oracle_dequant(w, s))


def test_table_e8m0_zero_byte_is_two_to_minus_127():
    """Scale byte 0 is 2**-127, so weight 1.0 dequantizes to a nonzero 2**-127."""
    w = np.full((1, BLOCK), 0x38, dtype=np.uint8)  # 1.0
    s = np.zeros((1, 1), dtype=np.uint8)
    got = dequantize_rows(as_fp8(w), as_e8m0(s))
    want = torch.tensor(math.ldexp(1.0, -127), dtype=torch.float64).to(torch.bfloat16)
    assert want.item() != 0.0
    assert_bitwise(got, want.expand(1, BLOCK).contiguous())
    table = EngramTable(as_fp8(w), torch.from_numpy(s))  # uint8 bytes as some tools store them
    assert table.lookup(torch.zeros(1, 1, dtype=torch.long)).float()[0, 0].item() == 2.0**-127


# ----------------------------------------------------------------------------- lookup


def loop_lookup(rows: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``[T, cols]`` ids -> ``[T, cols*dim]`` by a Python loop over (t, c)."""
    t_count, cols = ids.shape
    dim = rows.shape[1]
    out = torch.empty(t_count, cols * dim, dtype=rows.dtype)
    for t in range(t_count):
        for c in range(cols):
            out[t, c * dim : (c + 1) * dim] = rows[int(ids[t, c])]
    return out


def plain_rows(seed: int, rows: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """Random rows with a sprinkling of -0.0 and +0.0 entries."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(rows, dim, generator=g, dtype=torch.float32)
    flat = w.view(-1)
    idx = torch.randperm(flat.numel(), generator=g)[: flat.numel() // 16]
    flat[idx[: len(idx) // 2]] = -0.0
    flat[idx[len(idx) // 2 :]] = 0.0
    return w.to(dtype)


def random_ids(seed: int, tokens: int, cols: int, rows: int, dtype=torch.long) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, rows, (tokens, cols), generator=g)
    ids[0, 0], ids[-1, -1] = 0, rows - 1  # both ends of the table
    return ids.to(dtype)


def test_table_lookup_fp8_matches_loop_oracle():
    """fp8 lookup: [T, cols] ids -> [T, cols*dim] bf16, row by row as the oracle decodes them."""
    w, s = fp8_table_bytes(seed=5, rows=40, dim=64)
    table = EngramTable(as_fp8(w), as_e8m0(s))
    assert table.out_dtype == torch.bfloat16
    ids = random_ids(6, tokens=7, cols=5, rows=40)
    got = table.lookup(ids)
    assert got.shape == (7, 5 * 64)
    assert_bitwise(got, loop_lookup(oracle_dequant(w, s), ids))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("id_dtype", [torch.long, torch.int32])
def test_table_lookup_plain_matches_loop_oracle(dtype, id_dtype):
    """bf16 / fp32 tables return their rows unchanged, in column order, in the table dtype."""
    rows = plain_rows(7, 33, 48, dtype)
    table = EngramTable(rows)
    ids = random_ids(8, tokens=6, cols=4, rows=33, dtype=id_dtype)
    got = table.lookup(ids)
    assert got.dtype == dtype and got.shape == (6, 4 * 48)
    assert_bitwise(got, loop_lookup(rows, ids))


# ----------------------------------------------------------------------------- sharding


def layout_bounds(max_ngram: int, heads: int) -> list[int]:
    """Column bounds from a real EngramLayout with small primes (vocab_size 5)."""
    base = {
        "layer_ids": (1,),
        "max_ngram_size": max_ngram,
        "n_heads": heads,
        "head_dim": 32,
        "vocab_size": 5,
        "pad_token_id": 2,
        "compressed_vocab_size": 50,
        "hidden_size": 64,
        "hc_mult": 4,
        "rms_norm_eps": 1e-20,
    }
    primes = search_primes(EngramConfig(num_embeddings=(0,), **base))[0]
    rows = sum(p for per_n in primes for p in per_n)
    layout = EngramLayout.from_config(EngramConfig(num_embeddings=(rows,), **base))
    bounds = layout.column_bounds(0)
    assert len(bounds) == (max_ngram - 1) * heads + 1 and bounds[0] == 0 and bounds[-1] == rows
    assert all(a < b for a, b in zip(bounds, bounds[1:], strict=False))
    return bounds


BOUNDS_24 = layout_bounds(4, 8)  # 24 columns, as in the released model
BOUNDS_10 = layout_bounds(3, 5)  # 10 columns: 3, 4 and 8 do not divide it (floor split)


def make_table(kind: str, rows: int, seed: int) -> EngramTable:
    if kind == "fp8":
        w, s = fp8_table_bytes(seed, rows, 32)
        return EngramTable(as_fp8(w), as_e8m0(s))
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[kind]
    return EngramTable(plain_rows(seed, rows, 32, dtype))


def check_partition(shards: list[EngramTable], rows: int) -> None:
    """Shards are contiguous ranges that are disjoint and cover [0, rows), in rank order."""
    ranges = [(sh.row_start, sh.row_start + sh.num_rows) for sh in shards]
    assert ranges[0][0] == 0 and ranges[-1][1] == rows
    for (_, hi), (lo, _) in zip(ranges, ranges[1:], strict=False):
        assert hi == lo
    assert sum(hi - lo for lo, hi in ranges) == rows


SHARD_CASES = [
    ("columns24", BOUNDS_24, BOUNDS_24[-1]),
    ("floor24", None, BOUNDS_24[-1]),
    ("columns10", BOUNDS_10, BOUNDS_10[-1]),
    ("floor_odd", None, 37),  # 37 rows: not divisible by any world > 1 here
]


@pytest.mark.parametrize("kind", ["fp8", "bf16", "fp32"])
@pytest.mark.parametrize("case", SHARD_CASES, ids=[c[0] for c in SHARD_CASES])
@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
def test_table_shard_sum_equals_full_lookup_bitwise(kind, case, world):
    """shards partition the rows and the sum of partial lookups is the full one."""
    name, bounds, rows = case
    table = make_table(kind, rows, seed=world * 31 + len(name))
    shards = [table.shard(r, world, bounds) for r in range(world)]
    check_partition(shards, rows)
    cols = 0 if bounds is None else len(bounds) - 1
    for sh in shards:
        if bounds is not None and cols % world == 0:
            # whole hash columns: each shard starts and ends on a column bound
            assert sh.row_start in bounds and sh.row_start + sh.num_rows in bounds
            per = cols // world
            assert bounds.index(sh.row_start + sh.num_rows) - bounds.index(sh.row_start) == per
        elif world > 1:
            assert abs(sh.num_rows - rows / world) < 1  # floor split: sizes differ by <= 1
    ids = random_ids(world, tokens=9, cols=6, rows=rows)
    # make sure several -0.0 entries are looked up (fp8 byte 0x80 / plain -0.0)
    if kind == "fp8":
        has_neg_zero = (table.weight.view(torch.uint8) == 0x80).any(1)
    else:
        has_neg_zero = bits(table.weight) == bits(-torch.zeros((), dtype=table.weight.dtype))
        has_neg_zero = has_neg_zero.any(1)
    neg_zero = has_neg_zero.nonzero().flatten()
    assert neg_zero.numel() > 0
    ids[1, : min(6, neg_zero.numel())] = neg_zero[:6]
    full = table.lookup(ids)
    assert (bits(full) == bits(torch.tensor(-0.0, dtype=full.dtype))).any()
    parts = [sh.lookup(ids) for sh in shards]
    assert_bitwise(functools.reduce(operator.add, parts), full)
    assert_bitwise(functools.reduce(operator.add, parts[::-1]), full)


def test_table_unowned_rows_read_negative_zero():
    """A shard reads rows it does not own as -0.0 (the additive identity), not +0.0."""
    table = make_table("bf16", 20, seed=3)
    shard = table.shard(1, 2)
    ids = torch.tensor([[0, 19], [5, 12]])
    out = shard.lookup(ids).view(2, 2, 32)
    neg_zero = bits(torch.tensor(-0.0, dtype=torch.bfloat16))
    for t in range(2):
        for c in range(2):
            row = int(ids[t, c])
            if shard.row_start <= row < shard.row_start + shard.num_rows:
                assert_bitwise(out[t, c], table.weight[row])
            else:
                assert (bits(out[t, c]) == neg_zero).all()


def test_table_shard_more_ranks_than_rows():
    """A floor split may leave a rank with no rows; its lookup must still be all -0.0."""
    table = make_table("bf16", 5, seed=4)
    shards = [table.shard(r, 8) for r in range(8)]
    check_partition(shards, 5)
    ids = random_ids(0, tokens=3, cols=2, rows=5)
    assert_bitwise(
        functools.reduce(operator.add, [sh.lookup(ids) for sh in shards]), table.lookup(ids)
    )


@pytest.mark.parametrize("rank,world", [(-1, 2), (2, 2), (0, 0), (8, 8)])
def test_table_shard_row_range_invalid_rank(rank, world):
    """A rank outside [0, world) is rejected."""
    with pytest.raises(ValueError, match="rank"):
        shard_row_range(100, rank, world)


def test_table_shard_row_range_bounds_must_end_at_rows():
    """Column bounds whose last entry is not the row count are rejected."""
    with pytest.raises(ValueError, match="column bounds"):
        shard_row_range(BOUNDS_24[-1] + 1, 0, 2, BOUNDS_24)
    with pytest.raises(ValueError, match="column bounds"):
        make_table("fp32", 50, seed=0).shard(0, 2, [0, 10, 20, 49])


def test_table_shard_of_shard_rejected():
    """Only a full table (row_start 0) can be sharded again."""
    shard = make_table("fp32", 50, seed=0).shard(1, 2)
    with pytest.raises(ValueError):
        shard.shard(0, 2)


# ----------------------------------------------------------------------------- constructor


def test_table_fp8_without_scale_names_shape():
    """An fp8 weight with no scale raises, naming the expected [rows, dim/32] shape."""
    w = as_fp8(np.zeros((6, 64), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"\[6, 2\]"):
        EngramTable(w)


@pytest.mark.parametrize("shape", [(6, 1), (6, 4), (5, 2), (2, 6), (6,)])
def test_table_fp8_wrong_scale_shape_names_shape(shape):
    """A scale that is not [rows, dim/32] raises, naming expected and given shapes."""
    w = as_fp8(np.zeros((6, 64), dtype=np.uint8))
    s = torch.full(shape, 127, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"\[6, 2\]") as err:
        EngramTable(w, s)
    assert str(list(shape)) in str(err.value)


def test_table_fp8_dim_not_multiple_of_block():
    """An fp8 row width that is not a multiple of 32 cannot carry per-32 scales."""
    w = as_fp8(np.zeros((4, 40), dtype=np.uint8))
    with pytest.raises(ValueError, match="scale"):
        EngramTable(w, torch.full((4, 1), 127, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_table_plain_with_scale_rejected(dtype):
    """A bf16 / fp32 table takes no scale; the message names the weight dtype."""
    with pytest.raises(ValueError, match="no scale") as err:
        EngramTable(torch.zeros(4, 32, dtype=dtype), torch.full((4, 1), 127, dtype=torch.uint8))
    assert str(dtype) in str(err.value)


@pytest.mark.parametrize("shape", [(64,), (2, 3, 32), ()])
def test_table_non_2d_weight_rejected(shape):
    """A weight that is not 2-D raises, naming the [rows, dim] shape and the one given."""
    with pytest.raises(ValueError, match=r"2-D \[rows, dim\]") as err:
        EngramTable(torch.zeros(shape, dtype=torch.bfloat16))
    assert str(list(shape)) in str(err.value)
