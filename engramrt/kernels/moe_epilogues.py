"""The epilogues that make the stored-format kernel (``stored_linear``) DeepSeek-V4.1's MoE in
five launches at decode (the torch path took some twenty small launches a layer for these
steps alone):

- ``swiglu_store``: a gate/up projection's tile (gate rows in its first half, the same features'
  up rows in the second) as the clamped SwiGLU times the row's routing weight, rounded to the
  activation dtype and quantised (``act_quant``) for the down projection: the E4M3 codes and
  scales the FP8 tensor cores take and the bf16 values the FP4 ones do. The gate and up
  products are rounded to the activation dtype first, as the torch path's two linears store
  them.
- ``combined``: a down projection's rows plus the rows ``by_id`` names, in fp32 in order (the
  MoE's combine: each token's routed outputs in ascending expert id, then the shared expert's).

``moe.clamped_swiglu`` is the formula: silu as torch's CUDA kernel computes it,
``x / (1 + exp(-x))`` with an accurate exp and a correctly rounded division.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice

from engramrt.kernels.quant_roundtrip import round_to_grid, store_act_codes


@triton.jit
def swiglu_store(total, rm, live, f0, pair, INTER, LIMIT, w_ptr, codes_ptr, scale_ptr, values_ptr,
                 HAS_W: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr,
                 LIBDEVICE: tl.constexpr):  # fmt: skip
    """Tile ``total`` [BN, BM] (fp32 sums: rows ``[0, BN/2)`` the gate features from ``f0``
    on, the rest the same features' up rows; columns the output rows ``rm`` [BM], ``live``) as
    ``act_quant(clamped_swiglu(gate, up) * weight)``'s codes, scales and values at ``rm``;
    ``HAS_W``: each row's routing weight at ``w_ptr[pair]``. ``MBITS``/``EMIN``: the activation
    dtype's grid (``rope_quant.GRID``), rounded to by bits."""
    BN: tl.constexpr = total.shape[0]
    BM: tl.constexpr = total.shape[1]
    HB: tl.constexpr = BN // 2
    halves = tl.permute(tl.reshape(total, [2, HB, BM]), [1, 2, 0])
    gate, up = tl.split(halves)  # [HB, BM] each
    if MBITS:  # the two linears' outputs, stored in the activation dtype by the torch path
        gate, up = round_to_grid(gate, MBITS, EMIN), round_to_grid(up, MBITS, EMIN)
    gate = tl.minimum(gate, LIMIT)
    up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
    e = libdevice.exp(-gate) if LIBDEVICE else tl.exp(-gate)  # CUDA's expf, as torch's silu
    h = tl.div_rn(gate, 1.0 + e) * up
    if HAS_W:
        h = h * tl.load(w_ptr + pair, mask=live, other=0.0)[None, :]
    if MBITS:
        h = round_to_grid(h, MBITS, EMIN)
    # blocks of 32 features of a row: the rows' [BM, HB] as [BM * HB / 32, 32]
    g = tl.reshape(tl.trans(h), [BM * (HB // 32), 32])
    b = f0 // 32 + tl.arange(0, HB // 32)  # the tile's feature blocks
    blk = tl.reshape(rm[:, None].to(tl.int64) * (INTER // 32) + b[None, :], [BM * (HB // 32)])
    ok = tl.reshape(live[:, None] & (b < INTER // 32)[None, :], [BM * (HB // 32)])
    store_act_codes(g, blk, ok, codes_ptr, scale_ptr, values_ptr, True)


@triton.jit
def combined(total, rm, rn, live, omask, N, add_ptr, by_id_ptr, TOP_K):
    """``total`` [BN, BM] rounded to the added rows' dtype, after the fp32 sum of each output
    row's ``TOP_K`` added rows (``by_id`` [M, TOP_K]'s, in order)."""
    own = total.to(add_ptr.dtype.element_ty).to(tl.float32)
    total = tl.zeros(total.shape, tl.float32)
    for s in range(TOP_K):
        row = tl.load(by_id_ptr + rm.to(tl.int64) * TOP_K + s, mask=live, other=0)
        total += tl.load(
            add_ptr + row[None, :].to(tl.int64) * N + rn[:, None], mask=omask, other=0.0
        ).to(tl.float32)
    return total + own
