"""``row_invariant``: inside it each row of a float32 CPU product is the row computed alone, for
the products the models make (linears with and without bias, batched and 3-D inputs, einsums),
and each value of sigmoid, silu and softplus is the value computed alone; outside it, and for
other dtypes, the kernels are aten's own."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engramrt.kernels.row_invariant import ROWS, row_invariant

SHAPES = [(64, 64), (96, 40), (256, 1024), (128, 3000), (1024, 256)]


@pytest.mark.parametrize(("k", "n"), SHAPES)
def test_each_row_of_a_linear_is_the_row_alone(k: int, n: int) -> None:
    g = torch.Generator().manual_seed(k + n)
    w, bias = torch.randn(n, k, generator=g), torch.randn(n, generator=g)
    x = torch.randn(4 * ROWS + 5, k, generator=g)
    with row_invariant():
        for b in (None, bias):
            alone = torch.cat([F.linear(x[i : i + 1], w, b) for i in range(len(x))])
            for m in (1, 2, 3, ROWS - 1, ROWS, ROWS + 1, len(x)):
                for s in (0, 4):  # and wherever the row sits among the others
                    assert torch.equal(F.linear(x[s : s + m], w, b), alone[s : s + m]), (m, s)
            three = F.linear(x[: 3 * 5].view(3, 5, k), w, b)
            assert torch.equal(three.flatten(0, 1), alone[:15])
    torch.testing.assert_close(alone, F.linear(x, w, bias), rtol=1e-5, atol=1e-4)


def test_batched_products_and_einsums_by_row() -> None:
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(6, 37, 24, generator=g), torch.randn(6, 24, 19, generator=g)
    x, y = torch.randn(37, 4, 16, generator=g), torch.randn(4, 8, 16, generator=g)
    with row_invariant():
        got = torch.bmm(a, b)
        alone = torch.cat([torch.bmm(a[:, i : i + 1], b) for i in range(37)], 1)
        assert torch.equal(got, alone)
        ein = torch.einsum("tgd,grd->tgr", x, y)
        assert torch.equal(
            ein, torch.cat([torch.einsum("tgd,grd->tgr", x[i : i + 1], y) for i in range(37)])
        )
        assert all(torch.equal(torch.bmm(a[:j], b[:j]), got[:j]) for j in (1, 2, 5))
        keys = torch.randn(37, 9, 16, generator=g)  # attention's scores: a batch entry a token
        s = torch.einsum("mhd,mrd->mhr", x, keys)
        per_token = [torch.einsum("mhd,mrd->mhr", x[i : i + 1], keys[i : i + 1]) for i in range(37)]
        assert torch.equal(s, torch.cat(per_token))
    torch.testing.assert_close(got, torch.bmm(a.double(), b.double()).float(), rtol=1e-5, atol=1e-5)


def test_outside_the_context_and_other_dtypes_are_unchanged() -> None:
    g = torch.Generator().manual_seed(2)
    w, x = torch.randn(300, 64, generator=g), torch.randn(5, 64, generator=g)
    want = (x.double() @ w.double().t()).float()
    with row_invariant():
        pass  # the override is registered now; outside a context it does nothing
    torch.testing.assert_close(x @ w.t(), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(
        torch.addmm(want[0], x, w.t(), beta=0.5, alpha=2.0),
        2 * want + 0.5 * want[0],
        rtol=1e-5,
        atol=1e-3,
    )
    with row_invariant():
        half = x.bfloat16() @ w.t().bfloat16()  # not float32: aten's product, whole
        scaled = torch.addmm(want[0], x, w.t(), beta=0.5, alpha=2.0)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), want, rtol=2e-2, atol=2e-1)
    torch.testing.assert_close(scaled, 2 * want + 0.5 * want[0], rtol=1e-5, atol=1e-3)
    w.requires_grad_()
    (x @ w.t()).sum().backward()  # autograd outside the context: aten's own products
    torch.testing.assert_close(w.grad, x.sum(0).expand(300, 64), rtol=1e-5, atol=1e-5)


ELEMENTWISE = {
    "sigmoid": torch.sigmoid,
    "silu": F.silu,
    "softplus": F.softplus,
    "softplus(beta=2, threshold=5)": lambda t: F.softplus(t, beta=2, threshold=5),
}


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
def test_elementwise_values_do_not_depend_on_their_place(name: str) -> None:
    """aten's CPU kernels round a value by where it falls in the buffer (the lengths that part
    are asserted, so the test fails if aten changes and the override is no longer needed: then
    remove it); inside the context they do not, and stay within two ulps of aten's."""
    fn = ELEMENTWISE[name]
    x = torch.randn(50_000, generator=torch.Generator().manual_seed(3)) * 8
    x[:4] = torch.tensor([-200.0, 200.0, float("nan"), 0.0])
    lengths = [*range(1, 130), 4097, 40_001]
    with row_invariant():
        whole = fn(x)
        assert all(_same(fn(x[:n]), whole[:n]) for n in lengths)
    aten = fn(x)
    assert not all(_same(fn(x[:n]), aten[:n]) for n in lengths)
    torch.testing.assert_close(whole, aten, rtol=3e-7, atol=1e-30, equal_nan=True)
