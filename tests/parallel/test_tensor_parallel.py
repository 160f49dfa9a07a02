"""Tensor parallelism: every rank's slices put back together are the unsharded model (the
Engram rows bit for bit); TP = 2 and TP = 2 x PP = 2 over gloo give the greedy tokens of one
process and logits within 1e-5 of the largest (``check-pp``, whose reference is one process
without TP); a rank that dies takes the others down; a TP server frees its KV blocks."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.commands.check_pp import CheckOptions, check_pp
from engramrt.engram.layout import EngramLayout
from engramrt.engram.module import Engram
from engramrt.engram.table import EngramTable
from engramrt.model.checkpoint import load_model
from engramrt.parallel.launch import DistConfig, free_port
from engramrt.tensor_parallel import TensorParallel
from tests.support.model_factory import make_model, save_model

PROMPTS = ["The capital of Bribrinu is", "12 + 7 =", "x"]
MOE = {
    "ffn_type": "moe",
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "engram_layer_ids": [0, 1],
}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model, raw = make_model(seed=9, fp8_tables=True, **MOE)
    return save_model(model, raw, tmp_path_factory.mktemp("moe"))


def _ranks(model_dir: Path, size: int, **kw) -> list:
    return [
        load_model(model_dir, torch.float32, tp=TensorParallel(r, size), **kw) for r in range(size)
    ]


# --- the slices (in process: loading needs no process group) ---------------------------------


@pytest.mark.parametrize(
    ("which", "size", "tables"),
    [
        ("default", 2, "device"),
        ("default", 4, "device"),
        ("default", 2, "host"),
        ("moe", 2, "device"),
        ("moe", 2, "host"),
        ("v41", 2, "device"),
    ],
)
def test_rank_slices_reassemble_the_model(
    which: str, size: int, tables: str, moe_dir, v41_small
) -> None:
    """Every checkpoint tensor is whole on each rank or split along its shard dimension, the
    ranks' parts in order (a KV head replicated below ``size`` heads: its copies equal); each
    rank reads only its slices of the file, host-memory tables included (its rows only). V4.1:
    FP8/FP4 weights and their scales sliced on whole scale blocks (``wo_a``'s held as stored
    from its slice), the latent, compressor and indexer replicated."""
    model_dir = {"default": GQA_MODEL_DIR, "moe": moe_dir, "v41": v41_small}[which]
    full = load_model(model_dir, torch.float32)
    ranks = _ranks(model_dir, size, table_memory=tables)
    if tables == "host":
        for m in ranks:
            for i in m.engram_layer_ids:
                table = m.layers[str(i)].engram.embed
                lo, hi = m.layers[str(i)].engram.row_span
                assert table.host is not None and table.num_rows == hi - lo
    want = full.state_dict()
    states = [m.state_dict() for m in ranks]
    slices = [m.checkpoint_slices() for m in ranks]
    assert slices[0] and all(s.keys() == slices[0].keys() for s in slices)
    for name, t in want.items():
        if name not in slices[0]:
            for s in states:
                assert torch.equal(s[name].view(torch.uint8), t.view(torch.uint8)), name
            continue
        dim = slices[0][name][0]
        parts = [s[name] for s in states]
        if len({tuple(sl[name][1:]) for sl in slices}) < size:  # replicated KV heads
            parts = list({sl[name][1]: p for sl, p in zip(slices, parts, strict=True)}.values())
        got = torch.cat(parts, dim=dim)
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8)), name
    shard_bytes = [sum(t.numel() * t.element_size() for t in s.values()) for s in states]
    assert max(shard_bytes) < sum(t.numel() * t.element_size() for t in want.values())


@pytest.mark.parametrize("size", [2, 3, 5])
def test_sharded_engram_rows_are_the_unsharded_lookup(size: int) -> None:
    """Each rank looks up its hash columns in its rows only; the padded concatenation of the
    ranks' rows (what the all-gather builds) is bitwise the unsharded lookup, fp8 included.
    Sizes that do not divide the 24 columns leave short (or empty) last parts."""
    full = load_model(GQA_MODEL_DIR, torch.float32)
    g = torch.Generator().manual_seed(size)
    layout = EngramLayout.from_config(full.cfg.engram)
    for index, i in enumerate(full.engram_layer_ids):
        engram = full.layers[str(i)].engram
        bounds = torch.tensor(layout.column_bounds(index))  # random ids in each column's rows
        lo, hi = bounds[:-1], bounds[1:]
        ids = lo + (torch.rand(9, engram.cols, generator=g) * (hi - lo)).long()
        want = engram.lookup(ids)
        per = -(-engram.cols // size) * engram.head_dim
        parts, spans = [], []
        for r in range(size):
            shard = Engram(full.cfg.engram, index, tp=TensorParallel(r, size))
            lo, hi = shard.row_span
            table = engram.embed
            shard.embed = EngramTable(table.weight[lo:hi], table.scale[lo:hi], row_start=lo)
            part = shard.lookup(ids)
            parts.append(torch.nn.functional.pad(part, (0, per - part.shape[-1])))
            spans.append(shard.row_span)
        got = torch.cat(parts, dim=-1)[:, : want.shape[-1]]
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))
        assert spans[0][0] == 0 and spans[-1][1] == engram.embed.num_rows
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))


def test_sizes_that_do_not_divide_name_the_rule() -> None:
    with pytest.raises(ValueError, match=r"tensor-parallel-size 3 must divide num_attention_"):
        load_model(GQA_MODEL_DIR, tp=TensorParallel(0, 3))


# --- against one process without TP (gloo, fp32) ------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stages", [1, 2])
@pytest.mark.parametrize("which", ["default", "moe", "v41"])
def test_tp2_matches_one_process(which: str, stages: int, moe_dir: Path, v41_small) -> None:
    """TP = 2 (and TP = 2 x PP = 2, every partition; V4.1: every legal one) against TP = 1,
    PP = 1: greedy tokens identical over a prefill and 6 decode steps, logits within 1e-3;
    every Engram layer ran on its stage."""
    model_dir = {"default": GQA_MODEL_DIR, "moe": moe_dir, "v41": v41_small}[which]
    report = check_pp(
        CheckOptions(
            model_dir, stages=stages, prompts=PROMPTS, decode_steps=6, dist=DistConfig(tp_size=2)
        )
    )
    assert report["tensor_parallel_size"] == 2 and report["partitions"]
    for row in report["partitions"]:
        assert row["error"] is None and row["greedy_tokens_identical"] and row["engram_runs_ok"]
        assert row["max_abs_dlogit"] < 1e-3
    assert report["ok"]


@pytest.mark.slow
def test_a_dead_tp_rank_ends_the_group_quickly() -> None:
    """Two TP ranks of one stage started as torchrun would; the follower dies after one step.
    The leader must exit with an error within seconds, not wait out its 600 s timeout."""
    script = Path(__file__).parents[1] / "support" / "pp_stage_dies.py"
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
        "WORLD_SIZE": "2",
        "PYTHONPATH": str(Path(__file__).parents[2]),
    }
    start = time.monotonic()
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), "600", "tp"],
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for r in range(2)
    ]
    codes = [p.wait(timeout=120) for p in procs]
    assert codes[1] == 3 and codes[0] != 0
    assert time.monotonic() - start < 60


# --- NCCL collectives inside CUDA graphs (GPU) -----------------------------------------------


@pytest.mark.gpu
def test_nccl_collectives_replay_in_cuda_graphs(monkeypatch) -> None:
    """A one-rank NCCL group sends every collective of a TP step (embedding and row-parallel
    all-reduces, Engram and logit all-gathers, the hash-id broadcast) through torch's NCCL
    process group inside the capture; the decode graphs give the logits and history of the
    model without a group, stepped eagerly. (With one rank NCCL itself launches no kernel: that
    part needs two GPUs, ``test_tp2_over_nccl_matches_one_gpu``.)"""
    import random

    import torch.distributed as dist

    from engramrt import tensor_parallel
    from engramrt.engram import load_hasher
    from engramrt.runner.batch import StepBatch
    from engramrt.runner.stage import StageRunner, new_kv_cache

    calls: dict[str, int] = {}
    for name in ("all_reduce", "all_gather_into_tensor", "broadcast"):
        real = getattr(dist, name)
        monkeypatch.setattr(
            tensor_parallel.dist,
            name,
            lambda *a, _r=real, _n=name, **k: (
                calls.__setitem__(_n, calls.get(_n, 0) + 1),
                _r(*a, **k),
            )[1],
        )
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        model_dir, slots = GQA_MODEL_DIR, 9
        one = TensorParallel(0, 1, dist.group.WORLD, 0)

        def runner(tp: TensorParallel) -> StageRunner:
            model = load_model(model_dir, torch.float32, "cuda", tp=tp)
            hasher, tok = load_hasher(model_dir, slots, "cuda")
            return StageRunner(model, hasher, new_kv_cache(model, slots, 64), tok)

        eager, graphed = runner(tensor_parallel.SINGLE), runner(one)
        graphed.capture_graphs(8)
        assert {"all_reduce", "all_gather_into_tensor", "broadcast"} <= calls.keys()
        rng = random.Random(7)
        picked = rng.sample(range(1, slots), 5)
        prompts = [[rng.randrange(6, 1000) for _ in range(rng.randint(2, 9))] for _ in picked]
        first = StepBatch(
            [t for p in prompts for t in p], picked, [len(p) for p in prompts], [0] * len(picked)
        )
        for r in (eager, graphed):
            r.compute(first)
        pos = [len(p) for p in prompts]
        for _ in range(4):
            nxt = [rng.randrange(6, 1000) for _ in picked]
            batch = StepBatch(nxt, picked, [1] * len(picked), pos)
            want, got = eager.compute(batch), graphed.compute(batch)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # padded GEMMs may
            assert torch.equal(got.argmax(-1), want.argmax(-1))  # round differently
            pos = [p + 1 for p in pos]
        assert torch.equal(graphed.hasher.history.table, eager.hasher.history.table)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp2_over_nccl_matches_one_gpu() -> None:
    """Two GPUs, NCCL, decode steps in CUDA graphs: TP = 2 gives one GPU's greedy tokens."""
    two = DistConfig(tp_size=2, device="cuda")
    report = check_pp(
        CheckOptions(GQA_MODEL_DIR, stages=1, prompts=PROMPTS, decode_steps=6, dist=two)
    )
    assert report["partitions"] and report["ok"]
    for row in report["partitions"]:
        assert row["error"] is None and row["greedy_tokens_identical"] and row["engram_runs_ok"]
