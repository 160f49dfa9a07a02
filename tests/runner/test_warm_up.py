"""No Triton compilation mid-serving: the start-up warm-up covers every compile-time variant the
token and request counts select, the step buffer's views are 16-byte aligned whatever the counts
(Triton specialises pointers on it), and on a GPU a second wave of new prompt shapes after start-up
compiles nothing, with speculation too (the draft pass reads the samples through views of any
alignment)."""

from __future__ import annotations

import argparse
import random

import pytest
import torch
import triton

from engramrt.kernels.mhc_fused import mixes_plan, post_block_d
from engramrt.model.context import ForwardContext, GraphShape
from engramrt.models.gqa.cache import GQACache
from engramrt.runner.stage import warm_up_plan


def _tiles(tokens: int, k: int) -> tuple:
    p = mixes_plan(tokens, k)
    return p.block_t, p.block_k, p.warps, post_block_d(tokens)


@pytest.mark.parametrize(
    "max_tokens,slots,max_len",
    [
        (8192, 256, 4096),
        (96, 8, 512),
        (2048, 1, 2048),
        (20, 64, 256),
        (3, 2, 8),
        (2048, 8, 64),
        (2048, 3, 40),
        (512, 200, 2),
    ],
)
def test_warm_up_plan_covers_every_compile_time_variant(max_tokens, slots, max_len) -> None:
    """Every mixed step (2 or more tokens, not all runs of one) selects mHC tiles by its token
    count and the hash kernel's REQ_PAD by its request count (a power of two): the plan's steps
    reach every value a step within the limits can, and each is itself a valid mixed step."""
    plan = warm_up_plan(max_tokens, slots, max_len)
    assert all(sum(r) <= max_tokens and len(r) <= slots and 1 < max(r) <= max_len for r in plan)
    for k in (4 * 64, 4 * 3072, 4 * 7168):
        reachable = {_tiles(t, k) for t in range(2, min(max_tokens, slots * max_len) + 1)}
        assert {_tiles(sum(r), k) for r in plan} == reachable
    max_reqs = min(slots, max_tokens - 1)
    reachable = {triton.next_power_of_2(n) for n in range(1, max_reqs + 1)}
    assert {triton.next_power_of_2(len(r)) for r in plan} == reachable


def test_step_buffer_views_are_16_byte_aligned() -> None:
    rng = random.Random(0)
    kv = GQACache([0], 512, 4, 2, 8, torch.float32, "cpu", 256, num_slots=8)
    for _ in range(50):
        n = rng.randint(1, 8)
        slots = rng.sample(range(8), n)
        runs = [rng.randint(1, 9) for _ in range(n)]
        tables = kv.fixed_tables()
        tables.set(slots, None, [list(range(s * 8, s * 8 + 3)) for s in slots])
        pad = rng.choice([None, GraphShape(False, sum(runs) + rng.randint(0, 9), 8)])
        ctx = ForwardContext.for_runs(
            slots, runs, [0] * n, kv, tables, "cpu", pad=pad, last_rows=rng.random() < 0.5
        )
        views = [getattr(ctx, f) for f in ctx.__dataclass_fields__]
        views += list(ctx.tiles or ())
        for v in views:
            if isinstance(v, torch.Tensor) and v is not ctx.flat and v.numel():
                assert (v.data_ptr() - ctx.flat.data_ptr()) % 16 == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "spec",
    [
        None,
        '{"method": "dspark", "num_speculative_tokens": 5}',
        '{"method": "ngram", "num_speculative_tokens": 4}',
    ],
)
def test_serving_after_warm_up_compiles_nothing(spec: str | None) -> None:
    from engramrt.commands.bench_throughput import add_arguments, local_engine
    from engramrt.engine.request import SamplingParams
    from engramrt.kernels.compiles import compilations, count_compilations, recent

    if not count_compilations():
        pytest.skip("this Triton has no post-compile hook")
    p = argparse.ArgumentParser()
    add_arguments(p)
    # a fixed KV budget: the GPU's free memory depends on the tests before this one
    args = p.parse_args(
        [
            "--device",
            "cuda",
            "--max-num-seqs",
            "8",
            "--max-num-batched-tokens",
            "96",
            "--kv-cache-memory-bytes",
            str(2**28),
        ]
        + (["--speculative-config", spec] if spec else [])
    )
    engine = local_engine(args, 512)  # loads, profiles, warms up, captures graphs
    before = compilations()
    rng = random.Random(1)
    lens = [1, 2, 3, 5, 16, 17, 31, 47, 64, 95, 130, 257, 300, 411]
    for wave in range(2):
        for i, n in enumerate(rng.sample(lens, len(lens))):
            prompt = [rng.randrange(6, engine.vocab_size) for _ in range(n)]
            engine.add_request(
                f"{wave}-{i}",
                prompt,
                SamplingParams(
                    max_tokens=rng.randint(1, 9),
                    temperature=0.7,
                    top_p=0.9,
                    seed=i,
                    ignore_eos=True,
                ),
            )
        while engine.has_work():
            engine.step()
    assert (engine.spec_draft_tokens > 0) == (spec is not None)  # speculation did run
    new = compilations() - before
    assert new == 0, f"{new} kernel variants compiled, the last: " + "\n".join(recent()[-new:])
