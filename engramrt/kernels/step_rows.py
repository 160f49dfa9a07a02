"""V4.1's per-token rows of a step (``attention.StepRuns``) in one launch: each token's run
(first position, first row, end, slot), its window-ring row, its compressor-tail rows, the
compressed row of the group it closes at each ratio and the RoPE angles of each frequency
table. In torch they were about sixty small kernels a step, each a CUDA-graph node of a
microsecond or two however little it does.

Integer arithmetic only, with Python's floor division (a padded token sits at position 0, so
``pos - 1`` is negative): the same rows as the torch statements. The angles are one fp32
product of the exact position, as torch forms them: the same bits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

BLOCK = 128
RUN, Q0, END, SLOT, RING, TAIL_READ, TAIL_WRITE, CLOSES = range(8)  # rows of ``ints``
_CLOSES = tl.constexpr(CLOSES)  # (a kernel reads only constexpr globals)


@triton.jit
def _floordiv(a, b):
    """``a // b`` rounded down, for ``b > 0`` (every ``//`` on operands >= 0)."""
    return tl.where(a >= 0, a // b, -((b - 1 - a) // b))


@triton.jit
def _floormod(a, b):
    return a - _floordiv(a, b) * b


# a step's token count and tables' width vary: left unspecialised so that none compiles a
# variant mid-run
@triton.jit(do_not_specialize=["T", "S", "width"])
def _step_rows_kernel(
    pos_ptr, req_ptr, start_ptr, qs_ptr, slots_ptr, map_ptr, tables_ptr, ratios_ptr,
    freqs_ptr, backs_ptr, ints_ptr, real_ptr, angles_ptr, T, S, width, num_slots, ring_len,
    tail_n, block_size, NR: tl.constexpr, NA: tl.constexpr, H: tl.constexpr,
    HP: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = t < T
    pos = tl.load(pos_ptr + t, mask=ok, other=0)
    req = tl.load(req_ptr + t, mask=ok, other=0)
    p0 = tl.load(start_ptr + req, mask=ok, other=0)
    q0 = tl.load(qs_ptr + req, mask=ok, other=0)
    end = p0 + tl.load(qs_ptr + req + 1, mask=ok, other=0) - q0
    slot = tl.load(slots_ptr + req, mask=ok, other=0)
    real = tl.load(map_ptr + t, mask=ok, other=-1) >= 0
    n = ring_len
    ring = tl.where(real & (pos >= end - n), slot, num_slots) * n + _floormod(pos, n)
    n = tail_n
    read = slot * n + _floormod(_floordiv(pos - 1, 2), n)
    keep = real & (_floormod(pos, 2) == 0) & (pos >= end - 2 * n)
    write = tl.where(keep, slot * n + _floormod(_floordiv(pos, 2), n), (num_slots + 1) * n - 1)
    tl.store(ints_ptr + t, p0, mask=ok)  # rows RUN .. TAIL_WRITE: 0 .. 6, ``S`` apart
    tl.store(ints_ptr + S + t, q0, mask=ok)
    tl.store(ints_ptr + 2 * S + t, end, mask=ok)
    tl.store(ints_ptr + 3 * S + t, slot, mask=ok)
    tl.store(ints_ptr + 4 * S + t, ring, mask=ok)
    tl.store(ints_ptr + 5 * S + t, read, mask=ok)
    tl.store(ints_ptr + 6 * S + t, write, mask=ok)
    tl.store(real_ptr + t, real, mask=ok)
    for j in tl.static_range(NR):  # the compressed row of the group a token closes (spare: none)
        r = tl.load(ratios_ptr + j)
        per = block_size // r
        e = pos // r  # (used only where the token is real: pos >= 0)
        at = tl.minimum(e // per, width - 1)
        block = tl.load(tables_ptr + req * width + at, mask=ok, other=0)
        closes = real & (_floormod(pos + 1, r) == 0)
        row = tl.where(closes, block * per + e % per, tl.load(ratios_ptr + NR + j))
        tl.store(ints_ptr + (_CLOSES + j) * S + t, row, mask=ok)
    h = tl.arange(0, HP)
    hok = h < H
    for a in tl.static_range(NA):
        f = tl.load(freqs_ptr + a * H + h, mask=hok, other=0.0)
        at = (pos - tl.load(backs_ptr + a)).to(tl.float32)
        out = angles_ptr + a * T * H + t[:, None].to(tl.int64) * H + h[None, :]
        tl.store(out, at[:, None] * f[None, :], mask=ok[:, None] & hok[None, :])


class Rows(NamedTuple):
    ints: torch.Tensor  # int64 [CLOSES + len(ratios), T]: the rows named above (16-byte aligned)
    real: torch.Tensor  # bool [T]: False for a CUDA graph's padding
    angles: torch.Tensor  # fp32 [len(backs), T, H]


def step_rows(
    positions: torch.Tensor,
    token_req: torch.Tensor,
    start_pos: torch.Tensor,
    query_start: torch.Tensor,
    slot_ids: torch.Tensor,
    slot_mapping: torch.Tensor,
    tables: torch.Tensor,
    sizes: tuple[int, int, int, int],
    consts: torch.Tensor,
    freqs: torch.Tensor,
) -> Rows:
    """A step's rows from ``ForwardContext``'s tensors (int64): ``sizes`` = (slots, ring rows,
    tail rows, block size); ``consts`` int64 on the device (made once: a copy from the host
    would be a graph node reading freed memory): ``R`` ratios, each dividing the block size,
    their spare rows, then ``A`` backs; ``freqs`` [A, H] fp32: angles at ``position - back``."""
    num_slots, ring_len, tail_n, block_size = sizes
    t, dev = len(positions), positions.device
    a, h = freqs.shape
    nr = (len(consts) - a) // 2
    # rows an even count apart: each starts 16-byte aligned, as Triton specialises pointers on
    # it (an odd token count would compile other variants of the kernels reading them)
    ints = torch.empty(CLOSES + nr, t + t % 2, dtype=torch.int64, device=dev)[:, :t]
    real = torch.empty(t, dtype=torch.bool, device=dev)
    angles = torch.empty(a, t, h, dtype=torch.float32, device=dev)
    if t:
        _step_rows_kernel[(triton.cdiv(t, BLOCK),)](
            positions, token_req, start_pos, query_start, slot_ids, slot_mapping, tables,
            consts, freqs, consts[2 * nr :], ints, real, angles, t, ints.stride(0),
            tables.shape[-1], num_slots, ring_len, tail_n, block_size, NR=nr, NA=a, H=h,
            HP=triton.next_power_of_2(h), BLOCK=BLOCK,
        )  # fmt: skip
    return Rows(ints, real, angles)
