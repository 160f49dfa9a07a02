"""The batch-invariant dense product (``engramrt.kernels.dense_linear``) against torch's
(float64 oracle within fp32's sum-order bound), grouped weights included; and what it is for:
a row's bits alone equal its bits among other rows, in small and large tiles."""

from __future__ import annotations

import pytest
import torch

from engramrt.kernels import dense_linear as module
from engramrt.kernels.dense_linear import dense_linear

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("m", "n", "k", "wdtype"),
    [(1, 70, 96, torch.float32), (37, 130, 200, torch.float32), (5, 64, 128, torch.bfloat16)],
)
def test_dense_linear_is_the_product(m, n, k, wdtype) -> None:
    g = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g).to(wdtype)
    x = x.to(wdtype)
    got = dense_linear(x.to(DEVICE), w.to(DEVICE), torch.float32).cpu().double()
    exact = x.double() @ w.double().T
    bound = (x.double().abs() @ w.double().abs().T) * 2**-16
    assert bool(((got - exact).abs() <= bound).all())


def test_grouped_weights_apply_per_group() -> None:
    """``w`` [G, N, K]: each group of ``x`` [T, G, K] through its own weight (V4.1's wo_a)."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(3, 4, 32, generator=g)
    w = torch.randn(4, 24, 32, generator=g)
    got = dense_linear(x.to(DEVICE), w.to(DEVICE)).cpu().double()
    exact = torch.einsum("tgk,gnk->tgn", x.double(), w.double())
    assert got.shape == (3, 4, 24)
    torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("xs", "ws"), [((3, 32), (24, 31)), ((3, 4, 32), (5, 24, 32)), ((3, 32), (2, 2, 24, 32))]
)
def test_shapes_that_do_not_fit_are_refused(xs, ws) -> None:
    with pytest.raises(ValueError, match="does not fit"):
        dense_linear(torch.zeros(xs, device=DEVICE), torch.zeros(ws, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="the interpreter's dot is numpy's matmul (BLAS)")
@pytest.mark.parametrize("wdtype", [torch.float32, torch.bfloat16])
def test_a_rows_bits_ignore_its_batch(wdtype, monkeypatch) -> None:
    """Each row alone, and among random others in 16- and 64-row tiles (a batch of 90 takes
    the 64-row ones by itself): the same bits (the interpreter's dot is numpy's, whose sums
    follow the row count: a GPU's property). K long enough for many steps, as a model's."""
    g = torch.Generator().manual_seed(4)
    x = torch.randn(90, 1024, generator=g).to(DEVICE, wdtype)
    w = (torch.randn(200, 1024, generator=g) / 32).to(DEVICE, wdtype)
    alone = torch.cat([dense_linear(x[i : i + 1], w) for i in range(90)])
    perm = torch.randperm(90, generator=g).to(DEVICE)
    assert torch.equal(dense_linear(x[perm], w), alone[perm])
    assert torch.equal(dense_linear(x[perm[:20]], w), alone[perm[:20]])
    monkeypatch.setattr(module, "LARGE_ROWS", 0)
    assert torch.equal(dense_linear(x[perm[:20]], w), alone[perm[:20]])


def test_the_model_routes_dense_products_by_the_flag(monkeypatch) -> None:
    """``kernels.linear`` takes the kernel only under ``--batch-invariant`` on a GPU."""
    from engramrt import kernels
    from engramrt.kernels.linear import linear

    calls = []
    monkeypatch.setattr(module, "dense_linear", lambda *a: calls.append(a) or a[0])
    monkeypatch.setattr(kernels, "use_triton", lambda device: True)
    x, w = torch.randn(2, 8), torch.randn(4, 8)
    linear(x, w)
    assert calls == []
    kernels.set_batch_invariant(True)
    try:
        linear(x, w)
    finally:
        kernels.set_batch_invariant(False)
    assert len(calls) == 1
