"""The MoE's epilogues of the stored-format kernel (``engramrt.kernels.moe_epilogues`` through
``stored_linear``'s ``swiglu``) against the torch path they replace: the plain product of the
same launch settings, then ``moe.clamped_swiglu`` and ``act_quant``. Random rows past the
clamps, with and without routing weights, FP8 and FP4 (grouped, rows gathered), split K by
several programs and by one, features that leave a partial tile."""

from __future__ import annotations

import pytest
import torch

from engramrt.kernels import stored_linear as module
from engramrt.kernels.stored_linear import (
    SwiGLU,
    group_tile_rows,
    group_tiles,
    grouped_stored_linear,
    stored_linear,
)
from engramrt.models.deepseek_v41 import quant
from engramrt.models.deepseek_v41.moe import clamped_swiglu

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPE = torch.bfloat16 if DEVICE == "cuda" else torch.float32  # the interpreter's dot: fp32
LIMIT = 4.0


def assert_codes_match(got, gate_up: torch.Tensor, weight: torch.Tensor | None) -> None:
    """``got`` (``Codes``) against ``act_quant(clamped_swiglu(...))`` of the plain product:
    bit for bit on a GPU (CUDA's expf and a correctly rounded division, as torch's silu); the
    interpreter's exp is numpy's, which may round a last fp32 bit differently, so there the
    dequantised values agree but for rare one-step E4M3 roundings. The values are the codes'
    round trip (exact in bf16) either way."""
    gate, up = gate_up.cpu().chunk(2, dim=-1)
    w = None if weight is None else weight.cpu()[:, None]
    want_codes, want_scale = quant.act_quant(clamped_swiglu(gate, up, LIMIT, w).to(DTYPE))
    codes, scale, values = got.codes.cpu(), got.scale.cpu(), got.values.cpu().float()
    trip = (codes.float().unflatten(-1, (-1, 32)) * scale[..., None]).flatten(-2)
    assert torch.equal(values, trip)
    if DEVICE == "cuda":
        assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
        assert torch.equal(scale, want_scale)
        return
    want = (want_codes.float().unflatten(-1, (-1, 32)) * want_scale[..., None]).flatten(-2)
    same = trip == want
    assert same.float().mean() > 0.995
    assert bool(((trip - want).abs() <= want.abs() / 8 + 1e-30)[~same].all())


@pytest.mark.parametrize("spread", [True, False])
@pytest.mark.parametrize("inter", [96, 160])
def test_the_shared_experts_swiglu_epilogue_is_the_torch_paths(inter: int, spread, monkeypatch):
    """FP8 w1|w3 (the shared expert), no routing weight: ``inter`` 96 leaves a partial feature
    tile (a tile holds 64 features' gate and up rows)."""
    if not spread:
        monkeypatch.setattr(module, "SPREAD_BELOW", 0)
    g = torch.Generator().manual_seed(inter)
    k = 256
    stored, scale = quant.fp8_weight(torch.randn(2 * inter, k, generator=g) / 4)
    stored, scale = stored.to(DEVICE), scale.to(DEVICE)
    x = (torch.randn(37, k, generator=g) * 2).to(DEVICE, DTYPE)
    got = stored_linear(x, stored, scale, False, swiglu=SwiGLU(LIMIT))
    assert_codes_match(got, stored_linear(x, stored, scale, False), None)


def test_the_routed_experts_swiglu_epilogue_is_the_torch_paths() -> None:
    """FP4 experts grouped, the token rows gathered from the sorted (token, expert) pairs, each
    row's routing weight read at its pair."""
    g = torch.Generator().manual_seed(5)
    e, n, k, tokens, top = 4, 2 * 96, 128, 9, 2
    stored = [quant.fp4_weight(torch.randn(n, k, generator=g) / 4) for _ in range(e)]
    w = quant.pair_fp4(torch.stack([s[0] for s in stored])).to(DEVICE)
    s = torch.stack([s[1] for s in stored]).to(DEVICE)
    ids = torch.stack([torch.randperm(e, generator=g)[:top] for _ in range(tokens)])
    weights = torch.rand(tokens, top, generator=g).to(DEVICE)
    order = torch.sort(ids.flatten(), stable=True).indices
    counts = torch.bincount(ids.flatten(), minlength=e)
    tiles = group_tiles(counts, len(order), group_tile_rows(len(order), e)).to(DEVICE)
    x = (torch.randn(tokens, k, generator=g) * 2).to(DEVICE, DTYPE)
    order = order.to(DEVICE)
    plain = grouped_stored_linear(x, w, s, True, tiles, order, top_k=top)
    got = grouped_stored_linear(
        x, w, s, True, tiles, order, top_k=top, swiglu=SwiGLU(LIMIT, weights)
    )
    assert_codes_match(got, plain, weights.flatten()[order])


def test_a_swiglu_needs_whole_blocks_of_gate_and_up_rows() -> None:
    stored, scale = quant.fp8_weight(torch.randn(2 * 48, 64))
    with pytest.raises(ValueError, match="whole 32-blocks"):
        stored_linear(torch.randn(2, 64).to(DEVICE), stored.to(DEVICE), scale.to(DEVICE), False,
                      swiglu=SwiGLU(LIMIT))  # fmt: skip
