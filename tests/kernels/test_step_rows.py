"""A V4.1 step's per-token rows in one launch (``StepRuns`` with a plan: ``kernels.step_rows``)
against the torch statements each layer used to run (``StepRuns`` without one): every field
and every row the plan names equal, bit for bit (integers; the angles one fp32 product each),
for random runs (prompt chunks, decode rows, runs crossing the ring and tail, padding of a
CUDA graph's shape, a lagged shift leaving positions behind the packed ones)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from engramrt.bundled import FLASH_CONFIG
from engramrt.model.block_tables import BlockTables
from engramrt.model.context import ForwardContext, GraphShape
from engramrt.models.deepseek_v41.attention import StepPlan, StepRuns
from engramrt.models.deepseek_v41.cache import V41Cache
from engramrt.models.deepseek_v41.config import v41_config

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FIELDS = ("pos", "p0", "q0", "end", "slot", "real", "req", "tables", "max_end")


def flash():
    return v41_config(json.loads(FLASH_CONFIG.read_text())["text_config"])


def step(cfg, seed: int, pad: bool, slack: int, block_size: int = 256):
    """A cache over three of ``cfg``'s layers and a random step's ``ForwardContext``."""
    rng = np.random.default_rng(seed)
    slots, max_len = 5, 4 * block_size
    layers = [i for i, r in enumerate(cfg.roles) if r.ratio][:2] + [0]
    cache = V41Cache(cfg, layers, slots * 4, block_size, torch.bfloat16, DEVICE, max_len, slots,
                     slack=slack)  # fmt: skip
    tables = BlockTables(slots, slots * 4, block_size, max_len)
    order = rng.permutation(slots * 4).reshape(slots, 4)  # blocks out of order
    tables.set(list(range(slots)), None, order.tolist())
    n = int(rng.integers(1, slots + 1))
    ids = rng.permutation(slots)[:n].tolist()
    lens = [int(rng.choice([1, 1, 2, 3, 7, 40, 150, 300])) for _ in ids]
    starts = [int(rng.integers(0, max_len - k)) for k in lens]
    shape = None
    if pad:  # a graph's shape: padded tokens at position 0, a padded run owning one
        shape = GraphShape(all(k == 1 for k in lens), sum(lens) + 3, n + 2)
    ctx = ForwardContext.for_runs(ids, lens, starts, cache, tables, DEVICE, pad=shape)
    if rng.random() < 0.5:  # speculation's shift moves positions on the device (lagged runs)
        ctx.positions.sub_(torch.as_tensor(rng.integers(0, 3, len(ctx.positions)), device=DEVICE))
        ctx.positions.clamp_(min=0)
    return cfg, cache, ctx


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("pad", [False, True])
def test_planned_rows_equal_the_torch_statements(seed: int, pad: bool) -> None:
    cfg, cache, ctx = step(flash(), seed, pad, slack=seed % 3 * 2)
    plan = StepPlan.of(cfg)
    assert plan.ratios and all(cache.block_size % r == 0 for r in plan.ratios)
    want = StepRuns.of(ctx)  # no plan: torch
    got = StepRuns._planned(ctx, plan, want.max_end)
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        assert a == b if isinstance(a, int) else torch.equal(a, b), name
        assert isinstance(a, int) or a.dtype == b.dtype, name
    assert torch.equal(got.ring_rows(cache), want.ring_rows(cache))
    for a, b in zip(got.tail_rows(cache), want.tail_rows(cache), strict=True):
        assert torch.equal(a, b)
    for r in plan.ratios:
        assert torch.equal(got.closing_rows(cache, r), want.closing_rows(cache, r)), r
    for key, back in plan.rotations:
        for a, b in zip(got.rotation(key, back), want.rotation(key, back), strict=True):
            assert torch.equal(a, b), (key, back)
    # every row starts 16-byte aligned whatever the token count (Triton specialises on it)
    rows = [got.p0, got.q0, got.end, got.slot, got.memo["ring"], *got.memo["tail"]]
    assert all(r.data_ptr() % 16 == 0 for r in rows)
    # the plan's rows came from the launch: nothing left for a layer to compute
    assert set(got.memo) == {"ring", "tail", *(("closes", r) for r in plan.ratios),
                             *plan.rotations}  # fmt: skip
