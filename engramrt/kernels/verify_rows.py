"""Speculation's bookkeeping after the sampler in two launches (``runner.verify``'s torch path
took ~90 small kernels, each a CUDA-graph node of ~1 us however little it does).

``accept``: one program per run counts the drafts its samples confirm, keeps the samples in the
run's token row, records the drafts it rejected and gathers the history block (anchor and
drafts) to commit. Each lane reads the draft at one position before it writes the sample for
that same position, so the reads need no barrier: a replica of the lane in another warp (the
tensors are narrower than the program) that read late sees the sample, which only ever turns a
refused draft into a confirmed one, and the minimum over the replicas keeps the writer's.
``write_drafts``: the next drafts into the rows, after the draft pass. ``shift``: the next
step's lagging runs moved back by the drafts their slots rejected (``Verifier.shift``), one
launch for ~20 small kernels.

Every count and pointer is left unspecialised (Triton would otherwise compile a variant for a
count of 1 or a multiple of 16, or a view's alignment, that the start-up's steps never met:
serving with speculation compiled ~4 mid-run).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(
    do_not_specialize=["size", "n_samples", "width", "spare", "pad_row"],
    do_not_specialize_on_alignment=[
        "x_ptr",
        "samples_ptr",
        "rows_ptr",
        "rejected_ptr",
        "out_ptr",
        "block_ptr",
        "target_ptr",
    ],
)
def _accept_kernel(
    x_ptr,
    size,
    samples_ptr,
    n_samples,
    rows_ptr,
    width,
    rejected_ptr,
    spare,
    out_ptr,
    block_ptr,
    target_ptr,
    pad_row,
    K: tl.constexpr,
    LANES: tl.constexpr,
):
    b = tl.program_id(0)
    first = tl.load(x_ptr + b)
    lens = tl.load(x_ptr + size + b)
    slot = tl.load(x_ptr + 2 * size + b)
    drafts = tl.load(x_ptr + 3 * size + b)
    final = tl.load(x_ptr + 4 * size + b)
    tails = tl.load(x_ptr + 5 * size + b)
    start = tl.load(x_ptr + 6 * size + b)
    lag = tl.load(x_ptr + 7 * size + b)
    starts = start - lag * tl.load(rejected_ptr + slot)  # before this step replaces it
    keep = (final != 0) & (lens > 0)
    row = rows_ptr + slot * width
    i = tl.arange(0, LANES)
    has = i < tl.minimum(drafts, K)
    # draft i sits at starts + 1 + i; sample i checks it (and, kept, takes its place)
    guess = tl.load(row + tl.minimum(tl.maximum(starts + 1 + i, 0), width - 1), mask=has, other=0)
    got = tl.load(samples_ptr + tl.minimum(first + i, n_samples - 1), mask=has, other=0)
    ok = has & (guess.to(tl.int64) == got)
    accepted = tl.min(tl.where(ok, LANES, i), axis=0)  # the first draft not confirmed
    last = tl.maximum(starts + lens - 1 - drafts + accepted, 0)
    bonus = tl.load(samples_ptr + tl.minimum(first + accepted, n_samples - 1))
    tl.store(out_ptr + b, last)
    tl.store(out_ptr + size + b, tl.maximum(bonus, 0))
    tl.store(out_ptr + 2 * size + b, accepted)
    tl.store(out_ptr + 3 * size + b, keep.to(tl.int64))
    # the history block: the anchor, then the drafts (those accepted equal their samples)
    anchor = tl.load(row + tl.minimum(tl.maximum(starts, 0), width - 1))
    tl.store(block_ptr + b * (K + 1), anchor.to(tl.int64))
    tl.store(block_ptr + b * (K + 1) + 1 + i, guess.to(tl.int64), mask=i < K)
    tl.store(target_ptr + b, tl.where(keep & (drafts > 0), slot, pad_row))
    # sample j fills position before + 1 + j (for a verify run before = starts: lane j wrote
    # nothing it read above but its own draft's position)
    before = starts + lens - tails
    j = i
    sample = tl.load(samples_ptr + tl.minimum(first + j, n_samples - 1), mask=j < tails, other=0)
    at = tl.minimum(tl.maximum(before + 1 + j, 0), width - 1)
    # (a scalar condition joins the lanes' as a bound: the interpreter mistypes bool & bool)
    tl.store(row + at, sample.to(rows_ptr.dtype.element_ty), mask=j < tl.where(keep, tails, 0))
    tl.store(rejected_ptr + tl.where(keep, slot, spare), drafts - accepted)


@triton.jit(
    do_not_specialize=["width", "stride"],
    do_not_specialize_on_alignment=["rows_ptr", "slots_ptr", "last_ptr", "keep_ptr", "drafts_ptr"],
)
def _write_drafts_kernel(
    rows_ptr,
    width,
    slots_ptr,
    last_ptr,
    keep_ptr,
    drafts_ptr,
    stride,
    K: tl.constexpr,
    LANES: tl.constexpr,
):
    b = tl.program_id(0)
    slot = tl.load(slots_ptr + b)
    keep = tl.load(keep_ptr + b) != 0
    i = tl.arange(0, LANES)
    d = tl.load(drafts_ptr + b * stride + i, mask=i < K, other=0)
    at = tl.minimum(tl.load(last_ptr + b) + 2 + i, width - 1)
    tl.store(
        rows_ptr + slot * width + at, d.to(rows_ptr.dtype.element_ty), mask=i < tl.where(keep, K, 0)
    )


@triton.jit(
    do_not_specialize=["n_runs", "table_width", "n_tokens", "block_size", "n_dec"],
    do_not_specialize_on_alignment=[
        "lag_ptr",
        "rejected_ptr",
        "slot_ids_ptr",
        "start_ptr",
        "ctx_lens_ptr",
        "pos_ptr",
        "slot_map_ptr",
        "token_req_ptr",
        "table_ptr",
        "dec_lens_ptr",
        "dec_req_ptr",
    ],
)
def _shift_kernel(
    lag_ptr,
    rejected_ptr,
    slot_ids_ptr,
    start_ptr,
    ctx_lens_ptr,
    n_runs,
    pos_ptr,
    slot_map_ptr,
    token_req_ptr,
    table_ptr,
    table_width,
    n_tokens,
    block_size,
    dec_lens_ptr,
    dec_req_ptr,
    n_dec,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    # each lane recomputes its run's distance from the unchanged lag flags and counts
    run = i < n_runs
    back = tl.load(lag_ptr + i, mask=run, other=0) * tl.load(
        rejected_ptr + tl.load(slot_ids_ptr + i, mask=run, other=0), mask=run, other=0
    )
    tl.store(start_ptr + i, tl.load(start_ptr + i, mask=run) - back, mask=run)
    tl.store(ctx_lens_ptr + i, tl.load(ctx_lens_ptr + i, mask=run) - back, mask=run)
    tok = i < n_tokens
    rows = tl.load(slot_map_ptr + i, mask=tok, other=-1)
    real = rows >= 0  # padded tokens stay where they are
    req = tl.load(token_req_ptr + i, mask=tok, other=0)
    back = tl.load(lag_ptr + req, mask=real, other=0) * tl.load(
        rejected_ptr + tl.load(slot_ids_ptr + req, mask=real, other=0), mask=real, other=0
    )
    pos = tl.load(pos_ptr + i, mask=tok, other=0) - back
    tl.store(pos_ptr + i, pos, mask=tok)
    block = tl.load(table_ptr + req * table_width + pos // block_size, mask=real, other=0)
    tl.store(slot_map_ptr + i, block * block_size + pos % block_size, mask=real)
    dec = i < n_dec
    length = tl.load(dec_lens_ptr + i, mask=dec, other=0)
    live = length > 0
    req = tl.load(dec_req_ptr + i, mask=live, other=0)
    back = tl.load(lag_ptr + req, mask=live, other=0) * tl.load(
        rejected_ptr + tl.load(slot_ids_ptr + req, mask=live, other=0), mask=live, other=0
    )
    tl.store(dec_lens_ptr + i, length - back, mask=live)


def shift(ctx, rejected: torch.Tensor) -> None:
    """``Verifier.shift`` in one launch (``ctx``: a ``ForwardContext`` with its lag flags)."""
    n_dec = 0 if ctx.dec_lens is None else len(ctx.dec_lens)
    dec_lens = ctx.dec_lens if n_dec else ctx.context_lens  # (not read: n_dec is 0)
    dec_req = ctx.dec_req if n_dec else ctx.token_req
    most, block = max(len(ctx.slot_ids), len(ctx.positions), n_dec), 128
    table = ctx.full_table()  # a decode graph's step is narrower than its buffer
    _shift_kernel[(triton.cdiv(most, block),)](
        ctx.lag,
        rejected,
        ctx.slot_ids,
        ctx.start_pos_t,
        ctx.context_lens,
        len(ctx.slot_ids),
        ctx.positions,
        ctx.slot_mapping,
        ctx.token_req,
        table,
        table.stride(0),
        len(ctx.positions),
        ctx.kv.block_size,
        dec_lens,
        dec_req,
        n_dec,
        BLOCK=block,
    )


def accept(
    x: torch.Tensor,
    samples: torch.Tensor,
    rows: torch.Tensor,
    rejected: torch.Tensor,
    k: int,
    pad_row: int,
) -> tuple[torch.Tensor, ...]:
    """``Verifier._run``'s bookkeeping for runs ``x`` (``Verifier._inputs``, on the device) of
    at most ``k`` drafts: (last accepted position, bonus sample, drafts accepted, whether the
    run keeps its samples, history block ``[B, 1 + k]``, the history row to commit it to:
    ``pad_row`` for runs that verified nothing or keep no samples); the samples kept in
    ``rows`` and ``rejected`` written."""
    size = x.shape[1]
    out = torch.empty(4, size, dtype=torch.int64, device=x.device)
    block = torch.empty(size, k + 1, dtype=torch.int64, device=x.device)
    target = torch.empty(size, dtype=torch.int64, device=x.device)
    lanes = triton.next_power_of_2(k + 1)
    _accept_kernel[(size,)](
        x,
        size,
        samples,
        len(samples),
        rows,
        rows.shape[1],
        rejected,
        len(rejected) - 1,
        out,
        block,
        target,
        pad_row,
        K=k,
        LANES=lanes,
    )
    return out[0], out[1], out[2], out[3], block, target


def write_drafts(
    rows: torch.Tensor,
    slots: torch.Tensor,
    last: torch.Tensor,
    keep: torch.Tensor,
    drafts: torch.Tensor,
) -> None:
    """``rows[slots[b], last[b] + 2 + i] = drafts[b, i]`` where ``keep[b]``."""
    size, k = drafts.shape
    _write_drafts_kernel[(size,)](
        rows,
        rows.shape[1],
        slots,
        last,
        keep,
        drafts,
        drafts.stride(0),
        K=k,
        LANES=triton.next_power_of_2(k),
    )
