"""V4.1 through the engine's plumbing, on ``v41-small`` (six layers, every role): a request's
numbers do not depend on how its tokens were cut into steps (chunked prefill, ratio-2 groups
split across chunks, decode after prefill), on its batch, or on preemption; what the torch path
does not run is an error naming the rule; the checkpoint as released loads, and a broken one
names the tensor."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engramrt.config import load_json
from engramrt.engine.block_manager import BlockManager
from engramrt.engine.build import EngineOptions, check, kv_blocks
from engramrt.engine.request import SamplingParams
from engramrt.model.checkpoint import CheckpointError, load_model
from engramrt.model.context import ForwardContext, GraphShape
from engramrt.models import model_config
from engramrt.models.deepseek_v41 import cache as v41_cache
from engramrt.models.deepseek_v41 import quant
from engramrt.parallel.launch import DistConfig
from engramrt.runner.batch import StepBatch
from engramrt.runner.stage import StageRunner
from tests.engine.test_engine import assert_idle, drain, run
from tests.engine.test_speculative import _run
from tests.support.engine_factory import build_engine
from tests.support.graph_replay import load_step, replayed_context

BLOCK = 16


@pytest.fixture(scope="module")
def runner(v41_small: Path) -> StageRunner:
    return StageRunner.load(v41_small, num_slots=4, max_len=256, dtype="float32")


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def blocks_for(slot: int, n: int) -> list[int]:
    return list(range(slot * 16, slot * 16 + -(-n // BLOCK)))


def run_steps(runner: StageRunner, runs: list[list[tuple[int, list[int]]]]) -> list[torch.Tensor]:
    """Steps of (slot, tokens) runs on a fresh cache (each slot on blocks 16 * slot..); every
    step's logits at each run's last token."""
    runner.allocate_kv(4, 256, BLOCK, 64)
    pos: dict[int, int] = {}
    out = []
    for step in runs:
        slots = [s for s, _ in step]
        lens = [len(t) for _, t in step]
        starts = [pos.get(s, 0) for s in slots]
        new = [
            blocks_for(s, p + n)[-(-p // BLOCK) if p else 0 :]
            for s, p, n in zip(slots, starts, lens, strict=True)
        ]
        new = [
            b if not p or (p + n - 1) // BLOCK >= -(-p // BLOCK) else []
            for b, p, n in zip(new, starts, lens, strict=True)
        ]
        tokens = [t for _, ts in step for t in ts]
        batch = StepBatch(
            tokens,
            slots,
            lens,
            starts,
            new_blocks=new,
            block_starts=[-(-p // BLOCK) for p in starts],
        )
        out.append(runner.compute(batch, last_only=True))
        for s, n in zip(slots, lens, strict=True):
            pos[s] = pos.get(s, 0) + n
    return out


def caches(runner: StageRunner, slot: int, n: int) -> dict[str, torch.Tensor]:
    """A slot's compressed entries and index keys (by entry) and rings, for comparison."""
    kv, out = runner.kv, {}
    table = torch.tensor(blocks_for(slot, n))
    for layer, comp in kv.compressed.items():
        r = runner.model.cfg.body.roles[layer].ratio
        rows = kv.entry_rows(table[None], torch.tensor([0]), torch.arange(n // r), r)
        out[f"compressed.{layer}"] = comp[rows]
        out[f"index_keys.{layer}"] = kv.index_keys[layer][rows]
    for layer, ring in kv.window.items():
        out[f"window.{layer}"] = ring[slot]
    return out


def test_chunked_prefill_equals_whole_prefill(runner: StageRunner) -> None:
    """Chunks of odd lengths (ratio-2 groups split between chunks, through the tail) and then
    decode steps give the logits and caches of one whole prefill of the same tokens."""
    tokens = prompt(53, 1)
    whole = run_steps(runner, [[(0, tokens)]])[-1]
    whole_caches = caches(runner, 0, 53)
    cuts = [0, 7, 20, 33, 50, 51, 52, 53]  # chunks of 7, 13, 13, 17, then three decode steps
    steps = [[(0, tokens[a:b])] for a, b in zip(cuts, cuts[1:], strict=False)]
    chunked = run_steps(runner, steps)[-1]
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    for name, value in caches(runner, 0, 53).items():
        torch.testing.assert_close(value, whole_caches[name], rtol=1e-5, atol=1e-5, msg=name)


def test_batched_runs_equal_runs_alone(runner: StageRunner) -> None:
    """Two requests prefilled and decoded in one batch (slots 1 and 2) get the logits each gets
    alone in slot 0."""
    a, b = prompt(37, 2), prompt(22, 3)
    alone = [run_steps(runner, [[(0, p[:-2])], [(0, p[-2:-1])], [(0, p[-1:])]]) for p in (a, b)]
    both = run_steps(
        runner,
        [[(1, a[:-2]), (2, b[:-2])], [(2, b[-2:-1]), (1, a[-2:-1])], [(1, a[-1:]), (2, b[-1:])]],
    )
    for step in range(3):
        got = dict(zip([[1, 2], [2, 1], [1, 2]][step], both[step], strict=True))
        torch.testing.assert_close(got[1], alone[0][step][0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got[2], alone[1][step][0], rtol=1e-5, atol=1e-5)


class ReplayedOnCpu:
    """``StepGraphs`` without CUDA: a decode step of ``shape`` runs as its graph would, the
    stage's forward on the graph's context with the host's step in it (``replayed_context``)."""

    def __init__(self, runner: StageRunner, shape: GraphShape):
        self.runner, self.shape, self.width = runner, shape, runner.slots.blocks.per_seq
        self.replays = 0

    def shape_for(self, run_lens, full_logits, tracer, drafts=None) -> GraphShape | None:
        return self.shape if drafts is None and self.shape.fits(run_lens) else None

    def replay(self, host: ForwardContext, shape: GraphShape, carry):
        r = self.runner
        ctx = replayed_context(host, r.kv, r.slots.blocks, self.width, shape, last_rows=True)
        out = r.forward(ctx, carry)
        self.replays += 1
        return out[: len(host.slots)], list(ctx.engram_ran)


def test_decode_steps_replayed_as_a_graph_equal_eager_steps(runner, monkeypatch) -> None:
    """Two requests decode three steps eagerly and as a 4-request decode graph replays them
    (whose table is wider than the host's: the host's rows land closer together): the same
    logits and caches, bit for bit. A replay once read the second run's blocks at the graph's
    row stride: its compressed entries and index keys went to the first run's rows. (The
    kernels' side: ``test_v41_kernels.test_graphs_replay_the_eager_steps`` on a GPU.)"""
    a, b = prompt(14, 5), prompt(9, 6)  # a's last steps close groups of 2 and 4
    steps = [[(1, a[:-3]), (2, b[:-3])]]
    steps += [[(1, [a[i]]), (2, [b[i]])] for i in range(-3, 0)]
    eager = run_steps(runner, steps)
    want = caches(runner, 1, len(a)), caches(runner, 2, len(b))
    graphs = ReplayedOnCpu(runner, GraphShape(True, 4, 4))
    monkeypatch.setattr(runner, "graphs", graphs)
    replayed = run_steps(runner, steps)
    assert graphs.replays == 3
    for got, ref in zip(replayed, eager, strict=True):
        assert torch.equal(got, ref)
    for slot, n, ref in ((1, len(a), want[0]), (2, len(b), want[1])):
        for name, value in caches(runner, slot, n).items():
            assert torch.equal(value, ref[name]), (slot, name)


def test_a_graph_context_forwarded_again_moves_its_own_runs(v41_small: Path) -> None:
    """A graph's context is forwarded at its warm-up and again at its capture, with another
    step in it: runs behind a verify run in flight are moved back by the blocks of the step
    they are in. The capture once moved them by the table its warm-up's layers had cached
    (an illegal address on the GPU in the verify-graph test, wrong rows here)."""
    r = StageRunner.load(v41_small, num_slots=4, max_len=256, dtype="float32")
    r.allocate_kv(4, 256, BLOCK, 64, slack=4)
    r.speculate(4, (4, 2))
    tables, shape = r.slots.blocks, GraphShape(True, 4, 4)
    tables.set([0, 1, 2, 3], None, [blocks_for(s, 48) for s in range(4)])
    r.verifier.rejected[:4] = torch.tensor([2, 1, 3, 1])

    def step(slots: list[int], starts: list[int], lags: list[int]) -> ForwardContext:
        runs = [1] * len(slots)
        return ForwardContext.for_runs(
            slots, runs, starts, r.kv, tables, "cpu", None, shape, last_rows=True, lag=lags
        )

    ctx = replayed_context(step([0, 1], [20, 30], [1, 1]), r.kv, tables, tables.per_seq, shape,
                           last_rows=True, lag=[])  # fmt: skip
    r.forward(ctx, None)  # the warm-up
    load_step(ctx, step([2, 3], [25, 17], [1, 1]))
    r.forward(ctx, None)  # the capture, another step in the buffer
    want = step([2, 3], [22, 16], [0, 0])
    assert torch.equal(ctx.positions, want.positions)
    assert torch.equal(ctx.slot_mapping, want.slot_mapping)


def test_preemption_by_recompute_gives_identical_outputs(runner: StageRunner) -> None:
    """Four requests in a cache too small for all of them: some are preempted (their blocks
    freed, their caches recomputed from the start) and still generate what they do alone."""
    prompts = [prompt(n, 10 + n) for n in (30, 41, 26, 35)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    alone = []
    for p in prompts:
        engine = build_engine(runner, 256, 4, max_num_seqs=4, block_size=4, num_blocks=64)
        engine.add_request("x", p, params)
        alone.append(drain(engine)["x"].ids)
    engine = build_engine(runner, 256, 4, max_num_seqs=4, block_size=4, num_blocks=40)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    results = drain(engine)
    assert engine.stats()["num_preemptions"] > 0
    assert_idle(engine)
    assert [results[str(i)].ids for i in range(4)] == alone


def turns(engine, first: list[int], rest: list[int], params: SamplingParams) -> list:
    """A chat's two turns and an unrelated request between them (it takes the slot, so the
    second turn's rings hold someone else's latents unless restored): each one's outputs."""
    a = run(engine, {"a": (first, params)})["a"]
    other = run(engine, {"o": (prompt(23, 99), params)})["o"]
    b = run(engine, {"b": (first + a.ids + rest, params)})["b"]
    return [(r.ids, [lp.logprob for lp in r.logprobs]) for r in (a, other, b)]


@pytest.mark.parametrize("snapshots, hits_b, hits_c", [(None, 56, 44), (3, 56, 0), (1, 0, 0)])
def test_prefix_hits_restore_the_window_and_equal_cold_runs(
    runner, snapshots, hits_b, hits_c
) -> None:
    """A second turn that repeats the first's prompt and outputs hits the blocks up to the
    last boundary the first computed (its decode steps left a window snapshot there) and
    generates what a cold engine does; a repeat of the first prompt hits up to its last full
    block boundary (the prompt's run was cut there). Each request keeps two snapshots, its
    prompt's and its latest; with fewer kept in all the least recently used go, the hits end
    earlier or not at all, and outputs still match."""
    first, rest = prompt(45, 31), prompt(9, 32)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    cold = turns(build_engine(runner, 256, 4, prefix_caching=False), first, rest, params)
    engine = build_engine(runner, 256, 4)
    if snapshots is not None:  # the same cache, fewer snapshots kept
        engine.blocks = BlockManager(engine.cfg.num_blocks, 4, True, snapshots)
        engine.scheduler.blocks = engine.blocks
    assert engine.blocks.snapshots == (snapshots or 8)
    warm = turns(engine, first, rest, params)
    for (ids, lps), (want_ids, want_lps) in zip(warm, cold, strict=True):
        assert ids == want_ids
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(want_lps), atol=1e-4, rtol=0)
    # kept (by when each was last used): a's 44 and 56 (its latest, moved on from 48 and 52),
    # the other's 20 and 32; b hits the 45 + 11 tokens a computed where 56 is still kept
    assert engine.stats()["prefix_cache_hits"] == hits_b
    again = run(engine, {"c": (first, params)})["c"]
    assert again.ids == cold[0][0]
    # b added 64 and 76: with three, the least recently used (44, 20, 32) went
    assert engine.stats()["prefix_cache_hits"] == hits_b + hits_c
    assert_idle(engine)


def test_engine_refuses_what_the_torch_path_does_not_run(v41_small: Path, capsys) -> None:
    """Illegal cuts, odd block sizes and DSpark drafts it cannot make (more than a block, target
    layers before the last stage, tensor parallelism) are errors naming the rule; prefix
    caching over a cache without window snapshots is switched off with a log line; the image
    token is a 400 (text-only serving)."""
    base = {"model_dir": v41_small, "partition": [6], "max_model_len": 256}
    check(EngineOptions(**{**base, "partition": [3, 3]}))  # a legal cut
    for bad, words in [
        ({"partition": [2, 4]}, ["layer 2", "legal cuts", "[1, 3]"]),
        ({"partition": [1, 1, 4]}, ["layer 2", "legal cuts"]),
        ({"block_size": 5}, ["--block-size", "even"]),
        (
            {"speculative_config": '{"method": "dspark", "num_speculative_tokens": 6}'},
            ["num_speculative_tokens 6", "block (5"],
        ),
        (
            {
                "speculative_config": '{"method": "dspark", "num_speculative_tokens": 2}',
                "dist": DistConfig(tp_size=2),
            },
            ["dspark", "-tp 1"],
        ),
    ]:
        with pytest.raises(ValueError) as err:
            check(EngineOptions(**{**base, **bad}))
        assert all(w in str(err.value) for w in words), err.value
    with pytest.raises(ValueError, match=r"last pipeline stage.*\[3, 4, 5\].*lacks layers \[3\]"):
        cfg = model_config(load_json(v41_small))
        cfg.family.check_drafting(cfg, [4, 5])  # (no legal cut of v41-small)
    runner = StageRunner.load(v41_small, num_slots=2, max_len=64, dtype="float32")
    runner.allocate_kv(2, 64, 4, 32, snapshots=0)
    engine = build_engine(runner, 64, 2, max_num_seqs=2, allocate=False)
    assert not engine.cfg.enable_prefix_caching and not engine.blocks.snapshots
    assert "prefix caching is off: this V4.1 cache keeps no window snapshots" in (
        capsys.readouterr().err
    )
    image = runner.model.cfg.engram.image_token_id
    with pytest.raises(ValueError, match=f"image token id {image}"):
        engine.limits.check([7, image, 8], SamplingParams(max_tokens=2))


def test_kv_sizing_counts_compressed_entries_and_rings(v41_small: Path, runner) -> None:
    """A byte budget buys blocks at the compressed KV's and index keys' bytes a token (each
    source's 64 + 64 values over its ratio) after the per-slot rings and tails, and, with
    prefix caching, two window snapshots a slot."""
    cfg = runner.model.cfg
    # 6 rings of 16 x 64, one ratio-2 tail (a, s), for 4 slots and the spare; a spare entry
    # (64 + 64 values) at each source; a snapshot: 6 rings
    rings = 5 * (6 * 16 * 64 * 4 + 2 * 64 * 4) + 2 * (64 + 64) * 4
    snapshot = 6 * 16 * 64 * 4
    per_token = (64 + 64) * 4 / 2 + (64 + 64) * 4 / 1  # sources at layers 1 (r 2), 3 (r 1)
    for caching, fixed in [(False, rings), (True, rings + 8 * snapshot)]:
        opts = EngineOptions(
            v41_small,
            [6],
            256,
            max_num_seqs=4,
            block_size=16,
            kv_cache_memory_bytes=2**20,
            enable_prefix_caching=caching,
        )
        want = min(4 * 16, int((2**20 - fixed) // (16 * per_token)))
        assert kv_blocks(runner, opts, cfg, 256) == want
        runner.allocate_kv(4, 256, 16, want, snapshots=8 if caching else 0)
        assert runner.kv.nbytes == fixed + want * 16 * per_token
        small = EngineOptions(
            v41_small,
            [6],
            256,
            max_num_seqs=4,
            block_size=16,
            kv_cache_memory_bytes=fixed,
            enable_prefix_caching=caching,
        )
        with pytest.raises(ValueError, match="--max-num-seqs 4 .* window rings"):
            kv_blocks(runner, small, cfg, 256)


def test_released_format_loads_and_broken_tensors_are_named(v41_small: Path, tmp_path, capsys):
    """FP8/FP4 weights stay as stored, ``wo_a`` too (a dense layer in the model, replaced at
    load by one holding the file's bytes), the DSpark tensors a released checkpoint carries
    are skipped with a log line (with DSpark, the stages' image routing biases); the vision
    tower loads as the model's; a missing or misshaped tensor is an error naming it."""
    model = load_model(v41_small, "float32")
    state = load_file(v41_small / "model.safetensors")
    wo_a = model.layers["2"].attn.wo_a
    assert isinstance(wo_a, quant.StoredLinear)
    for part in ("weight", "scale"):
        stored = state[f"layers.2.attn.wo_a.{part}"]
        assert torch.equal(getattr(wo_a, part).view(torch.uint8), stored.view(torch.uint8))
    stored = model.layers["2"].ffn.experts[0].w1
    assert stored.weight.dtype == torch.int8 and stored.scale.dtype == torch.float8_e8m0fnu
    assert model.layers["2"].attn.wq_b.weight.dtype == torch.float8_e4m3fn
    assert model.head.weight.dtype == torch.float32

    def variant(name: str, edit) -> Path:
        out = tmp_path / name
        shutil.copytree(v41_small, out)
        tensors = load_file(out / "model.safetensors")
        edit(tensors)
        save_file(tensors, out / "model.safetensors")
        index = json.loads((out / "model.safetensors.index.json").read_text())
        tables = {n: f for n, f in index["weight_map"].items() if "engram.embed" in n}
        index["weight_map"] = {**tables, **dict.fromkeys(tensors, "model.safetensors")}
        (out / "model.safetensors.index.json").write_text(json.dumps(index))
        return out

    extra = variant("extra", lambda t: t.update({"mtp.0.ffn.gate.bias_vl": torch.zeros(4)}))
    load_model(extra, "float32")
    assert "DSpark" in capsys.readouterr().err
    load_model(extra, "float32", dspark=True)  # the stages route as text, as the reference's
    assert "the DSpark stages' image-span routing biases" in capsys.readouterr().err
    # v41-small sees: its tower, aligner, span rows and routing biases are the model's own
    assert model.vision.blocks[1].mlp.w2.weight.shape == (64, 96)
    torch.testing.assert_close(
        model.layers["0"].ffn.gate.bias_vl, state["layers.0.ffn.gate.bias_vl"].float()
    )
    blind = variant("blind", lambda t: t.pop("vision.blocks.1.mlp.w2.weight"))
    with pytest.raises(CheckpointError, match="vision.blocks.1.mlp.w2.weight"):
        load_model(blind, "float32")
    missing = variant("missing", lambda t: t.pop("layers.4.attn.attn_sink"))
    with pytest.raises(CheckpointError, match="layers.4.attn.attn_sink"):
        load_model(missing, "float32")
    name = "layers.3.attn.indexer.wq_b.scale"
    shaped = variant("shaped", lambda t: t.update({name: t[name][:, :-1].contiguous()}))
    with pytest.raises(CheckpointError, match=name):
        load_model(shaped, "float32")


def test_decode_read_bytes_counted_by_hand(runner) -> None:
    """What a decode token at context 100 reads on v41-small (ratios [0, 2, 2, 1, 1, 1], window
    16, top-k 8, 64-wide latents and index keys; indexers at layers 1 (ratio 2), 3 and 5)."""
    cfg = runner.model.cfg.body
    window = 6 * 16 * 64
    picked = 5 * 8 * 64
    scanned = 50 * 64 + 100 * 64 + 100 * 64
    assert v41_cache.read_bytes(cfg, list(range(6)), 100, 2) == 2 * (window + picked + scanned)
    assert v41_cache.read_bytes(cfg, [0], 5, 4) == 4 * 5 * 64  # a short context's window


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 8}], ids=["plain", "chunked"])
def test_greedy_with_ngram_speculation_equals_without(runner: StageRunner, kw: dict) -> None:
    """Verify runs (an anchor and up to four drafts) through V4.1's attention, a multi-token
    run the reference never makes: the rejected drafts' ring rows, tail rows and compressed
    entries land where no later query reads them (rings of ``window + K`` rows, tails of
    ``K / 2 + 1``), so greedy tokens equal decoding without speculation, with whole and
    chunked prompts (``speculation_equals_plain``)."""
    speculation_equals_plain(lambda **kw: build_engine(runner, 256, 4, **kw), kw)


def speculation_equals_plain(engine_with, kw: dict, k: int = 4) -> None:
    """Greedy tokens with drafts equal those without (``speculative_run``)."""
    cfg = {"max_num_seqs": 1, "block_size": 4, "num_blocks": 64, **kw}
    want = _run(engine_with(**cfg), PROMPTS, PARAMS)
    assert speculative_run(engine_with, cfg, want, k) == want


PROMPTS = [prompt(n, 80 + n) for n in (30, 9, 41, 17)]
PARAMS = [SamplingParams(max_tokens=28, temperature=0, ignore_eos=True)] * len(PROMPTS)


def speculative_run(engine_with, cfg: dict, want: list[list[int]], k: int) -> list[list[int]]:
    """Greedy tokens of ``PROMPTS`` with ``k`` drafts a step. The random model never repeats
    itself, so the drafts come from ``want`` (the output without speculation), the first ``j``
    of them right and the rest wrong (``j`` cycling 0..K with the position): every acceptance
    length, every rollback length. Where the stage drafts into its token rows (one stage), the
    oracle stands in for its draft pass (``Verifier.propose``; what the pass itself drafted
    after a sampled run is kept in ``engine.stage_proposals`` by (request, tokens before the
    drafts)); elsewhere for the host's lookup. One request at a time: V4.1 is not
    batch-invariant (a GEMM's rounding depends on its row count, and the FP8/FP4 round trips
    turn a last-bit difference into a different grid point), so requests batched in other shapes
    may part for reasons that are no rollback's."""
    from dataclasses import replace

    from engramrt.engine.speculative import SpecConfig

    def oracle(tokens: list[int], limit: int) -> list[int]:
        (i,) = [i for i, p in enumerate(PROMPTS) if tokens[: len(p)] == p]
        done = len(tokens) - len(PROMPTS[i])
        right = done % (k + 1)
        drafts = want[i][done : done + min(k, limit)]
        return drafts[:right] + [(t + 1) % 1000 for t in drafts[right:]]

    class Oracle(SpecConfig):
        def propose(self, tokens: list[int], limit: int) -> list[int]:
            return oracle(tokens, limit)

    engine = engine_with(speculative=SpecConfig(k), **cfg)
    engine.cfg = replace(engine.cfg, speculative=Oracle(k))
    engine.stage_proposals = {}
    verifier = engine.pipeline.runner.verifier
    if engine.samples_kept:  # the oracle drafts on the stage, from what the host knows
        stage_pass, graphs = verifier.propose, verifier.graphs
        verifier.graphs = {}  # (a captured pass is the stage's)

        def propose(last, slots, bonus):
            (req,) = engine.scheduler.running
            n = int(last[0]) + 2  # tokens up to the bonus, the next run's anchor
            tokens = req.token_ids + [0] * (n - req.num_tokens)  # (the oracle reads the prompt)
            if n > req.num_tokens:  # after a sampled run (not a prompt chunk's)
                engine.stage_proposals[req.id, n] = stage_pass(last, slots, bonus)[0, :k].tolist()
            got = oracle(tokens, k)
            return torch.tensor([got + [0] * (k - len(got))], device=last.device)

        verifier.propose = propose
    try:
        out = _run(engine, PROMPTS, PARAMS)
    finally:
        if engine.samples_kept:
            verifier.propose, verifier.graphs = stage_pass, graphs
    stats = engine.stats()
    assert 0 < stats["spec_decode_num_accepted_tokens"] < stats["spec_decode_num_draft_tokens"]
    assert_idle(engine)
    return out


def ends_of(batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """Each run's last position and its slot: where a draft pass after the step starts."""
    ends = [p + n - 1 for p, n in zip(batch.start_pos, batch.run_lens, strict=True)]
    return torch.tensor(ends), torch.tensor(batch.slots)
