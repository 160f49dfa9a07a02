"""CUDA graphs of whole steps, one per padded shape (``GraphShape``): decode steps by padded
batch size (as in vLLM and nano-vllm), and mixed steps (prefill chunks beside decode rows) by
padded token count, so that a step of a busy server, where requests arrive while others
decode, replays one graph instead of launching each layer's kernels from Python.

Each graph captures the stage's ``forward`` itself (handed in, so this module needs no runner),
Engram hash and history commit included, over a static ``ForwardContext``: a replay copies the
step's host-built buffer (one H2D copy) and, on a later pipeline stage, the incoming carry into
the static inputs. Everything a kernel's launch depends on is fixed by the shape: token and
request counts, the prefill kernel's tile count (padded tiles walk nothing), the hash kernel's
request bucket. Padding (``ForwardContext.for_runs``) commits no history, writes no K/V and
attends to no keys. A mixed graph returns logits at each run's last token only (what the
sampler reads); a step that wants every token's logits (prompt logprobs) runs eagerly. With
speculative decoding, verify steps of K drafts per run (``GraphShape.verify``) are captured by
batch size too: every run is K + 1 tokens, commits no history when hashed, and is sampled
after every token.

The Python that runs only at capture time (the fail-closed Engram bookkeeping) is recorded then
and reported on every replay, since a replay runs exactly the captured kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engramrt.model.block_tables import BlockTables
from engramrt.model.context import ForwardContext, GraphShape, PagedCache
from engramrt.runner.carry import Carry
from engramrt.transfer import pinned

Forward = Callable[[ForwardContext, Carry | None], "torch.Tensor | Carry"]

# mixed steps up to this many tokens replay graphs; above it a step is long enough that its
# kernels, not their launches, set its time (a 4,096-token step of the 1B preset: ~20 ms)
MAX_GRAPH_TOKENS = 4096


def batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including ``max_batch``."""
    sizes = [b for b in (1, 2, 4, 8, *range(16, max_batch + 1, 16)) if b <= max_batch]
    return sizes if sizes[-1] == max_batch else [*sizes, max_batch]


def token_sizes(max_tokens: int) -> list[int]:
    """Mixed-step token counts: 16 to 256 by doubling, then steps of 128 to 1,024, of 256 to
    2,048 and of 512 above, up to and including ``max_tokens``. Past 256 tokens, where the
    kernels start to cost more than the launches, padding wastes at most 1/3 of a step, and at
    most 1/5 for the common mixed step of a 512-token prompt beside a batch of decode rows."""
    steps = [
        16,
        32,
        64,
        128,
        256,
        *range(384, 1025, 128),
        *range(1280, 2049, 256),
        *range(2560, 65537, 512),
    ]
    sizes = [t for t in steps if t < max_tokens]
    return [*sizes, max_tokens] if max_tokens >= 2 else []


def graph_shapes(max_batch: int, max_tokens: int, verify: int = 0) -> list[GraphShape]:
    """What ``StepGraphs`` captures: decode steps by batch size, then mixed steps by token
    count (up to ``max_batch`` requests each), then verify steps of ``verify`` drafts a run
    (speculative decoding; 0: none) by batch size."""
    sizes = batch_sizes(max_batch)
    shapes = [GraphShape(True, b, b) for b in sizes]
    mixed = token_sizes(min(max_tokens, MAX_GRAPH_TOKENS))
    shapes += [GraphShape(False, t, min(sizes[-1], t)) for t in mixed]
    if verify:
        shapes += [
            GraphShape(False, b * (verify + 1), b, verify)
            for b in sizes
            if b * (verify + 1) <= min(max_tokens, MAX_GRAPH_TOKENS)
        ]
    return shapes


def output_rows(shapes: list[GraphShape], last_stage: bool) -> int:
    """Rows of the outputs the captured graphs keep (each its own, outside the shared pool):
    logits at each request on the last stage (at each token of a verify graph), a carry per
    token elsewhere."""
    return sum(s.requests if last_stage and not s.verify else s.tokens for s in shapes)


class StepGraphs:
    def __init__(
        self,
        forward: Forward,
        kv: PagedCache,
        tables: BlockTables,
        device: torch.device,
        max_batch: int,
        max_tokens: int = 0,
        last_stage: bool = True,
        carry_for: Callable[[int], Carry] | None = None,
        verify: int = 0,
        lagging: bool = False,
    ):
        """Decode graphs up to ``max_batch`` requests and mixed graphs up to ``max_tokens``
        tokens (0: none). ``carry_for(t)``: static carry inputs of ``t`` rows on a later
        pipeline stage (None on the first stage, which makes its own). ``lagging``: the steps
        carry ``ForwardContext.lag`` (a stage that verifies drafts on the device)."""
        if device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device (--enforce-eager runs without)")
        if max_batch < 1:
            raise ValueError(f"the largest graph batch must be >= 1, got {max_batch}")
        self.forward, self.kv, self.tables = forward, kv, tables
        self.device, self.carry_for = device, carry_for
        self.last_stage, self.lagging = last_stage, lagging
        self.shapes = graph_shapes(min(max_batch, kv.num_blocks), max_tokens, verify)
        self.sizes = [s.requests for s in self.shapes if s.decode]
        self.width = tables.per_seq
        self.graphs: dict[GraphShape, tuple] = {}  # shape -> (graph, ctx, outputs, carry, ran)
        pool = None
        # most tokens first: the smaller ones reuse its memory pool
        for shape in sorted(self.shapes, key=lambda s: (s.tokens, not s.decode), reverse=True):
            self.graphs[shape] = self._capture(shape, pool)
            pool = self.graphs[shape][0].pool()

    def shape_for(
        self, run_lens: list[int], full_logits: bool, tracer, drafts: list[int] | None = None
    ) -> GraphShape | None:
        """The smallest captured shape this step fits, or None (eager): no tracer (a trace
        needs eager tensors), a mixed step only when the logits of each run's last token
        are enough, a step with drafts only when every run has the verify graphs' count. Every
        block table fits the static buffer: the cache's tables are that wide."""
        if tracer is not None or not run_lens:
            return None
        if drafts is not None:
            k = drafts[0]
            if full_logits or any(d != k for d in drafts):
                return None
            return next((s for s in self.shapes if s.verify == k and s.fits(run_lens)), None)
        decode = all(n == 1 for n in run_lens)
        if not decode and full_logits and self.last_stage:
            return None
        plain = (s for s in self.shapes if not s.verify and s.decode == decode)
        return next((s for s in plain if s.fits(run_lens)), None)

    @torch.inference_mode()  # no autograd state kept alive by the captured outputs
    def _capture(self, shape: GraphShape, pool):
        # all padding: the warm-up run (Triton JIT, cuBLAS handles) commits and writes nothing
        ctx = ForwardContext.for_runs(
            [],
            [],
            [],
            self.kv,
            self.tables,
            self.device,
            self.width,
            shape,
            last_rows=True,
            lag=[] if self.lagging else None,
        )
        carry = None if self.carry_for is None else self.carry_for(shape.tokens)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.forward(ctx, carry)
        torch.cuda.current_stream().wait_stream(stream)
        ctx.engram_ran.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self.forward(ctx, carry)
        ran = list(ctx.engram_ran)
        ctx.engram_ran.clear()
        return graph, ctx, out, carry, ran

    def replay(self, host: ForwardContext, shape: GraphShape, carry: Carry | None):
        """Run a step built on the host with ``pad=shape``: (outputs of the real rows, the
        Engram layers that ran)."""
        graph, ctx, out, static_carry, ran = self.graphs[shape]
        # the table, last, may be narrower; from pinned memory the copy does not wait for the
        # step in flight (overlap scheduling; engramrt.transfer)
        ctx.flat[: host.flat.numel()].copy_(pinned(host.flat), non_blocking=True)
        n_tok = sum(host.run_lens)
        if static_carry is not None:
            if carry is None:
                raise RuntimeError("a later pipeline stage needs the carry of the stage before")
            for dst, src in zip(static_carry.tensors(), carry.tensors(), strict=True):
                dst[:n_tok].copy_(src)
        graph.replay()
        if isinstance(out, torch.Tensor):  # logits: one row per request (per token in decode)
            return out[: n_tok if shape.verify else len(host.slots)], ran
        return out.head(n_tok), ran
