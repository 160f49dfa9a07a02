"""CUDA graphs of the decode step, one per padded batch size (as in vLLM and nano-vllm).

Each graph captures the stage's ``forward`` itself (handed in, so this module needs no runner),
Engram hash and history commit included, over a static ``ForwardContext``: a replay copies the
step's host-built buffer (one H2D copy) and, on a later pipeline stage, the incoming carry into
the static inputs. A batch of ``n`` requests runs
in the smallest captured size ``b >= n``; rows ``n..b`` are padding: no history commit (the hash
kernel reads ``num_real``), no K/V write (cache slot -1) and no keys (context length 0).

The Python that runs only at capture time (the fail-closed Engram bookkeeping) is recorded then
and reported on every replay, since a replay runs exactly the captured kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engramrt.model.context import ForwardContext, KVCache
from engramrt.runner.carry import Carry
from engramrt.transfer import pinned

Forward = Callable[[ForwardContext, Carry | None], "torch.Tensor | Carry"]


def batch_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 16, up to and including ``max_batch``."""
    sizes = [b for b in (1, 2, 4, 8, *range(16, max_batch + 1, 16)) if b <= max_batch]
    return sizes if sizes[-1] == max_batch else [*sizes, max_batch]


class DecodeGraphs:
    def __init__(
        self,
        forward: Forward,
        kv: KVCache,
        device: torch.device,
        max_batch: int,
        carry_for: Callable[[int], Carry] | None = None,
    ):
        """``carry_for(b)``: static carry inputs of ``b`` rows on a later pipeline stage (None
        on the first stage, which makes its own)."""
        if device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device (--enforce-eager runs without)")
        if max_batch < 1:
            raise ValueError(f"the largest graph batch must be >= 1, got {max_batch}")
        self.forward, self.kv, self.device, self.carry_for = forward, kv, device, carry_for
        self.sizes = batch_sizes(min(max_batch, kv.num_blocks))
        self.width = kv.blocks_per_seq
        self.graphs: dict[int, tuple] = {}  # size -> (graph, static ctx, outputs, static carry)
        self.ran: list[int] = []
        pool = None
        for b in reversed(self.sizes):  # largest first: the smaller ones reuse its memory pool
            graph, ctx, out, carry = self._capture(b, pool)
            pool = graph.pool()
            self.graphs[b] = (graph, ctx, out, carry)

    def covers(self, run_lens: list[int], tracer) -> bool:
        """A decode step of a captured size, with no tracer (a trace needs eager tensors). Every
        block table fits the static buffer: the cache's tables are that wide."""
        return (
            tracer is None and 0 < len(run_lens) <= self.sizes[-1] and all(n == 1 for n in run_lens)
        )

    def padded_size(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    @torch.inference_mode()  # no autograd state kept alive by the captured outputs
    def _capture(self, b: int, pool):
        # all rows padding: the warm-up run (Triton JIT, cuBLAS handles) commits and writes nothing
        ctx = ForwardContext.for_runs([], [], [], self.kv, self.device, [], self.width, pad_to=b)
        carry = None if self.carry_for is None else self.carry_for(b)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.forward(ctx, carry)
        torch.cuda.current_stream().wait_stream(stream)
        ctx.engram_ran.clear()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = self.forward(ctx, carry)
        self.ran = list(ctx.engram_ran)
        ctx.engram_ran.clear()
        return graph, ctx, out, carry

    def replay(self, host: ForwardContext, carry: Carry | None):
        """Run a step built on the host with ``pad_to=padded_size(n)``: (outputs of the real
        rows, the Engram layers that ran)."""
        n, b = len(host.slots), host.positions.numel()
        graph, ctx, out, static_carry = self.graphs[b]
        # the table, last, may be narrower; from pinned memory the copy does not wait for the
        # step in flight (overlap scheduling; engramrt.transfer)
        ctx.flat[: host.flat.numel()].copy_(pinned(host.flat), non_blocking=True)
        if static_carry is not None:
            if carry is None:
                raise RuntimeError("a later pipeline stage needs the carry of the stage before")
            for dst, src in zip(static_carry.tensors(), carry.tensors(), strict=True):
                dst[:n].copy_(src)
        graph.replay()
        if isinstance(out, torch.Tensor):
            return out[:n], self.ran
        return out.head(n), self.ran
