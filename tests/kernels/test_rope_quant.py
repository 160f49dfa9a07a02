"""V4.1's fused RoPE + round trip + cache write (``engramrt.kernels.rope_quant``) bit for bit
against the torch path of ``engramrt.models.deepseek_v41.attention.rope_quant`` (``rotate_tail``,
then
``engramrt.models.deepseek_v41.quant``'s round trip, then ``index_copy_``): every kind, the inverse
rotation,
one and several heads, a rotated tail narrower than the row, bf16 and fp32, values over a wide
range so that round trips saturate and blocks' scales differ; rows of -1 write nothing."""

from __future__ import annotations

import pytest
import torch

from engramrt.kernels import quant_roundtrip as rt
from engramrt.kernels.rope_quant import NONE
from engramrt.kernels.rope_quant import rope_quant as fused
from engramrt.models.deepseek_v41 import quant
from engramrt.models.deepseek_v41.attention import ACT, rope_quant

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KINDS = {None: NONE, ACT: rt.ACT, quant.POW2_SCALE: rt.FP4_POW2, quant.E4M3_SCALE: rt.FP4_E4M3}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_is_the_torch_path_bitwise(kind, dtype) -> None:
    g = torch.Generator().manual_seed(len(str(kind)) + (dtype == torch.bfloat16))
    t, d, rd = 7, 64, 16
    for heads, inverse in ((1, False), (3, True)):
        shape = (t, d) if heads == 1 else (t, heads, d)
        x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-6, 9, shape, generator=g))
        x = x.to(dtype)
        angles = torch.rand(t, rd // 2, generator=g) * 40
        cos, sin = angles.cos(), angles.sin()
        rows = torch.randperm(12, generator=g)[:t]
        want_cache = torch.zeros(12, heads * d, dtype=dtype)
        want = rope_quant(x, (cos, sin), kind, inverse, want_cache, rows)  # the CPU: torch
        cache = torch.zeros(12, heads * d, dtype=dtype, device=DEVICE)
        dev = [v.to(DEVICE) for v in (x, cos, sin, rows)]
        got = fused(dev[0], dev[1], dev[2], KINDS[kind], inverse, cache, dev[3]).cpu()
        # bitwise (an exact zero's sign aside)
        assert torch.equal(got, want), (heads, inverse)
        assert torch.equal(cache.cpu(), want_cache), (heads, inverse)


def test_rows_of_minus_one_write_nothing() -> None:
    x = torch.randn(3, 32, device=DEVICE)
    cos, sin = torch.ones(3, 4, device=DEVICE), torch.zeros(3, 4, device=DEVICE)
    cache = torch.zeros(4, 32, device=DEVICE)
    out = fused(x, cos, sin, NONE, False, cache, torch.tensor([2, -1, 0], device=DEVICE))
    assert torch.equal(out, x)  # a zero angle turns nothing
    assert torch.equal(cache[[2, 0]], x[[0, 2]]) and not cache[[1, 3]].any()


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_norm_in_the_same_launch(kind) -> None:
    """With ``norm`` the row is RMS-normalised first, as RMSNorm's own launch then the fused
    kernel without it give, bit for bit: integer inputs keep the sum of squares exact in any
    order, so the one rsqrt is the same (bf16 only on a GPU: the interpreter's casts truncate
    where its round trip rounds). The torch path's order (norm, rotation) to fp32 rounding."""
    from engramrt.kernels.rms_norm import rms_norm
    from engramrt.model.layers import RMSNorm

    dtypes = [torch.float32] + ([torch.bfloat16] if DEVICE == "cuda" else [])
    g = torch.Generator().manual_seed(5)
    t, d, rd = 6, 64, 16
    for dtype in dtypes:
        x = torch.randint(-8, 9, (t, d), generator=g).to(dtype).to(DEVICE)
        norm = RMSNorm(d, 1e-6, dtype).to(DEVICE)
        norm.weight.data = (torch.rand(d, generator=g) + 0.5).to(dtype).to(DEVICE)
        angles = torch.rand(t, rd // 2, generator=g) * 40
        cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
        rows = torch.arange(t).to(DEVICE)
        caches = [torch.zeros(t, d, dtype=dtype, device=DEVICE) for _ in range(2)]
        held = (norm.weight, norm.eps)
        got = fused(x, cos, sin, KINDS[kind], False, caches[0], rows, held)
        normed = rms_norm(x, norm.weight, norm.eps)
        want = fused(normed, cos, sin, KINDS[kind], False, caches[1], rows)
        assert torch.equal(got, want) and torch.equal(caches[0], caches[1]), dtype
    x32, w32 = x.float().cpu(), norm.weight.float().cpu()
    torch_norm = RMSNorm(d, 1e-6, torch.float32)
    torch_norm.weight.data = w32
    want = rope_quant(x32, (cos.cpu(), sin.cpu()), None, norm=torch_norm)
    got = fused(x32.to(DEVICE), cos, sin, NONE, norm=(w32.to(DEVICE), 1e-6)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_a_norm_over_several_heads_is_refused() -> None:
    """The launch's norm is a one-head projection's: several heads (or a weight of another
    width) would normalise each head alone, which no V4.1 norm does; refused, naming the
    shapes. An empty step is no error."""
    x = torch.randn(3, 2, 16).to(DEVICE)
    none = torch.zeros(0, 16).to(DEVICE)  # an empty step is no error
    got = fused(none, none[:, :4], none[:, :4], NONE, norm=(torch.ones(16).to(DEVICE), 1e-6))
    assert got.shape == (0, 16)
    cos, sin = torch.ones(3, 4).to(DEVICE), torch.zeros(3, 4).to(DEVICE)
    with pytest.raises(ValueError, match=r"rows \[T, D\] \(one head\).*got \[3, 2, 16\]"):
        fused(x, cos, sin, NONE, norm=(torch.ones(16).to(DEVICE), 1e-6))
    with pytest.raises(ValueError, match=r"got \[3, 16\] and 32 weights"):
        fused(x[:, 0], cos, sin, NONE, norm=(torch.ones(32).to(DEVICE), 1e-6))
