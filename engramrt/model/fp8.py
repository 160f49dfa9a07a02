"""The block-scaled FP8 format of DeepSeek's released weights, as far as the shared skeleton
needs it: the Engram's projection is stored so in every family's checkpoints, and the loader
dequantises such weights once. A family's own formats live with the family."""

from __future__ import annotations

import torch


def decode_e8m0(raw: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (uint8, or a ``float8_e8m0fnu`` tensor) as fp32 powers of two; 255 is NaN."""
    b = raw.view(torch.uint8).to(torch.int32)
    # 2**(b - 127) from the bits: b is the fp32 exponent field, except byte 0 (2**-127, which
    # fp32 holds as a subnormal: mantissa bit 22)
    bits = torch.where(b == 0, torch.full_like(b, 1 << 22), b << 23)
    out = bits.view(torch.float32)
    return torch.where(b == 255, torch.full_like(out, float("nan")), out)


def dequant_fp8_weight(
    weight: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """A dense FP8 weight ``[out, in]`` (E4M3) with its E8M0 block scales ``[ceil(out / 32),
    ceil(in / 32)]`` as ``dtype`` values: exact in bf16 (an E4M3 value times a power of two)."""
    out_f, in_f = weight.shape
    want = (-(-out_f // 32), -(-in_f // 32))
    if tuple(scale.shape) != want:
        raise ValueError(
            f"an FP8 weight [{out_f}, {in_f}] needs scales {list(want)}, got {list(scale.shape)}"
        )
    s = decode_e8m0(scale).repeat_interleave(32, 0)[:out_f].repeat_interleave(32, 1)[:, :in_f]
    return (weight.float() * s).to(dtype)
