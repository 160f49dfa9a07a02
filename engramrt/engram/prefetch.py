"""Engram rows read ahead: every Engram layer's hash ids are known at forward entry (the first
stage hashes before layer 0; later stages receive them), so the gathers of a stage's host-memory
tables, the slow part of an Engram over PCIe, start then on a side stream and run under the
layers before theirs; each Engram layer waits on its rows' event.

In a CUDA graph this is a fork (the side stream waits on the capturing stream) and a join (the
capturing stream waits on each event); every prefetch is joined before the forward returns, even
one whose layer did not take it (a capture that ends with side-stream work unjoined fails or,
worse, replays corrupt: vLLM #57759); the rows' buffers are then the graph's own allocations,
the same addresses at every replay. Eagerly, rows made on the side stream are marked as used by
the main stream (``record_stream``) so their memory is not reused early.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from engramrt.model.context import ForwardContext


def host_engrams(model) -> list:
    """The running Engrams of ``model`` whose tables are in host memory (a table in HBM is read
    about as fast as its layer computes: nothing to gain from reading it ahead)."""
    out = []
    for i in model.engram_layer_ids:
        block = model.layers[str(i)]
        table = block.engram.embed
        if block.engram_enabled and table is not None and table.host is not None:
            out.append(block.engram)
    return out


class Prefetch:
    """The side stream that reads ``model``'s host-table rows ahead."""

    def __init__(self, model, device: torch.device):
        self.model = model
        self.stream = torch.cuda.Stream(device)

    def start(self, ctx: ForwardContext) -> None:
        main = torch.cuda.current_stream()
        engrams = host_engrams(self.model)  # each step: the ablation may switch Engrams off
        if not engrams:
            return
        self.stream.wait_stream(main)  # the hash ids are written on the main stream
        with torch.cuda.stream(self.stream):
            for engram in engrams:
                rows = engram.lookup(ctx.engram_inputs(engram.layer_id, engram.layer_index))
                done = torch.cuda.Event()
                done.record(self.stream)
                ctx.prefetched[engram.layer_id] = (rows, done)


def take(ctx: ForwardContext, layer_id: int) -> torch.Tensor | None:
    """Layer ``layer_id``'s prefetched rows, once the main stream has waited for them."""
    entry = ctx.prefetched.pop(layer_id, None)
    if entry is None:
        return None
    rows, done = entry
    main = torch.cuda.current_stream()
    main.wait_event(done)
    if not torch.cuda.is_current_stream_capturing():
        rows.record_stream(main)
    return rows


def join_all(ctx: ForwardContext) -> None:
    """Join what no layer took (a capture must not end with side-stream work pending)."""
    for layer_id in list(ctx.prefetched):
        take(ctx, layer_id)
