"""A CUDA graph's step without CUDA: the context a capture builds (no runs, the graph's table
width, padding), into whose buffer the host's step is copied as ``StepGraphs.replay`` copies
it. Code run on it reads what a replay's kernels read, the block table's rows where the host
put them included."""

from __future__ import annotations

from engramrt.model.block_tables import BlockTables
from engramrt.model.context import ForwardContext, GraphShape, PagedCache


def replayed_context(
    host: ForwardContext,
    kv: PagedCache,
    tables: BlockTables,
    width: int,
    shape: GraphShape,
    **kw,
) -> ForwardContext:
    """``host`` (built with ``pad=shape``) as the graph of ``shape`` and ``width`` sees it;
    ``kw``: ``for_runs``'s options the capture passes (``last_rows``, ``lag``)."""
    ctx = ForwardContext.for_runs([], [], [], kv, tables, host.flat.device, width, shape, **kw)
    load_step(ctx, host)
    return ctx


def load_step(ctx: ForwardContext, host: ForwardContext) -> None:
    """The host's step into the graph's buffer, as ``StepGraphs.replay`` copies it."""
    ctx.flat[: host.flat.numel()].copy_(host.flat)
