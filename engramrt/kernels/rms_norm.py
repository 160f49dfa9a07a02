"""RMSNorm in one launch (``engramrt.model.layers.rms_norm``'s torch path takes about eight):
one program a row, fp32 ``x * rsqrt(mean(x^2) + eps) * weight`` rounded once to x's dtype. The
sum of squares runs in another order than torch's, so results agree to fp32 rounding before
the cast, not bitwise. V4.1 normalises four projections a layer (q, kv, index keys, compressed
latents) and every stage's last hidden state."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engramrt.kernels.quant_roundtrip import store_act_codes

MAX_WIDTH = 16384  # one program holds a row


@triton.jit
def normalised(x, w, eps, N: tl.constexpr):
    """One fp32 row ``x`` (zeros past ``N``) times ``rsqrt(mean(x^2) + eps)`` and the weight
    ``w`` (fp32): also the last step of the compressor's kernel."""
    return x * tl.rsqrt(tl.sum(x * x, axis=0) / N + eps) * w


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    scale_ptr,
    eps,
    stride,
    N: tl.constexpr,
    BLOCK: tl.constexpr,
    CODES: tl.constexpr,
):
    """A row normalised and rounded to its dtype; ``CODES``: its ``act_quant`` instead (E4M3
    codes to ``out``, fp32 scales to ``scale``), what the linears after it read."""
    r = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK)
    m = i < N
    x = tl.load(x_ptr + r * stride + i, mask=m, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + i, mask=m, other=0.0).to(tl.float32)
    y = normalised(x, w, eps, N).to(x_ptr.dtype.element_ty)
    if CODES:
        blk = tl.arange(0, BLOCK // 32)
        g = tl.reshape(y.to(tl.float32), [BLOCK // 32, 32])
        store_act_codes(g, r * (N // 32) + blk, blk < N // 32, out_ptr, scale_ptr, out_ptr, False)
    else:
        tl.store(out_ptr + r * N + i, y, mask=m)


def _launch(x: torch.Tensor, weight: torch.Tensor, eps: float, out, scale=None) -> None:
    n = x.shape[-1]
    if x.numel():
        _rms_norm_kernel[(x.numel() // n,)](
            x,
            weight,
            out,
            out if scale is None else scale,
            eps,
            x.stride(0) if x.dim() == 2 else n,
            N=n,
            BLOCK=triton.next_power_of_2(n),
            CODES=scale is not None,
        )


def _rows(x: torch.Tensor) -> torch.Tensor:
    """A matrix's rows may be apart (a slice of a wider product's columns: no copy)."""
    return x if x.dim() == 2 and x.stride(-1) == 1 else x.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Rows up to ``MAX_WIDTH`` wide (the caller takes the torch path above); out contiguous."""
    x = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x, weight, eps, out)
    return out


def rms_norm_codes(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``quant_roundtrip.act_codes(rms_norm(x, weight, eps))`` in one launch, bit for bit: (E4M3
    codes, fp32 scales ``[..., N / 32]``); the normalised row itself is not written."""
    if x.shape[-1] % 32:
        raise ValueError(f"the last dim ({x.shape[-1]}) must be a multiple of 32")
    x = _rows(x)
    codes = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(*x.shape[:-1], x.shape[-1] // 32, dtype=torch.float32, device=x.device)
    _launch(x, weight, eps, codes, scale)
    return codes, scale
