"""RMSNorm in one launch (``engramrt.model.layers.rms_norm``'s torch path takes about eight):
one program a row, fp32 ``x * rsqrt(mean(x^2) + eps) * weight`` rounded once to x's dtype. The
sum of squares runs in another order than torch's, so results agree to fp32 rounding before
the cast, not bitwise. V4.1 normalises four projections a layer (q, kv, index keys, compressed
latents) and every stage's last hidden state."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_WIDTH = 16384  # one program holds a row


@triton.jit
def normalised(x, w, eps, N: tl.constexpr):
    """One fp32 row ``x`` (zeros past ``N``) times ``rsqrt(mean(x^2) + eps)`` and the weight
    ``w`` (fp32): also the last step of the compressor's kernel."""
    return x * tl.rsqrt(tl.sum(x * x, axis=0) / N + eps) * w


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, eps, stride, N: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < N
    x = tl.load(x_ptr + r * stride + i, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + r * N + i, normalised(x, w, eps, N).to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Rows up to ``MAX_WIDTH`` wide (the caller takes the torch path above). A matrix's rows
    may be apart (a slice of a wider product's columns: no copy); out contiguous."""
    n = x.shape[-1]
    if not (x.dim() == 2 and x.stride(-1) == 1):
        x = x.contiguous()
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel():
        _rms_norm_kernel[(x.numel() // n,)](
            x,
            weight,
            out,
            eps,
            x.stride(0) if x.dim() == 2 else n,
            N=n,
            BLOCK=triton.next_power_of_2(n),
        )
    return out
