"""The one-launch RMSNorm (``engramrt.kernels.rms_norm``) against the torch path
(``engramrt.model.layers.rms_norm``): rows of several widths (a power of two and not), leading
dims kept, magnitudes far from one; equal to fp32 rounding (the sum of squares in another
order), one bf16 rounding on the GPU."""

from __future__ import annotations

import pytest
import torch

from engramrt.kernels.rms_norm import rms_norm as kernel
from engramrt.model.layers import rms_norm

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("width", [48, 512])
def test_kernel_is_the_torch_path(width: int) -> None:
    g = torch.Generator().manual_seed(width)
    dtype = torch.bfloat16 if DEVICE == "cuda" else torch.float32
    x = (torch.randn(3, 5, width, generator=g) * torch.rand(3, 5, 1, generator=g) * 100).to(dtype)
    w = (torch.randn(width, generator=g) + 1).to(dtype)
    want = rms_norm(x, w, 1e-6)
    got = kernel(x.to(DEVICE), w.to(DEVICE), 1e-6).cpu()
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = 1e-6 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))


def test_a_slice_of_columns_is_read_in_place() -> None:
    """Rows apart in memory (a column slice of a wider product, as V4.1's stacked ``wq_a`` /
    ``wkv`` product is normalised) give the bits of the same rows copied together."""
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(7, 96 + 40, generator=g).to(DEVICE)
    w = (torch.randn(40, generator=g) + 1).to(DEVICE)
    part = wide[:, 96:]
    assert not part.is_contiguous()
    got = kernel(part, w, 1e-6)
    assert got.is_contiguous() and torch.equal(got, kernel(part.contiguous(), w, 1e-6))


@pytest.mark.parametrize("width", [96, 512])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_normed_rows_codes_in_one_launch(width: int, dtype: torch.dtype) -> None:
    """``rms_norm_codes`` gives, bit for bit, ``act_codes`` of the normalised row (two launches
    before): rows apart in memory too, magnitudes across blocks' scales; a width that is not
    whole 32-wide blocks is refused."""
    from engramrt.kernels.quant_roundtrip import act_codes
    from engramrt.kernels.rms_norm import rms_norm_codes

    g = torch.Generator().manual_seed(width)

    def spread(*shape: int) -> torch.Tensor:  # powers of two over a wide range
        return torch.exp2(torch.randint(-8, 8, shape, generator=g).float())

    x = (torch.randn(5, width + 32, generator=g) * spread(5, 1)).to(dtype).to(DEVICE)[:, 32:]
    w = (torch.rand(width, generator=g) * spread(width)).to(dtype).to(DEVICE)
    codes, scale = rms_norm_codes(x, w, 1e-6)
    want_codes, want_scale, _ = act_codes(kernel(x, w, 1e-6))
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (5, width // 32)
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8))
    assert torch.equal(scale, want_scale)
    with pytest.raises(ValueError, match="multiple of 32"):
        rms_norm_codes(x[:, :40], w[:40], 1e-6)
