"""The GPU runner's pieces against their references: a padded decode step (what a CUDA graph
replays) against the unpadded one, the Triton attention path against the torch path through a
real ForwardContext (Triton's interpreter on a CPU), batched sampling against one row at a time,
and on a GPU (``-m gpu``, skipped elsewhere) graph replay against eager for every captured size."""

from __future__ import annotations

import random

import pytest
import torch

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.engram import load_hasher
from engramrt.model.context import ForwardContext, GraphShape
from engramrt.model.layers import apply_rope, rope_tables
from engramrt.models.gqa.attention import _torch_attention
from engramrt.models.gqa.cache import GQACache
from engramrt.runner.batch import SampleRow, StepBatch
from engramrt.runner.sampler import sample_tokens
from engramrt.runner.stage import StageRunner, new_kv_cache
from tests.support.kernel_env import interpreter_on, kernel_device, triton_runs
from tests.support.model_factory import make_model


def new_session(model, slots: int) -> StageRunner:
    hasher, tok = load_hasher(GQA_MODEL_DIR, slots, next(model.parameters()).device)
    return StageRunner(model, hasher, new_kv_cache(model, slots, 64), tok)


@pytest.fixture(scope="module")
def model():
    return make_model(seed=3, num_hidden_layers=3, engram_layer_ids=[0, 2])[0]


def _prefill(sessions: list[StageRunner], rng: random.Random, slots: list[int]) -> list[list[int]]:
    prompts = [[rng.randrange(6, 1024) for _ in range(rng.randint(1, 9))] for _ in slots]
    for s in sessions:
        s.compute(
            StepBatch(
                [t for p in prompts for t in p], slots, [len(p) for p in prompts], [0] * len(slots)
            )
        )
    return prompts


@pytest.mark.parametrize("pad_to", [3, 4, 8])
def test_padded_decode_equals_unpadded(model, pad_to: int) -> None:
    """Padding rows (history slot 0, which no request owns) change no logit of a real row,
    commit no history and write no K/V. Matmuls of another row count may round differently,
    so floats agree to fp32 rounding; history and the padding's own blocks exactly."""
    rng = random.Random(pad_to)
    plain, padded = new_session(model, 4), new_session(model, 4)
    slots = [3, 1, 2]
    seqs = _prefill([plain, padded], rng, slots)
    for _ in range(3):
        nxt = [rng.randrange(6, 1024) for _ in slots]
        pos = [len(q) for q in seqs]
        want = plain.compute(StepBatch(nxt, slots, [1] * 3, pos))
        padded.slots.advance(StepBatch(nxt, slots, [1] * 3, pos))  # the rows it reads from
        ctx = ForwardContext.for_runs(
            slots,
            [1] * 3,
            pos,
            padded.kv,
            padded.slots.blocks,
            "cpu",
            width=padded.slots.blocks.per_seq,
            pad=GraphShape(True, pad_to, pad_to),
        )
        got = padded.forward(ctx, None)
        assert got.shape[0] == pad_to and ctx.engram_ran == [0, 2]
        torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[:3].argmax(-1), want.argmax(-1))
        for q, t in zip(seqs, nxt, strict=True):
            q.append(t)
    assert torch.equal(padded.hasher.history.table, plain.hasher.history.table)
    assert_padding_left_no_trace(padded, plain, model.layer_ids)


def assert_padding_left_no_trace(padded: StageRunner, plain: StageRunner, layers) -> None:
    """Slot 0, which only padding uses, has no history and no K/V; the cache is the unpadded
    run's (to fp32 rounding: GEMMs of other shapes)."""
    assert not padded.hasher.history.table[0].any()
    tables = padded.slots.blocks
    slot0 = tables.rows(tables.fixed(0), 0, 64, "cpu")
    for i in layers:
        torch.testing.assert_close(padded.kv.k[i], plain.kv.k[i], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(padded.kv.v[i], plain.kv.v[i], rtol=1e-5, atol=1e-5)
        assert not padded.kv.k[i][slot0].any() and not padded.kv.v[i][slot0].any()


@pytest.mark.parametrize(
    ("tokens", "requests", "kernel"),
    [
        (16, 4, False),
        (32, 16, False),
        (24, 5, False),
        pytest.param(16, 4, True, marks=pytest.mark.triton),
    ],
)
def test_padded_mixed_step_equals_unpadded(model, tokens: int, requests: int, kernel) -> None:
    """A mixed step (a prompt chunk beside decode rows) padded to a
    mixed graph's shape: the unpadded step's logits at each run's last token (the rows sampling
    reads), the same history and K/V, and the padding writes and commits nothing. The eager
    ``last_only`` step gives the same rows. Floats to fp32 rounding (GEMMs of other shapes).
    ``kernel``: the padded step hashes and commits with the Triton kernel (interpreted)."""
    if kernel and not interpreter_on():  # natively: test_kernels, and the graph tests on CUDA
        pytest.skip("this CPU model's step runs the hash kernel in Triton's interpreter")
    rng = random.Random(tokens * requests)
    full, last, padded = (new_session(model, 6) for _ in range(3))
    if kernel:
        from engramrt.kernels.engram_hash import TritonHashOps

        padded.hasher.ops = TritonHashOps(padded.hasher)
    slots = [3, 1, 2]
    seqs = _prefill([full, last, padded], rng, slots)
    shape = GraphShape(False, tokens, requests)
    for _ in range(4):
        lens = [1, rng.randint(2, 6), 1]
        rng.shuffle(lens)
        nxt = [rng.randrange(6, 1024) for _ in range(sum(lens))]
        pos = [len(q) for q in seqs]
        batch = StepBatch(nxt, slots, lens, pos)
        ends = [sum(lens[: i + 1]) - 1 for i in range(len(lens))]
        want = full.compute(batch)[ends]
        rows = last.compute(batch, last_only=True)  # a GEMM of fewer rows may round differently
        torch.testing.assert_close(rows, want, rtol=1e-5, atol=1e-5)
        padded.slots.advance(batch)
        ctx = ForwardContext.for_runs(
            slots,
            lens,
            pos,
            padded.kv,
            padded.slots.blocks,
            "cpu",
            padded.slots.blocks.per_seq,
            shape,
            last_rows=True,
        )
        assert ctx.positions.numel() == tokens and ctx.tiles[0].numel() == shape.tiles
        got = padded.forward(ctx, None)
        assert got.shape[0] == requests and ctx.engram_ran == [0, 2]
        torch.testing.assert_close(got[:3], want, rtol=1e-5, atol=1e-5)
        assert torch.equal(got[:3].argmax(-1), want.argmax(-1))
        at = 0
        for q, n in zip(seqs, lens, strict=True):
            q += nxt[at : at + n]
            at += n
    rows = full.hasher.history.num_slots  # the row past them is the reference's scratch row
    for s in (last, padded):
        assert torch.equal(s.hasher.history.table[:rows], full.hasher.history.table[:rows])
    assert_padding_left_no_trace(padded, full, model.layer_ids)


def test_graph_shape_bounds_every_runs_tiles() -> None:
    """The tile count a mixed graph launches covers the tiles of any runs that fit it (the
    brute-force count from ``prefill_tiles``), at the worst cases: runs just past a tile."""
    from engramrt.kernels.tiles import PREFILL_TILE, prefill_tiles

    rng = random.Random(0)
    for _ in range(300):
        shape = GraphShape(False, rng.randint(2, 3000), rng.randint(1, 64))
        b = rng.randint(1, min(shape.requests, shape.tokens))
        lens = [rng.choice([1, PREFILL_TILE + 1, rng.randint(1, 400)]) for _ in range(b)]
        while sum(lens) > shape.tokens:
            lens[lens.index(max(lens))] //= 2
        assert shape.fits(lens)
        assert len(prefill_tiles(lens)[0]) <= shape.tiles


def test_padding_rejects_prefill_runs(model) -> None:
    s = new_session(model, 2)
    with pytest.raises(ValueError, match="one-token runs"):
        ForwardContext.for_runs(
            [0], [2], [0], s.kv, s.slots.blocks, "cpu", pad=GraphShape(True, 4, 4)
        )
    with pytest.raises(ValueError, match="at most 4 tokens"):
        ForwardContext.for_runs(
            [0], [5], [0], s.kv, s.slots.blocks, "cpu", pad=GraphShape(False, 4, 2)
        )


# --- Triton attention against torch, through the model's own context ----------------------


def _attention_case(
    seed: int,
    run_lens: list[int],
    start_pos: list[int],
    heads=4,
    kv_heads=2,
    dim=16,
    bs=4,
    pad: GraphShape | None = None,
):
    g = torch.Generator().manual_seed(seed)
    n = len(run_lens)
    kv = GQACache([0], 64, bs, kv_heads, dim, torch.float32, "cpu", 48, num_slots=n)
    kv.k[0].normal_(generator=g)  # earlier positions (a prefix-cache hit) are already there
    kv.v[0].normal_(generator=g)
    perm = torch.randperm(64, generator=g).tolist()
    tables = [perm[i * 12 : (i + 1) * 12] for i in range(n)]
    blocks = kv.fixed_tables()
    blocks.set(list(range(n)), None, tables)
    ctx = ForwardContext.for_runs(
        list(range(n)), run_lens, start_pos, kv, blocks, "cpu", width=12 if pad else None, pad=pad
    )
    t = ctx.positions.numel()
    q = torch.randn(t, heads, dim, generator=g)
    k = torch.randn(t, kv_heads, dim, generator=g)
    v = torch.randn(t, kv_heads, dim, generator=g)
    return ctx, q, k, v


def _both_paths(ctx, q, k, v):
    """The torch path rotates q and k and attends; the Triton path takes the stacked
    projection and does the same (rotation fused with the cache write)."""
    from engramrt.models.gqa.attention import _triton_attention

    dev = kernel_device()
    kc, vc = ctx.kv.k[0].clone(), ctx.kv.v[0].clone()
    cos, sin = rope_tables(ctx.positions, q.shape[-1], 1e4)
    want = _torch_attention(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v, kc, vc, ctx)
    tctx = ForwardContext(**{f: getattr(ctx, f) for f in ctx.__dataclass_fields__})
    for f in ctx.__dataclass_fields__:
        if isinstance(getattr(ctx, f), torch.Tensor):
            setattr(tctx, f, getattr(ctx, f).to(dev))
    if ctx.tiles is not None:
        tctx.tiles = tuple(x.to(dev) for x in ctx.tiles)
    kd, vd = ctx.kv.k[0].to(dev), ctx.kv.v[0].to(dev)
    qkv = torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1).to(dev)
    got = _triton_attention(qkv, cos.to(dev), sin.to(dev), kd, vd, tctx, q.shape[1]).cpu()
    return got, want, (kd.cpu(), vd.cpu()), (kc, vc)


triton_only = pytest.mark.skipif(not triton_runs(), reason="Triton cannot run here")


@triton_only
@pytest.mark.triton
@pytest.mark.parametrize(
    ("run_lens", "start_pos"),
    [([5, 0, 33, 1], [0, 3, 7, 20]), ([1, 1, 1], [0, 9, 40]), ([40], [0]), ([3, 2], [13, 0])],
)
def test_triton_attention_matches_torch(run_lens, start_pos) -> None:
    """Prefill (chunks starting after cached positions, an empty run, a run past one tile) and
    decode: the same outputs and the same cache as the torch path."""
    ctx, q, k, v = _attention_case(sum(run_lens), run_lens, start_pos)
    got, want, (kd, vd), (kc, vc) = _both_paths(ctx, q, k, v)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kd, kc, rtol=1e-6, atol=1e-6)  # rotated k: fp32 rounding apart
    assert torch.equal(vd, vc)


@triton_only
@pytest.mark.triton
def test_triton_decode_padding_writes_and_reads_nothing() -> None:
    ctx, q, k, v = _attention_case(5, [1, 1], [4, 17], pad=GraphShape(True, 4, 4))
    got, want, (kd, vd), (kc, vc) = _both_paths(ctx, q, k, v)
    torch.testing.assert_close(got[:2], want[:2], rtol=1e-5, atol=1e-5)
    assert not got[2:].any()
    torch.testing.assert_close(kd, kc, rtol=1e-6, atol=1e-6)  # rotated k: fp32 rounding apart
    assert torch.equal(vd, vc)
    others = torch.ones(kd.shape[0], dtype=torch.bool)
    others[ctx.slot_mapping[:2]] = False  # the padded rows wrote nowhere
    assert torch.equal(kd[others], ctx.kv.k[0][others])
    assert torch.equal(vd[others], ctx.kv.v[0][others])


# --- sampling ------------------------------------------------------------------------------


def test_batched_sampling_equals_each_row_alone() -> None:
    """Greedy and seeded rows with every truncation give in a batch what each gives alone."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g) * 3
    rows = [
        SampleRow(),
        SampleRow(temperature=0.7, seed=5, index=2),
        SampleRow(temperature=1.3, top_k=17, seed=6),
        SampleRow(temperature=1.0, top_p=0.8, seed=7, index=9),
        SampleRow(temperature=0.9, min_p=0.05, top_k=40, top_p=0.95, seed=8),
        SampleRow(temperature=1e-7),
    ]
    batch = sample_tokens(logits, rows, None)
    alone = [sample_tokens(logits[i : i + 1], [r], None)[0] for i, r in enumerate(rows)]
    assert batch == alone
    assert batch[0] == int(logits[0].argmax()) and batch[5] == int(logits[5].argmax())


def test_truncation_keeps_only_allowed_tokens() -> None:
    """Over many seeds, sampled tokens stay inside the top-k / top-p sets computed directly."""
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(1, 50, generator=g) * 2
    order = logits[0].argsort(descending=True).tolist()
    probs = torch.softmax(logits[0], -1)[order]
    nucleus = order[: int((probs.cumsum(0) - probs < 0.6).sum())]
    for seed in range(200):
        row_k = SampleRow(temperature=1.0, top_k=5, seed=seed)
        row_p = SampleRow(temperature=1.0, top_p=0.6, seed=seed)
        toks = sample_tokens(logits.repeat(2, 1), [row_k, row_p], None)
        assert toks[0] in order[:5] and toks[1] in nucleus


@triton_only
@pytest.mark.triton
@pytest.mark.parametrize(("run_lens", "start_pos"), [([5, 1, 33], [0, 9, 3]), ([1, 2], [7, 0])])
def test_triton_mixed_padding_writes_and_reads_nothing(run_lens, start_pos) -> None:
    """A mixed step padded to a graph's shape (orphan tokens, empty runs, tiles past every
    run): the real tokens' outputs and the cache as the torch path gives them unpadded."""
    shape = GraphShape(False, 48, 5)
    ctx, q, k, v = _attention_case(7, run_lens, start_pos, pad=shape)
    assert ctx.tiles[0].numel() == shape.tiles and ctx.positions.numel() == 48
    got, want, (kd, vd), (kc, vc) = _both_paths(ctx, q, k, v)
    real = sum(run_lens)
    torch.testing.assert_close(got[:real], want[:real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(kd, kc, rtol=1e-6, atol=1e-6)
    assert torch.equal(vd, vc)


@pytest.mark.parametrize(("requests", "drafts"), [(3, 3), (5, 3), (8, 1)])
def test_padded_verify_step_equals_unpadded(model, requests: int, drafts: int) -> None:
    """A verify step (every run an anchor and ``drafts`` drafts, sampled after every token)
    padded to a verify graph's shape: the eager step's logits at every token, no history
    committed by either (verify runs commit later, through ``commit_verify``), the same K/V,
    and the padded runs (K + 1 tokens each, reading slot 0) write and commit nothing."""
    rng = random.Random(requests * 10 + drafts)
    plain, padded = new_session(model, 6), new_session(model, 6)
    slots = [3, 1, 2]
    seqs = _prefill([plain, padded], rng, slots)
    rows = plain.hasher.history.num_slots  # the row past them is a scratch (sink) row
    before = plain.hasher.history.table[:rows].clone()
    shape = GraphShape(False, requests * (drafts + 1), requests, drafts)
    lens, pos = [drafts + 1] * 3, [len(q) for q in seqs]
    nxt = [rng.randrange(6, 1024) for _ in range(sum(lens))]
    want = plain.compute(StepBatch(nxt, slots, lens, pos, drafts=[drafts] * 3), last_only=True)
    padded.slots.advance(StepBatch(nxt, slots, lens, pos))
    ctx = ForwardContext.for_runs(
        slots,
        lens,
        pos,
        padded.kv,
        padded.slots.blocks,
        "cpu",
        padded.slots.blocks.per_seq,
        shape,
        last_rows=True,
        drafts=[drafts] * 3,
    )
    assert shape.fits(lens) and not shape.fits([1, *lens[1:]])
    got = padded.forward(ctx, None)
    assert want.shape[0] == sum(lens) and got.shape[0] == shape.tokens
    torch.testing.assert_close(got[: sum(lens)], want, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[: sum(lens)].argmax(-1), want.argmax(-1))
    for s in (plain, padded):
        assert torch.equal(s.hasher.history.table[:rows], before)
    assert_padding_left_no_trace(padded, plain, model.layer_ids)


# --- CUDA graphs (GPU) ---------------------------------------------------------------------


@pytest.mark.gpu
def test_graph_replay_equals_eager_for_every_size() -> None:
    """fp32: for every captured size, and one under it (padding), graph decode steps give the
    eager steps' logits and tokens, history and KV."""
    from engramrt.runner.graphs import batch_sizes

    model = make_model(seed=4, num_hidden_layers=3, engram_layer_ids=[0, 2])[0].cuda()
    max_batch = 18
    eager, graphed = new_session(model, max_batch + 1), new_session(model, max_batch + 1)
    graphed.capture_graphs(max_batch)
    assert graphed.graphs.sizes == batch_sizes(max_batch) == [1, 2, 4, 8, 16, 18]
    rng = random.Random(0)
    for n in sorted({m for b in graphed.graphs.sizes for m in (b, max(1, b - 1))}):
        slots = rng.sample(range(max_batch + 1), n)
        for s in (eager, graphed):
            s.hasher.history.table.zero_()
        seqs = _prefill([eager, graphed], rng, slots)
        for _ in range(3):
            nxt = [rng.randrange(6, 1024) for _ in slots]
            pos = [len(q) for q in seqs]
            want = eager.compute(StepBatch(nxt, slots, [1] * n, pos))
            got = graphed.compute(StepBatch(nxt, slots, [1] * n, pos))
            assert torch.equal(got.argmax(-1), want.argmax(-1))  # padded matmuls may round
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)  # differently
            for q, t in zip(seqs, nxt, strict=True):
                q.append(t)
        assert torch.equal(graphed.hasher.history.table, eager.hasher.history.table)
    assert graphed.engram_ran == eager.engram_ran


@pytest.mark.gpu
def test_mixed_graph_replay_equals_eager() -> None:
    """fp32: mixed steps (prompt chunks beside decode rows) of token counts across the captured
    buckets replay graphs and give the eager steps' sampled rows, history and K/V; a step that
    wants every token's logits runs eagerly."""
    from engramrt.runner import graphs as graphs_mod

    model = make_model(seed=5, num_hidden_layers=3, engram_layer_ids=[0, 2])[0].cuda()
    slots_n, max_len = 9, 256

    def session() -> StageRunner:
        hasher, tok = load_hasher(GQA_MODEL_DIR, slots_n, "cuda")
        return StageRunner(model, hasher, new_kv_cache(model, slots_n, max_len), tok)

    eager, graphed = session(), session()
    graphed.capture_graphs(8, 160)
    mixed = [s for s in graphed.graphs.shapes if not s.decode]
    assert [s.tokens for s in mixed] == graphs_mod.token_sizes(160) == [16, 32, 64, 128, 160]
    replays = []
    real_replay = graphed.graphs.replay
    graphed.graphs.replay = lambda host, shape, carry: (
        replays.append(shape) or real_replay(host, shape, carry)
    )
    rng = random.Random(1)
    slots = list(range(1, slots_n))
    seqs = _prefill([eager, graphed], rng, slots)
    for total in (5, 17, 40, 100, 150, 60, 130, 3):
        short = min(slots, key=lambda s: len(seqs[s - 1]))  # the chunk's: room for it
        pick = [
            short,
            *rng.sample([s for s in slots if s != short], rng.randint(0, min(7, total - 1))),
        ]
        lens = [1] * len(pick)
        lens[0] += total - len(pick)  # one chunk, the rest decode rows
        nxt = [rng.randrange(6, 1024) for _ in range(sum(lens))]
        pos = [len(seqs[s - 1]) for s in pick]
        batch = StepBatch(nxt, pick, lens, pos)
        ends = [sum(lens[: i + 1]) - 1 for i in range(len(lens))]
        want = eager.compute(batch)[ends]
        got = graphed.compute(batch, last_only=True)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        at = 0
        for s, n in zip(pick, lens, strict=True):
            seqs[s - 1] += nxt[at : at + n]
            at += n
    assert len(replays) == 8 and not any(s.decode for s in replays[:-1])
    assert torch.equal(graphed.hasher.history.table, eager.hasher.history.table)
    for i in model.layer_ids:
        torch.testing.assert_close(graphed.kv.k[i], eager.kv.k[i], rtol=1e-5, atol=1e-5)
    n = len(replays)
    last = StepBatch([7, 8], [1], [2], [len(seqs[0])])  # every token's logits: eager
    torch.testing.assert_close(graphed.compute(last), eager.compute(last), rtol=1e-5, atol=1e-5)
    assert len(replays) == n
    assert graphed.engram_ran == eager.engram_ran


# --- the fused mHC Sinkhorn ----------------------------------------------------------------


@triton_only
@pytest.mark.triton
@pytest.mark.parametrize(("tokens", "hc", "iters"), [(1, 4, 20), (37, 4, 20), (5, 2, 3), (3, 8, 1)])
def test_fused_sinkhorn_matches_torch(tokens: int, hc: int, iters: int) -> None:
    """Random mixes, scales and biases: the kernel's pre/post/comb equal the torch reference to
    fp32 rounding, and comb's columns sum to one as the last step makes them."""
    from engramrt.kernels.mhc_sinkhorn import split_sinkhorn
    from engramrt.model.mhc import hc_split_sinkhorn

    g = torch.Generator().manual_seed(tokens * hc + iters)
    mixes = torch.randn(tokens, (2 + hc) * hc, generator=g) * 3
    scale, base = torch.rand(3, generator=g) + 0.5, torch.randn((2 + hc) * hc, generator=g)
    want = hc_split_sinkhorn(mixes, scale, base, hc, iters, 1e-6)
    dev = kernel_device()
    got = split_sinkhorn(mixes.to(dev), scale.to(dev), base.to(dev), hc, iters, 1e-6)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.cpu(), b, rtol=2e-6, atol=2e-6)
    torch.testing.assert_close(got[2].sum(1).cpu(), torch.ones(tokens, hc), rtol=0, atol=1e-5)


# --- what serving sets up around the runner ------------------------------------------------


def test_loaded_models_carry_no_autograd_state() -> None:
    """A captured graph would otherwise keep saved tensors alive in its pool."""

    s = StageRunner.load(GQA_MODEL_DIR)
    assert not any(p.requires_grad for p in s.model.parameters())
    out = s.compute(StepBatch([7, 8, 9], [0], [3], [0]))
    assert not out.requires_grad


def test_graph_output_rows_count_every_captured_shape() -> None:
    """Logit rows per request on the last stage, carry rows per token elsewhere, summed over
    what ``StepGraphs`` would capture (decode by batch size, mixed by token count)."""
    from engramrt.runner.graphs import batch_sizes, graph_shapes, output_rows, token_sizes

    shapes = graph_shapes(64, 2048)
    decode, mixed = batch_sizes(64), token_sizes(2048)
    assert [s.tokens for s in shapes] == decode + mixed
    assert output_rows(shapes, True) == sum(decode) + sum(min(64, t) for t in mixed)
    assert output_rows(shapes, False) == sum(decode) + sum(mixed)
    verify = [s for s in graph_shapes(64, 2048, 4) if s.verify]  # a logit row per token
    assert [(s.tokens, s.requests) for s in verify] == [(5 * b, b) for b in decode]
    assert output_rows(graph_shapes(64, 2048, 4), True) == output_rows(shapes, True) + sum(
        5 * b for b in decode
    )


def test_graphs_need_the_triton_kernels(model, capsys) -> None:
    """Without the kernels (here: a CPU session) decode stays eager instead of failing."""
    s = new_session(model, 2)
    s.capture_graphs(2)
    assert s.graphs is None and "decoding eagerly" in capsys.readouterr().out


def test_kv_budget_from_a_profiled_forward(model, monkeypatch) -> None:
    """The profile's arithmetic against a restatement with fake GPU memory figures: total x
    utilisation / stages per GPU, minus memory outside torch, weights, activations and the
    graph-pool estimate; the profile leaves no cache and no history behind."""
    from engramrt.runner.kv_budget import blocks_from_profile, stages_per_gpu

    gib = 2**30
    fake = {
        "total": 80 * gib,
        "free": 70 * gib,
        "reserved": 6 * gib,
        "allocated": 5 * gib,
        "peak": 9 * gib,
    }
    cuda = torch.cuda
    for name, value in [
        ("empty_cache", lambda: None),
        ("reset_peak_memory_stats", lambda d=None: None),
        ("synchronize", lambda d=None: None),
        ("max_memory_allocated", lambda d=None: fake["peak"]),
        ("mem_get_info", lambda d=None: (fake["free"], fake["total"])),
        ("memory_reserved", lambda d=None: fake["reserved"]),
        ("memory_allocated", lambda d=None: fake["allocated"]),
    ]:
        monkeypatch.setattr(cuda, name, value)
    s = new_session(model, 4)
    profile = s.profile_memory(tokens=40, max_len=16, block_size=8, rows=4)
    per_block = model.cfg.family.block_bytes(model, model.layer_ids, 8)
    share = stages_per_gpu(local_world_size=3, gpus=2)  # 3 stages on 2 GPUs: 2 share one
    blocks = blocks_from_profile(
        profile, 0.9, per_block, share, graph_rows=4, graph_outputs=3 * gib
    )
    cache = 40 // 16 + 1  # runs of 16, 16, 8 tokens, each with its own 2 blocks
    per_layer_block = 8 * model.cfg.body.num_kv_heads * model.cfg.body.head_dim * 4  # fp32
    cache_bytes = cache * 2 * per_layer_block * 2 * len(model.layer_ids)
    activations = fake["peak"] - cache_bytes - fake["allocated"]
    outside = fake["total"] - fake["free"] - fake["reserved"]
    budget = int(
        fake["total"] * 0.9 / 2
        - outside
        - fake["allocated"]
        - activations
        - activations * 4 / 40
        - 3 * gib
    )
    assert share == 2 and blocks == budget // (per_layer_block * 2 * len(model.layer_ids))
    assert s.kv is None and not s.hasher.history.table.any()
    with pytest.raises(ValueError, match="leaves no room"):
        blocks_from_profile(profile, 0.1, per_block, share, graph_rows=4)
