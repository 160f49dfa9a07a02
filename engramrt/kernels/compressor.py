"""DeepSeek-V4.1's ratio-2 compressor pooling and its norm in one launch
(``engramrt.models.deepseek_v41.attention.Compressor``; the torch path takes about fifteen): each
token's
group of two, the previous row of its run or, for a run's first token, a row of its slot's tail
(the group's first token from an earlier step), softmax-weighted per channel by their gate
scores in fp32, rounded to the activation dtype, then RMS-normalised. The tail is written after
(a run's first token reads the tail its last one replaces). Products are not fused into FMAs;
``exp`` and the norm's sum of squares differ from torch's in the last fp32 bit, so results agree
to one rounding of the activation dtype, not bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engramrt.kernels.rms_norm import normalised


@triton.jit
def _pool_norm_kernel(
    a_ptr, s_ptr, tail_ptr, inside_ptr, row_ptr, w_ptr, out_ptr, eps, D: tl.constexpr
):
    t = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, D)
    a = tl.load(a_ptr + t * D + d)
    s = tl.load(s_ptr + t * D + d)
    inside = (tl.load(inside_ptr + t) + d * 0) != 0
    held = tail_ptr + tl.load(row_ptr + t).to(tl.int64) * 2 * D + d  # (projection, score)
    pa = tl.where(
        inside,
        tl.load(a_ptr + (t - 1) * D + d, mask=inside, other=0.0),
        tl.load(held, mask=~inside, other=0.0),
    )
    ps = tl.where(
        inside,
        tl.load(s_ptr + (t - 1) * D + d, mask=inside, other=0.0),
        tl.load(held + D, mask=~inside, other=0.0),
    )
    top = tl.maximum(ps, s)
    e0, e1 = tl.exp(ps - top), tl.exp(s - top)
    total = e0 + e1
    pooled = (pa * (e0 / total) + a * (e1 / total)).to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + d).to(tl.float32)
    tl.store(out_ptr + t * D + d, normalised(pooled, w, eps, D).to(out_ptr.dtype.element_ty))


def pool_norm(
    a: torch.Tensor,
    s: torch.Tensor,
    tail: torch.Tensor,
    inside: torch.Tensor,
    rows: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Projections ``a`` and gate scores ``s`` [T, D] (fp32), the ``tail`` [R, 2, D] and the
    row of it each token reads (``rows`` [T]) where its group does not start at the previous
    row (``inside`` [T]). Out ``[T, D]`` in ``dtype``."""
    t, d = a.shape
    if d & (d - 1):
        raise ValueError(f"the latent width must be a power of two, got {d}")
    out = torch.empty(t, d, dtype=dtype, device=a.device)
    if t:
        _pool_norm_kernel[(t,)](
            a.contiguous(),
            s.contiguous(),
            tail,
            inside,
            rows,
            weight,
            out,
            eps,
            D=d,
            enable_fp_fusion=False,
        )
    return out
