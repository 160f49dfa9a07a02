"""V4.1's attention and indexer kernels inside the model: every ``V41Attention.attend`` and
``_index`` call of a mixed workload on ``v41-small`` (prefill chunks that split ratio-2 groups,
decode rows, two requests in one step) computed by the Triton kernel and by the torch path from
the same inputs and caches, so the kernels' reading of rings, runs and block tables is checked
on real states. Off CUDA the kernels run under Triton's interpreter (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engramrt.model import mhc
from engramrt.model.layers import rms_norm
from engramrt.models.deepseek_v41 import attention as v41_attention
from engramrt.models.deepseek_v41 import dspark
from engramrt.runner.stage import StageRunner
from tests.model.test_v41_engine import ends_of, prompt, run_steps

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_kernels_equal_the_torch_path_on_every_call(v41_small: Path, monkeypatch):
    dtype = "bfloat16" if DEVICE == "cuda" else "float32"
    runner = StageRunner.load(v41_small, num_slots=4, max_len=256, device=DEVICE, dtype=dtype)
    cls = v41_attention.V41Attention
    attend, index, select, calls = cls.attend, cls._index, v41_attention.Indexer.select, []
    scored: list[torch.Tensor] = []

    def keep(self, scores, seen, allowed=None):  # on the kernel pass: both selections
        scored.append(scores)
        current = v41_attention.use_triton
        if not current(scores.device):
            return select(self, scores, seen, allowed)
        got = select(self, scores, seen, allowed)
        monkeypatch.setattr(v41_attention, "use_triton", lambda device: False)
        assert torch.equal(got, select(self, scores, seen, allowed))  # the same scores
        monkeypatch.setattr(v41_attention, "use_triton", current)
        calls.append(("select", allowed is not None))
        return got

    def both_index(self, x, qr, angles, step, cache):
        scored.clear()
        for kernels in (False, True):
            monkeypatch.setattr(v41_attention, "use_triton", lambda device, k=kernels: k)
            index(self, x, qr, angles, step, cache)
        # the rest of the layer on the torch path (the interpreter's kernels are slow)
        monkeypatch.setattr(v41_attention, "use_triton", lambda device: False)
        if not scored:  # nothing to see yet
            return
        want, got = (torch.cat(scored[: len(scored) // 2]), torch.cat(scored[len(scored) // 2 :]))
        assert torch.equal(torch.isneginf(got), torch.isneginf(want))
        calls.append(("index", bool(torch.isfinite(want).any())))
        fin = torch.isfinite(want)
        scale = want[fin].float().abs().max()
        tol = 1e-5 if want.dtype == torch.float32 else 2**-7  # one bf16 rounding, another order
        torch.testing.assert_close(
            got[fin].float() / scale, want[fin].float() / scale, rtol=0, atol=tol
        )

    def both(self, q, kv, comp, rows, step, cache):
        monkeypatch.setattr(v41_attention, "use_triton", lambda device: True)
        got = attend(self, q, kv, comp, rows, step, cache)
        monkeypatch.setattr(v41_attention, "use_triton", lambda device: False)
        want = attend(self, q, kv, comp, rows, step, cache)
        calls.append((self.role.kind, rows is not None and bool((rows >= 0).any())))
        scale = want.float().abs().amax().clamp_min(1e-6)
        tol = 1e-5 if q.dtype == torch.float32 else 2e-2  # bf16 probabilities, another max
        torch.testing.assert_close(got.float() / scale, want.float() / scale, rtol=0, atol=tol)
        return got

    from engramrt.kernels import rope_quant as fused
    from engramrt.kernels.quant_roundtrip import ACT, FP4_E4M3, FP4_POW2
    from engramrt.models.deepseek_v41.quant import E4M3_SCALE, POW2_SCALE

    names = {fused.NONE: None, ACT: v41_attention.ACT, FP4_POW2: POW2_SCALE, FP4_E4M3: E4M3_SCALE}

    def rope_on_torch(x, cos, sin, kind, inverse, cache, rows, norm=None):  # its test: the
        current = v41_attention.use_triton  # same to the norm's rounding; the interpreter's slow
        monkeypatch.setattr(v41_attention, "use_triton", lambda device: False)
        x = x if norm is None else rms_norm(x, *norm)
        out = v41_attention.rope_quant(x, (cos, sin), names[kind], inverse, cache, rows)
        monkeypatch.setattr(v41_attention, "use_triton", current)
        return out

    monkeypatch.setattr(fused, "rope_quant", rope_on_torch)
    monkeypatch.setattr(cls, "attend", both)
    monkeypatch.setattr(cls, "_index", both_index)
    monkeypatch.setattr(v41_attention.Indexer, "select", keep)
    a, b = prompt(45, 11), prompt(30, 12)
    run_steps(
        runner,
        [
            [(0, a[:13])],
            [(0, a[13:40]), (1, b[:21])],
            [(1, b[21:22]), (0, a[40:41])],
            [(0, a[41:44]), (1, b[22:23])],
        ],
    )
    kinds = {kind for kind, _ in calls}
    assert len(kinds) == 6 and all(
        any(p for k, p in calls if k == kind)  # every role; real
        for kind in ("index", "source", "reuse", "select")
    )  # picks, scores, a re-indexer's candidate blocks


@pytest.mark.gpu
def test_graphs_replay_the_eager_steps(v41_small: Path) -> None:
    """V4.1 steps replayed from CUDA graphs, whose indexers score against the cache's whole
    capacity, give the eager steps' greedy tokens and logits (float32: padded GEMMs may round
    differently): a prefill of three prompts and, later, a newcomer's prompt in two chunks beside
    three decoding requests (mixed graphs), decode steps of three in a graph of four. The padded
    row writes only the spare ring slot, never an unused slot's. The graphs' tables are twice
    as wide as the steps' (a decode step's host table lands in them rows closer together)."""
    from engramrt.runner.batch import StepBatch

    runners = [
        StageRunner.load(v41_small, num_slots=4, max_len=256, device="cuda", dtype="float32")
        for _ in range(2)
    ]
    for r in runners:
        r.allocate_kv(4, 256, 16, 32)
    runners[1].capture_graphs(4, 64)
    graphs, replayed = runners[1].graphs, []
    replay = graphs.replay
    graphs.replay = lambda host, shape, carry: replayed.append(shape) or replay(host, shape, carry)
    prompts = [prompt(n, 20 + n) for n in (33, 9, 20)]
    late = prompt(19, 40)
    blocks = [list(range(8 * s, 8 * s + 8)) for s in range(4)]
    steps = [
        StepBatch(
            [t for p in prompts for t in p],
            [0, 2, 3],
            [len(p) for p in prompts],
            [0, 0, 0],
            new_blocks=[blocks[s] for s in (0, 2, 3)],
        )
    ]
    pos = [len(p) for p in prompts]
    for n in range(9):
        out = [r.compute(steps[-1], last_only=True) for r in runners]
        assert torch.equal(out[1].argmax(-1), out[0].argmax(-1)), n
        scale = float(out[0].abs().max())
        torch.testing.assert_close(out[1], out[0], rtol=0, atol=1e-4 * scale)
        nxt = out[0].argmax(-1).tolist()
        if n == 3:  # slot 1 still unused: graph padding wrote only the spare slot
            for ring in runners[1].kv.window.values():
                assert not ring[1].any() and ring[4].any()
        if n in (3, 4):  # the newcomer's prompt in chunks of 12 and 7, after the decode rows
            chunk = late[:12] if n == 3 else late[12:]
            table = {"new_blocks": [[], [], [], blocks[1]], "block_starts": [8, 8, 8, 0]}
            steps.append(
                StepBatch(
                    nxt[:3] + chunk,
                    [0, 2, 3, 1],
                    [1, 1, 1, len(chunk)],
                    [*pos, 0 if n == 3 else 12],
                    **(table if n == 3 else {}),
                )
            )
        else:
            slots = [0, 2, 3] if n < 5 else [0, 2, 3, 1]
            steps.append(StepBatch(nxt[: len(slots)], slots, [1] * len(slots), pos))
        pos = [p + 1 for p in pos[:3]] + ([19] if n == 4 else [pos[3] + 1] if n > 4 else [])
    kinds = [s.decode for s in replayed]
    assert len(replayed) == 9 and kinds.count(False) == 3, replayed  # prefill, two chunks


@pytest.mark.gpu
def test_prefix_hits_after_graph_steps_equal_cold_runs(v41_small: Path) -> None:
    """Window snapshots saved after CUDA-graph decode steps (outside the graph) restore the
    rings a cold engine computes: a second turn that hits generates the same greedy tokens."""
    from engramrt.engine.request import SamplingParams
    from tests.model.test_v41_engine import turns
    from tests.support.engine_factory import build_engine

    runner = StageRunner.load(v41_small, num_slots=4, max_len=256, device="cuda", dtype="float32")
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)
    outs, hits = [], []
    for caching in (False, True):
        runner.allocate_kv(4, 256, 4, 256)
        runner.capture_graphs(4)
        engine = build_engine(runner, 256, 4, prefix_caching=caching, allocate=False)
        outs.append(turns(engine, prompt(45, 31), prompt(9, 32), params))
        hits.append(engine.stats()["prefix_cache_hits"])
    assert hits == [0, 56]
    for (ids, lps), (want_ids, want_lps) in zip(outs[1], outs[0], strict=True):
        assert ids == want_ids
        torch.testing.assert_close(torch.tensor(lps), torch.tensor(want_lps), atol=1e-3, rtol=0)


@pytest.mark.gpu
def test_moe_warm_up_covers_every_token_count(v41_small: Path) -> None:
    """After ``V41MoE.warm_up`` (the stored-format kernel's compiled variants dropped first), the
    MoE given any token count and routing (its experts' row tiles follow the rows an expert
    averages) compiles nothing: serving once met such a variant mid-step."""
    from engramrt.kernels import stored_linear
    from engramrt.kernels.compiles import compilations, count_compilations, recent
    from engramrt.models.deepseek_v41.moe import V41MoE

    kernel = stored_linear._stored_linear_kernel
    if not count_compilations() or not hasattr(kernel, "device_caches"):
        pytest.skip("this Triton has no post-compile hook or per-device kernel caches")
    runner = StageRunner.load(v41_small, num_slots=2, max_len=64, device="cuda", dtype="bfloat16")
    moe = next(m for m in runner.model.modules() if isinstance(m, V41MoE))
    start = compilations()
    kernel.device_caches.clear()
    moe.warm_up(torch.bfloat16)
    before = compilations()
    assert before > start  # the warm-up compiled (the caches were empty)
    tokens = 3 * stored_linear.BM * len(moe.experts)
    x = torch.randn(tokens, moe.gate.weight.shape[1], device="cuda").bfloat16()
    for t in (*range(1, 70), tokens // 2, tokens):
        moe(x[:t])
    torch.cuda.synchronize()
    assert compilations() == before, recent()


@pytest.mark.gpu
def test_verify_graphs_replay_the_eager_verify_steps(v41_small: Path) -> None:
    """n-gram speculation on V4.1 with its verify steps replayed from CUDA graphs (every run an
    anchor and four drafts, the kernels reading rings of ``window + 4`` rows) gives the greedy
    tokens of the same verify steps run eagerly, over every acceptance and rollback length, and
    so do they under overlap scheduling, each run moved back inside its graph
    (``speculative_run``; that these equal decoding without drafts is the CPU test's: on the GPU
    a 5-row GEMM need not round as a 1-row one, and V4.1's FP8/FP4 round trips amplify a last
    bit, so verify runs and decode steps of random weights part after a few tokens)."""
    from tests.engine.test_speculative import _run
    from tests.model.test_v41_engine import PARAMS, PROMPTS, speculative_run
    from tests.support.engine_factory import build_engine

    k = 4
    runner = StageRunner.load(
        v41_small, num_slots=1, max_len=256, device="cuda", dtype="float32", num_blocks=0
    )
    runner.allocate_kv(1, 256, 4, 64, slack=k)
    runner.speculate(k, (4, 2))
    runner.capture_graphs(1, 64, verify=k)
    graphs, replayed = runner.graphs, []
    replay = graphs.replay
    graphs.replay = lambda h, shape, c: replayed.append(shape) or replay(h, shape, c)

    def engine_with(**kw):
        return build_engine(runner, 256, 1, allocate=False, **kw)

    cfg = {"max_num_seqs": 1}
    want = _run(engine_with(**cfg), PROMPTS, PARAMS)  # the drafts' source
    runner.graphs = None
    eager = speculative_run(engine_with, cfg, want, k)
    runner.graphs = graphs
    replayed.clear()
    assert speculative_run(engine_with, cfg, want, k) == eager
    assert sum(s.verify == k for s in replayed) > 20
    # overlap: each run behind a verify run in flight moved back inside the graph
    replayed.clear()
    assert speculative_run(engine_with, {**cfg, "overlap": True}, want, k) == eager
    assert sum(s.verify == k for s in replayed) > 20


def test_draft_kernels_equal_the_torch_path(v41_small: Path, monkeypatch) -> None:
    """A DSpark draft pass of two requests (block queries over the ring's window ending at each
    request's position, then its own block: the sparse attention kernel with nothing of the
    run "this step's"; the fused last collapse and norm; the Markov loop, the vocabulary's last
    ids masked) on the kernels and on the torch path, from the same rings: the same drafts,
    logits within the kernels' tolerance (float32: a bf16 near-tie could flip a draft)."""
    from engramrt.runner.batch import StepBatch

    runner = StageRunner.load(
        v41_small, num_slots=2, max_len=128, device=DEVICE, dtype="float32", dspark=True
    )
    runner.allocate_kv(2, 128, 16, 16)
    a, b = prompt(21, 5), prompt(9, 6)
    runner.compute(StepBatch(a + b, [0, 1], [21, 9], [0, 0], new_blocks=[[0, 1], [8]]))
    batch = StepBatch([3, 4], [0, 1], [1, 1], [21, 9])
    runner.compute(batch)
    tokens = torch.tensor([7, 8], device=DEVICE)
    ends, slots = (t.to(DEVICE) for t in ends_of(batch))
    drafts = []
    for kernels in (True, False):  # the attention, the fused mHC and the Markov loop
        for module in (v41_attention, mhc, dspark):
            monkeypatch.setattr(module, "use_triton", lambda device, k=kernels: k)
        drafts.append(
            dspark.draft(
                runner.model, runner.kv, ends, slots, tokens, limit=runner.model.cfg.vocab_size - 5
            )
        )
    got, want = drafts
    scale = want.logits[want.logits.isfinite()].abs().max()
    torch.testing.assert_close(got.logits / scale, want.logits / scale, rtol=0, atol=1e-4)
    assert torch.equal(got.tokens, want.tokens)


@pytest.mark.gpu
def test_the_step_after_the_sampler_replays_its_eager_run(v41_small: Path) -> None:
    """What follows the sampler (acceptance, kept samples, the history commit, DSpark's draft
    pass and its drafts written back), replayed from a CUDA graph for three verify runs in the
    graph of four (a padded row drafting from the spare slot), leaves the drafts, token rows,
    rejected counts and history rows of the same work run eagerly (float32; each table's last
    row is a spare that masked writes, the padded row's among them, go to)."""
    from engramrt.runner.batch import StepBatch

    k = 3
    runner = StageRunner.load(
        v41_small, num_slots=4, max_len=128, device="cuda", dtype="float32", dspark=True
    )
    runner.allocate_kv(4, 128, 16, 32, slack=k)
    runner.speculate(k)
    runner.capture_graphs(4, 64)
    v = runner.verifier
    assert sorted(v.graphs) == [(1, 0), (1, k), (2, 0), (2, k), (4, 0), (4, k)]
    prompts = [prompt(n, 50 + n) for n in (21, 9, 30)]
    runner.compute(
        StepBatch(
            [t for p in prompts for t in p],
            [0, 2, 3],
            [21, 9, 30],
            [0, 0, 0],
            new_blocks=[[0, 1], [8], [12, 13]],
        )
    )
    batch = StepBatch(None, [0, 2, 3], [1 + k] * 3, [21, 9, 30], drafts=[k] * 3)
    with torch.inference_mode():
        for slot, start, first in ((0, 21, 6), (2, 9, 16), (3, 30, 26)):  # the drafts verified
            v.rows[slot, start + 1 : start + 1 + k] = torch.arange(first, first + k, device="cuda")
    samples = torch.tensor(
        [6, 7, 1, 2] + [9] * 4 + [26, 3, 4, 5], device="cuda"
    )  # accepted: 2, 0, 1
    state = [v.rows, v.rejected, runner.hasher.history.table]
    with torch.inference_mode():  # as the stage runs it (its tensors are inference tensors)
        before = [t.clone() for t in state]
        replayed = v.after(batch, samples)
        after_graph = [t.clone() for t in state]
        for t, b in zip(state, before, strict=True):
            t.copy_(b)
        graphs, v.graphs = v.graphs, {}
        eager = v.after(batch, samples)
        v.graphs = graphs
    assert torch.equal(replayed, eager)
    for got, want in zip(after_graph, state, strict=True):  # the last row: where padding goes
        assert torch.equal(got[:-1], want[:-1])
    assert v.rejected[[0, 2, 3]].tolist() == [1, 3, 2]


@pytest.mark.gpu
def test_over_a_pipeline_the_graph_after_the_sampler_takes_the_host_drafts(v41_small: Path):
    """On the last of two stages (no token rows there: the host sends the drafts), what follows
    the sampler (acceptance counted from the host's drafts, DSpark's draft pass) replayed from
    a CUDA graph for three verify runs in the graph of four gives the drafts of the same work
    run eagerly, for two sets of host drafts accepting different counts (the drafts are an
    input of the graph, not a constant of its capture)."""
    from engramrt.runner.batch import StepBatch
    from engramrt.runner.carry import Carry

    k = 3
    runner = StageRunner.load(
        v41_small,
        num_slots=4,
        max_len=128,
        device="cuda",
        dtype="float32",
        layer_ids=[3, 4, 5],
        dspark=True,
    )
    runner.allocate_kv(4, 128, 16, 32, slack=k)
    runner.speculate(k)
    runner.capture_graphs(4, 64)
    v = runner.verifier
    assert v.rows is None and sorted(v.graphs) == [(1, 0), (1, k), (2, 0), (2, k), (4, 0), (4, k)]
    with torch.inference_mode():  # the rings seeded from a prefill of random streams
        carry = Carry.empty(runner.model, 60, torch.zeros)
        carry.x.normal_(generator=torch.Generator("cuda").manual_seed(0))
        runner.compute(
            StepBatch(None, [0, 2, 3], [21, 9, 30], [0, 0, 0], new_blocks=[[0, 1], [8], [12, 13]]),
            carry,
        )
    samples = torch.tensor([6, 7, 1, 2] + [9] * 4 + [26, 3, 4, 5], device="cuda")
    outs = []
    for host in ([6, 7, 8, 16, 17, 18, 26, 27, 28], [6, 0, 0, 9, 9, 9, 26, 3, 4]):
        batch = StepBatch(
            None, [0, 2, 3], [1 + k] * 3, [21, 9, 30], drafts=[k] * 3, draft_tokens=host
        )  # accepted: 2, 0, 1; then 1, 3, 3
        with torch.inference_mode():
            replayed = v.after(batch, samples).clone()
            graphs, v.graphs = v.graphs, {}
            eager = v.after(batch, samples)
            v.graphs = graphs
        assert torch.equal(replayed, eager)
        outs.append(eager)
    assert not torch.equal(outs[0], outs[1])


def test_the_low_ranks_in_one_launch_over_stacked_weights(v41_small: Path) -> None:
    """``wq_a`` and ``wkv`` read one input: given its codes, ``low_ranks`` multiplies both
    weights stacked in one launch, each weight a view of the stack after; the products equal
    the two launches of before to fp32 summation order (the stack's shape sets its own split),
    and a weight replaced afterwards (a load, a move) is stacked again, not read stale."""
    from engramrt.kernels.stored_linear import quantize

    model = StageRunner.load(v41_small, num_slots=1, max_len=64, device=DEVICE).model
    attn = next(m for m in model.modules() if isinstance(m, v41_attention.V41Attention))
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x = torch.randn(5, attn.wq_a.weight.shape[1], generator=torch.Generator().manual_seed(2))
    xs = quantize(x.to(DEVICE, dtype))
    want = attn.wq_a(xs), attn.wkv(xs)
    got = attn.low_ranks(xs)
    stack = attn.low_stack[0]
    assert attn.wq_a.weight.data_ptr() == stack.data_ptr()
    assert attn.wkv.weight.data_ptr() == stack[len(attn.wq_a.weight) :].data_ptr()
    tol = 1e-5 if dtype == torch.float32 else 2**-7
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * b.abs().max())
    # replaced: rows reversed (with their 32-row blocks' scales)
    attn.wkv.weight, attn.wkv.scale = (
        t.flip(0).contiguous() for t in (attn.wkv.weight, attn.wkv.scale)
    )
    flipped = attn.low_ranks(xs)[1]
    torch.testing.assert_close(
        flipped.float(), want[1].flip(1).float(), rtol=tol, atol=tol * want[1].abs().max()
    )


def test_the_norms_inputs_for_the_linears_change_no_bit(v41_small: Path, monkeypatch) -> None:
    """The codes, values and fp32 rows that the mHC norm's launch makes for the attention's and
    the MoE's linears (``norm_inputs``) leave every layer's output of two decode steps on the
    kernel path bit for bit as quantising the normed rows where the linears read them does;
    and they are what those linears read (every layer, both sublayers)."""
    from benchmarks import cases
    from engramrt.models.deepseek_v41 import quant

    real, made = quant.shared_input, []

    def spy(x, inputs=None, values=False):
        made.append(inputs is not None)
        return real(x, inputs, values)

    monkeypatch.setattr(quant, "shared_input", spy)
    outs = []
    for asks in (True, False):
        runner = cases.census_stage(v41_small, DEVICE, 2, 12, 0.0, 1.0)
        for m in runner.model.modules():
            if hasattr(m, "norm_inputs") and not asks:
                m.norm_inputs = 0
        seen: list[torch.Tensor] = []
        for block in runner.model.layers.values():
            block.register_forward_hook(lambda m, args, out, seen=seen: seen.append(out[0].clone()))
        made.clear()
        positions = [12, 12]
        with cases.kernel_path():
            for _ in range(2):
                cases.census_decode(runner, positions, 2)
        assert made == [asks] * (2 * 2 * len(runner.model.layers)), made
        outs.append(seen)
    assert len(outs[0]) == len(outs[1]) > 0
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
