"""Helpers that several kernels share: a dot product that stays exact under Triton's
interpreter, and whether the interpreter runs."""

from __future__ import annotations

import os

import triton
import triton.language as tl


@triton.jit
def dot_f32(a, b, F32: tl.constexpr):
    """``a @ b`` accumulated in fp32. ``F32``: in fp32 at full precision, for fp32 operands, and
    for bf16 ones under Triton's interpreter, whose ``tl.dot`` multiplies bf16 bit patterns as
    integers; bf16 values are exact in fp32, so the result is the tensor-core one's."""
    if F32:
        c = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


def interpreted() -> bool:
    """Triton's CPU interpreter (``TRITON_INTERPRET=1``), where the tests run the kernels."""
    return os.environ.get("TRITON_INTERPRET") == "1"
