"""Triton paged decode attention against torch on random paged caches (Triton's
interpreter on a CPU, natively on a GPU with ``-m triton``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.kernel_env import kernel_device, triton_runs

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not triton_runs(), reason="Triton cannot run here"),
]
DEV = kernel_device()


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "bs"), [(4, 2, 16, 4), (6, 6, 24, 8)])
def test_paged_decode_attention_matches_sdpa(heads, kv_heads, dim, bs) -> None:
    from engramrt.kernels.paged_attention import paged_decode_attention

    g = torch.Generator().manual_seed(heads * dim)
    num_blocks, batch = 40, 5
    k_cache = torch.randn(num_blocks * bs, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks * bs, kv_heads, dim, generator=g)
    lens = torch.tensor([1, bs, bs + 1, 3 * bs - 1, 17])
    perm = torch.randperm(num_blocks, generator=g)
    max_blocks = int(-(-lens.max() // bs))
    tables = perm[: batch * max_blocks].view(batch, max_blocks)
    q = torch.randn(batch, heads, dim, generator=g)
    got = paged_decode_attention(
        q.to(DEV), k_cache.to(DEV), v_cache.to(DEV), tables.to(DEV), lens.to(DEV), bs
    ).cpu()
    for b in range(batch):
        pos = torch.arange(int(lens[b]))
        rows = tables[b][pos // bs] * bs + pos % bs
        want = F.scaled_dot_product_attention(
            q[b][:, None],
            k_cache[rows].transpose(0, 1),
            v_cache[rows].transpose(0, 1),
            enable_gqa=True,
        )[:, 0]
        torch.testing.assert_close(got[b], want, rtol=1e-5, atol=1e-5)


# --- split-K decode --------------------------------------------------------------------------


def _decode_case(heads, kv_heads, dim, bs, lens, dtype, seed, spare=2):
    """Random caches, a block table of distinct shuffled blocks ``spare`` columns wider than
    the longest context needs (the spare columns hold other requests' blocks)."""
    g = torch.Generator().manual_seed(seed)
    width = max(1, -(-max(lens) // bs)) + spare
    num_blocks = len(lens) * width + 3
    k_cache = torch.randn(num_blocks * bs, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * bs, kv_heads, dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables, torch.tensor(lens)


def _reference(q, k_cache, v_cache, tables, lens, bs) -> torch.Tensor:
    """SDPA in fp32 over each request's gathered rows; a row with no keys is zeros."""
    out = torch.zeros(q.shape)
    for b, n in enumerate(lens.tolist()):
        pos = torch.arange(n)
        rows = tables[b][pos // bs] * bs + pos % bs
        if n:
            out[b] = F.scaled_dot_product_attention(
                q[b].float()[:, None],
                k_cache[rows].float().transpose(0, 1),
                v_cache[rows].float().transpose(0, 1),
                enable_gqa=True,
            )[:, 0]
    return out


def _run_decode(q, k_cache, v_cache, tables, lens, bs, splits):
    from engramrt.kernels.paged_attention import paged_decode_attention

    width = torch.tensor([tables.shape[1]], device=DEV)  # a device scalar, as graphs pass it
    return paged_decode_attention(
        q.to(DEV),
        k_cache.to(DEV),
        v_cache.to(DEV),
        tables.to(DEV),
        lens.to(DEV),
        bs,
        width,
        splits=splits,
    ).cpu()


def _tol(dtype) -> dict:
    return {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "bs", "dtype", "splits"),
    [
        (8, 8, 32, 16, torch.float32, 2),  # no grouping
        (8, 4, 32, 16, torch.bfloat16, 4),
        (8, 2, 64, 8, torch.float32, 3),  # a split count that is not a power of two
        (8, 1, 48, 16, torch.bfloat16, 8),  # head dim not a power of two, one KV head
        (8, 2, 32, 5, torch.float32, 1),  # one split: the direct store, no merge
        (6, 3, 32, 16, torch.float32, None),  # the default split count
    ],
)
def test_split_decode_matches_reference(heads, kv_heads, dim, bs, dtype, splits) -> None:
    """Contexts of 0 (padding: zeros), 1, a step of keys -1/+0/+1, odd and block-unaligned
    lengths and a few hundred, over shuffled blocks with a wider table than needed."""
    from engramrt.kernels.paged_attention import decode_keys_per_step

    step = decode_keys_per_step(max(16, dim))
    lens = [0, 1, step - 1, step, step + 1, 37, 301]
    case = _decode_case(heads, kv_heads, dim, bs, lens, dtype, seed=heads * dim + kv_heads)
    got = _run_decode(*case, bs, splits)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), _reference(*case, bs), **_tol(dtype))
    assert not got[0].any()


@pytest.mark.parametrize("splits", [1, 4, 16])
def test_split_decode_empty_splits_and_padding(splits, monkeypatch) -> None:
    """More splits than steps of keys (most splits empty) and padding rows: the merge never
    reads an empty split's partial (the workspace starts as NaN here), padding rows are zeros,
    and a batch of padding alone (a graph's warm-up) is all zeros."""
    from engramrt.kernels import paged_attention as pa

    def nan_workspace(*args):
        return tuple(t.fill_(float("nan")) for t in workspace(*args))

    workspace = pa._workspace
    monkeypatch.setattr(pa, "_workspace", nan_workspace)
    lens = [3, 0, 20, 0]
    case = _decode_case(4, 2, 32, 4, lens, torch.float32, seed=splits)
    got = _run_decode(*case, 4, splits)
    torch.testing.assert_close(got, _reference(*case, 4), rtol=1e-5, atol=1e-5)
    assert not got[1].any() and not got[3].any()
    q, k_cache, v_cache, tables, _ = case
    idle = _run_decode(q, k_cache, v_cache, tables, torch.zeros(4, dtype=torch.int64), 4, splits)
    assert not idle.isnan().any() and not idle.any()


def test_split_count_rule() -> None:
    """A function of batch size and KV heads alone: about two programs per SM, a power of two,
    1 once the batch fills the GPU, at most MAX_SPLITS; a fixed count off CUDA."""
    from engramrt.kernels.paged_attention import (
        INTERPRETER_SPLITS,
        MAX_SPLITS,
        decode_splits,
        splits_for,
    )

    assert [splits_for(b, 8, 132) for b in (1, 2, 4, 8, 16, 32, 64, 256)] == [
        64,
        32,
        16,
        8,
        4,
        2,
        1,
        1,
    ]
    assert splits_for(1, 1, 132) == MAX_SPLITS
    assert splits_for(3, 8, 132) == 16  # ceil(264 / 24) = 11 -> 16
    assert decode_splits(1, 8, "cpu") == decode_splits(256, 1, "cpu") == INTERPRETER_SPLITS


# --- varlen paged prefill --------------------------------------------------------------------

SMALL = {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2}  # 8 programs a tile
MID = {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}  # keys steps > queries


def _prefill_case(heads, kv_heads, dim, bs, run_lens, start_pos, dtype, seed, spare=1):
    """Random caches holding every request's positions ``[0, start_pos + run)`` (the cached
    prefix of a prefix-cache hit and the run's own K/V, written before attention) over shuffled
    blocks, a table ``spare`` columns wider than needed, and the flat queries ``[T, H, D]``."""
    g = torch.Generator().manual_seed(seed)
    ends = [p + n for p, n in zip(start_pos, run_lens, strict=True)]
    width = max(1, -(-max(ends) // bs)) + spare
    num_blocks = len(run_lens) * width + 2
    k_cache = torch.randn(num_blocks * bs, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * bs, kv_heads, dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: len(run_lens) * width]
    q = torch.randn(sum(run_lens), heads, dim, generator=g).to(dtype)
    return q, k_cache, v_cache, tables.view(len(run_lens), width)


def _prefill_reference(q, k_cache, v_cache, tables, run_lens, start_pos, bs) -> torch.Tensor:
    """Per request: fp32 SDPA of its queries over its gathered positions, causal on absolute
    positions (``engramrt.models.gqa.attention._torch_attention``'s rule)."""
    out, at = torch.zeros(q.shape), 0
    for b, (n, p0) in enumerate(zip(run_lens, start_pos, strict=True)):
        pos = torch.arange(p0 + n)
        rows = tables[b][pos // bs] * bs + pos % bs
        out[at : at + n] = F.scaled_dot_product_attention(
            q[at : at + n].float().transpose(0, 1),
            k_cache[rows].float().transpose(0, 1),
            v_cache[rows].float().transpose(0, 1),
            attn_mask=pos <= pos[p0:, None],
            enable_gqa=True,
        ).transpose(0, 1)
        at += n
    return out


def _run_prefill(q, k_cache, v_cache, tables, run_lens, start_pos, bs, config):
    from engramrt.kernels.paged_attention import paged_prefill_attention
    from engramrt.kernels.tiles import prefill_tiles

    lens = torch.tensor(run_lens)
    qstart = torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)])
    tile_req, tile_m0 = (
        torch.tensor(v, dtype=torch.int64) for v in prefill_tiles(run_lens, start_pos)
    )
    args = (q, k_cache, v_cache, tables, qstart, torch.tensor(start_pos), tile_req, tile_m0)
    return paged_prefill_attention(*(a.to(DEV) for a in args), bs, config=config).cpu()


def _check_prefill(heads, kv_heads, dim, bs, run_lens, start_pos, dtype, config, seed=0):
    case = _prefill_case(heads, kv_heads, dim, bs, run_lens, start_pos, dtype, seed)
    got = _run_prefill(*case, run_lens, start_pos, bs, config)
    assert got.dtype == dtype and got.shape == case[0].shape
    want = _prefill_reference(*case, run_lens, start_pos, bs)
    torch.testing.assert_close(got.float(), want, **_tol(dtype))


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "bs", "dtype"),
    [
        (4, 4, 32, 16, torch.float32),  # no grouping
        (4, 2, 48, 5, torch.bfloat16),  # head dim not a power of two, odd block size
        (6, 2, 64, 7, torch.float32),  # the 4B preset's ratio (3)
        (8, 2, 32, 16, torch.bfloat16),  # 4
    ],
)
def test_prefill_matches_reference(heads, kv_heads, dim, bs, dtype) -> None:
    """16-query programs (8 per host tile, most past their run: padding): runs of 1, a program
    -1/+1, several programs; from position 0 and after cached prefixes (prefix-cache hits, one
    of them block-unaligned and longer than the run), so both the unmasked steps and the
    diagonal ones run. A run of 1 after long ones: its dead programs come last and must not
    write into the next request's rows."""
    runs, starts = [17, 1, 15, 40, 3], [0, 9, 0, 29, 70]
    _check_prefill(heads, kv_heads, dim, bs, runs, starts, dtype, SMALL, seed=heads * dim + bs)


@pytest.mark.parametrize("config", [SMALL, MID, None], ids=["m16n16", "m32n64", "default"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_config_sweep(config, dtype) -> None:
    """One batch under several launch configurations, the default included (128-query
    programs): runs of 1, PREFILL_TILE -1/+1 and longer, with and without cached prefixes."""
    from engramrt.kernels.tiles import PREFILL_TILE

    runs = [PREFILL_TILE + 1, 1, PREFILL_TILE - 1, 2 * PREFILL_TILE + 35]
    starts = [0, 100, 77, 3]
    _check_prefill(3, 1, 32, 16, runs, starts, dtype, config, seed=len(str(config)))


def test_prefill_all_padding_programs() -> None:
    """One-token runs only (a chunked batch's decode rows): every host tile holds one query and
    all but one of its programs lie past its run; each request attends to its whole prefix."""
    _check_prefill(4, 1, 32, 4, [1, 1, 1], [0, 13, 50], torch.float32, SMALL)


def test_prefill_tiles_cover_runs_most_keys_first() -> None:
    from engramrt.kernels.tiles import PREFILL_TILE as T
    from engramrt.kernels.tiles import prefill_tiles

    runs, starts = [2 * T + 1, 0, 1, T], [0, 5, 3 * T, 10]
    req, m0 = prefill_tiles(runs, starts)
    assert sorted(zip(req, m0, strict=True)) == [(0, 0), (0, T), (0, 2 * T), (2, 0), (3, 0)]
    keys = [starts[b] + min(m + T, runs[b]) for b, m in zip(req, m0, strict=True)]
    assert keys == sorted(keys, reverse=True)
    assert prefill_tiles([]) == ([], []) and prefill_tiles([3, 0]) == ([0], [0])


def test_prefill_config_checked() -> None:
    from engramrt.kernels import paged_attention as pa

    for dim, dtype in ((128, torch.bfloat16), (64, torch.float32), (48, torch.bfloat16)):
        cfg = pa.prefill_config(dim, dtype)  # the host tile, K/V tiles of at most 16 KB
        kv_tile = cfg["BLOCK_N"] * max(16, 1 << (dim - 1).bit_length()) * dtype.itemsize
        assert cfg["BLOCK_M"] == pa.PREFILL_TILE and kv_tile <= 16384
    for bad in ({"BLOCK_M": 2 * pa.PREFILL_TILE}, {"BLOCK_M": 48}, {"BLOCK_N": 8}):
        with pytest.raises(ValueError, match="power of two"):
            _run_prefill(*_prefill_case(2, 1, 16, 4, [3], [0], torch.float32, 0), [3], [0], 4, bad)
