"""Speculation's bookkeeping after the sampler in two launches (``runner.verify``'s torch path
took ~90 small kernels, each a CUDA-graph node of ~1 us however little it does).

``accept``: one program per run counts the drafts its samples confirm, keeps the samples in the
run's token row, records the drafts it rejected and gathers the history block (anchor and
drafts) to commit. Each lane reads the draft at one position before it writes the sample for
that same position, so the reads need no barrier. ``write_drafts``: the next drafts into the
rows, after the draft pass.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _accept_kernel(
    x_ptr, size, samples_ptr, n_samples, rows_ptr, width, rejected_ptr, spare,
    out_ptr, block_ptr, target_ptr, pad_row,
    K: tl.constexpr, LANES: tl.constexpr,
):  # fmt: skip
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


@triton.jit
def _write_drafts_kernel(
    rows_ptr, width, slots_ptr, last_ptr, keep_ptr, drafts_ptr, stride, K: tl.constexpr,
    LANES: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0)
    slot = tl.load(slots_ptr + b)
    keep = tl.load(keep_ptr + b) != 0
    i = tl.arange(0, LANES)
    d = tl.load(drafts_ptr + b * stride + i, mask=i < K, other=0)
    at = tl.minimum(tl.load(last_ptr + b) + 2 + i, width - 1)
    tl.store(rows_ptr + slot * width + at, d.to(rows_ptr.dtype.element_ty),
             mask=i < tl.where(keep, K, 0))


def accept(x: torch.Tensor, samples: torch.Tensor, rows: torch.Tensor, rejected: torch.Tensor,
           k: int, pad_row: int) -> tuple[torch.Tensor, ...]:  # fmt: skip
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
    _accept_kernel[(size,)](x, size, samples, len(samples), rows, rows.shape[1], rejected,
                            len(rejected) - 1, out, block, target, pad_row, K=k,
                            LANES=lanes)  # fmt: skip
    return out[0], out[1], out[2], out[3], block, target


def write_drafts(rows: torch.Tensor, slots: torch.Tensor, last: torch.Tensor, keep: torch.Tensor,
                 drafts: torch.Tensor) -> None:  # fmt: skip
    """``rows[slots[b], last[b] + 2 + i] = drafts[b, i]`` where ``keep[b]``."""
    size, k = drafts.shape
    _write_drafts_kernel[(size,)](rows, rows.shape[1], slots, last, keep, drafts, drafts.stride(0),
                                  K=k, LANES=triton.next_power_of_2(k))  # fmt: skip
