"""The MoE's fused SwiGLU (``engramrt.kernels.moe_epilogues``) against the torch path it
replaces (``moe.clamped_swiglu`` then ``act_quant``): random rows past the clamps, with and
without routing weights, odd widths of blocks."""

from __future__ import annotations

import pytest
import torch

from engramrt.kernels.moe_epilogues import swiglu_codes
from engramrt.models.deepseek_v41 import quant
from engramrt.models.deepseek_v41.moe import clamped_swiglu

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("weighted", [True, False])
def test_swiglu_codes_are_the_torch_paths(weighted: bool) -> None:
    """Bit for bit on a GPU (CUDA's expf and a correctly rounded division, as torch's silu);
    the interpreter's exp is numpy's, which may round a last fp32 bit differently, so there the
    dequantised values agree but for rare one-step E4M3 roundings."""
    g = torch.Generator().manual_seed(int(weighted))
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    rows, inter, limit = 37, 9 * 32, 4.0
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 3).to(dtype)
    w = torch.rand(rows, generator=g) if weighted else None
    gate, up = gate_up.chunk(2, dim=-1)
    h = clamped_swiglu(gate, up, limit, None if w is None else w[:, None]).to(dtype)
    want_codes, want_scale = quant.act_quant(h)
    codes, scale, values = swiglu_codes(
        gate_up.to(DEVICE), limit, None if w is None else w.to(DEVICE), values=True
    )
    codes, scale, values = codes.cpu(), scale.cpu(), values.cpu().float()
    # the values FP4 weights take: the codes' round trip, exact in bf16
    trip = (codes.float().unflatten(-1, (-1, 32)) * scale[..., None]).flatten(-2)
    assert torch.equal(values, trip)
    if DEVICE == "cuda":
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
        assert torch.equal(scale, want_scale)
        return
    got = (codes.float().unflatten(-1, (-1, 32)) * scale[..., None]).flatten(-2)
    want = (want_codes.float().unflatten(-1, (-1, 32)) * want_scale[..., None]).flatten(-2)
    same = got == want
    assert same.float().mean() > 0.999
    assert bool(((got - want).abs() <= want.abs() / 8 + 1e-30)[~same].all())


def test_routing_weights_read_through_an_index() -> None:
    """``weight_at``: each row's routing weight read from the flat weights in the kernel, the
    same bits as the weights gathered beforehand (the sorted pairs' weights)."""
    g = torch.Generator().manual_seed(5)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    gate_up = (torch.randn(12, 2 * 64, generator=g) * 3).to(DEVICE, dtype)
    weights = torch.rand(6, 2, generator=g).to(DEVICE)
    at = torch.randperm(12, generator=g).to(DEVICE)
    got = swiglu_codes(gate_up, 4.0, weights, weight_at=at)
    want = swiglu_codes(gate_up, 4.0, weights.flatten()[at])
    for a, b in zip(got[:2], want[:2], strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_rows_past_the_weighted_take_no_weight() -> None:
    """``weighted``: the routed rows (first) take their weights, the shared expert's after them
    none, in one launch: each part the same bits as its own launch."""
    g = torch.Generator().manual_seed(8)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    gate_up = (torch.randn(11, 2 * 96, generator=g) * 3).to(DEVICE, dtype)
    weights = torch.rand(4, 2, generator=g).to(DEVICE)
    at = torch.randperm(8, generator=g).to(DEVICE)
    got = swiglu_codes(gate_up, 4.0, weights, at, values=True, weighted=8)
    routed = swiglu_codes(gate_up[:8], 4.0, weights, at, values=True)
    shared = swiglu_codes(gate_up[8:], 4.0, values=True)
    for a, b, c in zip(got, routed, shared, strict=True):
        assert torch.equal(a[:8].view(torch.uint8), b.view(torch.uint8))
        assert torch.equal(a[8:].view(torch.uint8), c.view(torch.uint8))
