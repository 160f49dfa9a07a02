"""mHC primitives against literal re-statements written here with explicit loops.

hc_split_sinkhorn is re-stated twice, in float64 (Python floats) and in float32 (numpy float32
scalars, same op order as the reference), and the mixes/collapse/expand against plain loops.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engramrt.model.mhc import first_pre, hc_mixes, hc_post, hc_pre, hc_split_sinkhorn

EPS = 1e-6  # hc_eps


def restated_sinkhorn(mixes, scale, base, hc: int, iters: int, eps: float, f32: bool):
    """hc_split_sinkhorn for ONE token, loops over j and k; float32 or float64."""
    if f32:
        num = np.float32

        def exp(v):
            return np.exp(np.float32(v))
    else:
        num = float
        exp = math.exp

    def sigmoid(v):
        return num(1) / (num(1) + exp(-v))

    m = [num(v) for v in mixes]
    s = [num(v) for v in scale]
    b = [num(v) for v in base]
    e = num(eps)
    pre = [sigmoid(m[j] * s[0] + b[j]) + e for j in range(hc)]
    post = [num(2) * sigmoid(m[hc + j] * s[1] + b[hc + j]) for j in range(hc)]
    logit = [
        [m[2 * hc + hc * j + k] * s[2] + b[2 * hc + hc * j + k] for k in range(hc)]
        for j in range(hc)
    ]
    c = [[num(0)] * hc for _ in range(hc)]
    for j in range(hc):
        row_max = logit[j][0]
        for k in range(1, hc):
            row_max = max(row_max, logit[j][k])
        ex = [exp(logit[j][k] - row_max) for k in range(hc)]
        total = num(0)
        for k in range(hc):
            total = total + ex[k]
        for k in range(hc):
            c[j][k] = ex[k] / total + e

    def normalise_columns():
        for k in range(hc):
            total = num(0)
            for j in range(hc):
                total = total + c[j][k]
            for j in range(hc):
                c[j][k] = c[j][k] / (total + e)

    def normalise_rows():
        for j in range(hc):
            total = num(0)
            for k in range(hc):
                total = total + c[j][k]
            for k in range(hc):
                c[j][k] = c[j][k] / (total + e)

    normalise_columns()
    for _ in range(iters - 1):
        normalise_rows()
        normalise_columns()
    return np.array(pre, np.float64), np.array(post, np.float64), np.array(c, np.float64)


def random_split_inputs(seed: int, hc: int, tokens: int = 4, size: float = 2.0):
    """Random mixes (std ``size``), scale in [0.5, 1.5) and base (std ``size / 2``)."""
    gen = torch.Generator().manual_seed(seed)
    mix = (2 + hc) * hc
    mixes = torch.randn(tokens, mix, generator=gen) * size
    scale = torch.rand(3, generator=gen) + 0.5
    base = torch.randn(mix, generator=gen) * (size / 2)
    return mixes, scale, base


SPLIT_CASES = [(seed, hc, iters) for seed in range(3) for hc in (4, 2) for iters in (20, 1, 3)]


@pytest.mark.parametrize(("seed", "hc", "iters"), SPLIT_CASES)
def test_split_sinkhorn_matches_restatement(seed: int, hc: int, iters: int) -> None:
    """Guards the reference's op order (eps placement, first column pass, iters-1 row/col pairs,
    pre +eps, post x2): tight vs the float32 re-statement, loose vs float64."""
    mixes, scale, base = random_split_inputs(seed, hc)
    pre, post, comb = hc_split_sinkhorn(mixes, scale, base, hc, iters, EPS)
    assert pre.shape == post.shape == (mixes.shape[0], hc)
    assert comb.shape == (mixes.shape[0], hc, hc)
    assert pre.dtype == post.dtype == comb.dtype == torch.float32
    for t in range(mixes.shape[0]):
        args = (mixes[t].tolist(), scale.tolist(), base.tolist(), hc, iters, EPS)
        for f32, rtol, atol in ((True, 1e-6, 1e-9), (False, 1e-5, 1e-7)):
            p, q, c = restated_sinkhorn(*args, f32=f32)
            np.testing.assert_allclose(pre[t].double().numpy(), p, rtol=rtol, atol=atol)
            np.testing.assert_allclose(post[t].double().numpy(), q, rtol=rtol, atol=atol)
            np.testing.assert_allclose(comb[t].double().numpy(), c, rtol=rtol, atol=atol)


def test_split_sinkhorn_restatement_discriminates() -> None:
    """The re-statement is sensitive to the pass count and the eps: one row/column pair fewer,
    or a larger eps, gives a visibly different comb (so the match above means something)."""
    mixes, scale, base = random_split_inputs(0, 4, tokens=1)
    args = (mixes[0].tolist(), scale.tolist(), base.tolist(), 4)
    _, _, ref = restated_sinkhorn(*args, 2, EPS, f32=False)
    _, _, fewer = restated_sinkhorn(*args, 1, EPS, f32=False)
    assert np.abs(ref - fewer).max() > 1e-3
    got = hc_split_sinkhorn(mixes, scale, base, 4, 2, EPS)[2][0].double().numpy()
    assert np.abs(got - fewer).max() > 1e-3
    _, _, big_eps = restated_sinkhorn(*args, 2, 1e-2, f32=False)
    assert np.abs(ref - big_eps).max() > 1e-4


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("hc", [4, 2])
def test_split_sinkhorn_ranges_and_doubly_stochastic(seed: int, hc: int) -> None:
    """Columns sum to 1 (last pass is a column pass), rows close to 1 after 20 iterations, all
    entries positive; pre - eps in (0, 1), post in (0, 2). Moderate logits: with very peaked
    ones 20 Sinkhorn passes leave rows a few percent off (that is the algorithm, not a bug)."""
    mixes, scale, base = random_split_inputs(100 + seed, hc, tokens=16, size=0.5)
    pre, post, comb = hc_split_sinkhorn(mixes, scale, base, hc, 20, EPS)
    assert bool((comb > 0).all())
    torch.testing.assert_close(comb.sum(-2), torch.ones(16, hc), rtol=0, atol=1e-5)
    torch.testing.assert_close(comb.sum(-1), torch.ones(16, hc), rtol=0, atol=1e-3)
    assert bool((pre > EPS / 2).all())
    assert bool(((pre - EPS > 0) & (pre - EPS < 1)).all())
    assert bool(((post > 0) & (post < 2)).all())


def test_split_sinkhorn_pre_eps_and_post_scale() -> None:
    """Saturated logits pin the constants: pre -> 1 + eps and eps, post -> 2 and 0 (no eps)."""
    hc = 4
    mix = (2 + hc) * hc
    base = torch.zeros(mix, dtype=torch.float64)
    base[:hc] = torch.tensor([200.0, -200.0, 0.0, 0.0])
    base[hc : 2 * hc] = torch.tensor([200.0, -200.0, 0.0, 0.0])
    mixes = torch.zeros(1, mix)
    pre, post, _ = hc_split_sinkhorn(mixes, torch.ones(3), base.float(), hc, 20, EPS)
    assert pre[0, 0].item() == np.float32(1 + EPS)
    assert pre[0, 1].item() == np.float32(EPS)
    assert pre[0, 2].item() == np.float32(0.5 + EPS)
    assert post[0].tolist() == [2.0, 0.0, 1.0, 1.0]


def restated_mixes(x: torch.Tensor, fn: torch.Tensor, eps: float) -> np.ndarray:
    """The mixes in float64: copy-major flatten, one rsqrt per token over all hc*D."""
    xs = x.double().numpy()
    f = fn.double().numpy()
    tokens, hc, dim = xs.shape
    out = np.zeros((tokens, f.shape[0]))
    for t in range(tokens):
        flat = np.array([xs[t, j, d] for j in range(hc) for d in range(dim)])
        r = 1.0 / math.sqrt(float(np.mean(flat * flat)) + eps)
        out[t] = (f @ flat) * r
    return out


def per_copy_mixes(x: torch.Tensor, fn: torch.Tensor, eps: float) -> np.ndarray:
    """The wrong variant: a separate rsqrt for each copy before the projection."""
    xs = x.double().numpy()
    r = 1.0 / np.sqrt(np.mean(xs * xs, axis=-1, keepdims=True) + eps)
    return (xs * r).reshape(xs.shape[0], -1) @ fn.double().numpy().T


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_mixes_matches_restatement(seed: int, dtype: torch.dtype) -> None:
    """hc_mixes = (flattened x . fn^T) * one rsqrt over all copies; a per-copy rsqrt differs."""
    gen = torch.Generator().manual_seed(seed)
    hc, dim = 4, 48
    # copies of very different size, so a per-copy normalisation is visibly different
    x = torch.randn(5, hc, dim, generator=gen) * torch.tensor([0.1, 1.0, 3.0, 0.5])[:, None]
    x = x.to(dtype)
    fn = torch.randn((2 + hc) * hc, hc * dim, generator=gen) * 0.1
    got = hc_mixes(x, fn, 1e-20)
    assert got.dtype == torch.float32
    want = restated_mixes(x, fn, 1e-20)
    np.testing.assert_allclose(got.double().numpy(), want, rtol=1e-5, atol=1e-5)
    wrong = per_copy_mixes(x, fn, 1e-20)
    assert np.abs(wrong - want).max() > 0.1
    assert np.abs(wrong - got.double().numpy()).max() > 0.1


def test_hc_mixes_eps_inside_rsqrt() -> None:
    """The eps sits inside the rsqrt: a zero stream with eps 1 gives mixes = 0, and a tiny
    stream is scaled by 1/sqrt(mean + eps)."""
    fn = torch.randn(24, 4 * 8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(hc_mixes(torch.zeros(2, 4, 8), fn, 1.0), torch.zeros(2, 24))
    x = torch.full((1, 4, 8), 1e-3)
    want = restated_mixes(x, fn, 1e-6)
    np.testing.assert_allclose(hc_mixes(x, fn, 1e-6).double().numpy(), want, rtol=1e-5)


def loop_pre(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Σ_j w_j x_j per token with an explicit loop in fp32, rounded once at the end."""
    tokens, hc, dim = x.shape
    out = torch.empty(tokens, dim, dtype=x.dtype)
    for t in range(tokens):
        acc = w[t, 0].float() * x[t, 0].float()
        for j in range(1, hc):
            acc = acc + w[t, j].float() * x[t, j].float()
        out[t] = acc.to(x.dtype)
    return out


@pytest.mark.parametrize("seed", range(3))
def test_hc_pre_bf16_single_rounding_bitwise(seed: int) -> None:
    """bf16 collapse is one fp32 sum in copy order rounded once; rounding each term to bf16
    first would differ on these inputs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(6, 4, 40, generator=gen).to(torch.bfloat16)
    w = torch.rand(6, 4, generator=gen) + 0.05
    got = hc_pre(x, w)
    assert got.dtype == torch.bfloat16
    want = loop_pre(x, w)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    twice = sum((w[:, j, None] * x[:, j].float()).to(torch.bfloat16).float() for j in range(4))
    assert not torch.equal(got, twice.to(torch.bfloat16))


def test_hc_pre_fp32_matches_loop_and_one_hot() -> None:
    """fp32 collapse equals the loop; the one-hot copy-0 weight (first_pre) returns copy 0
    bit for bit."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(5, 4, 32, generator=gen)
    w = torch.rand(5, 4, generator=gen)
    assert torch.equal(hc_pre(x, w), loop_pre(x, w))
    one_hot = first_pre(5, 4, "cpu")
    assert one_hot.dtype == torch.float32
    assert one_hot.tolist() == [[1.0, 0.0, 0.0, 0.0]] * 5
    x = x.masked_fill(x == 0, 1.0)  # nonzero values (a -0.0 would come back as +0.0)
    assert torch.equal(hc_pre(x, one_hot).view(torch.int32), x[:, 0].view(torch.int32))


def loop_post(y, res, post, comb, transposed: bool = False) -> torch.Tensor:
    """out_k = post_k y + Σ_j comb[j][k] res_j (or comb[k][j] when ``transposed``), fp32."""
    tokens, hc, dim = res.shape
    out = torch.empty(tokens, hc, dim, dtype=torch.float32)
    for t in range(tokens):
        for k in range(hc):
            acc = post[t, k] * y[t].float()
            for j in range(hc):
                c = comb[t, k, j] if transposed else comb[t, j, k]
                acc = acc + c * res[t, j].float()
            out[t, k] = acc
    return out


def test_hc_post_orientation_permutation() -> None:
    """comb[j][k] sends copy j into copy k: with a cyclic permutation comb and post 0, copy k
    receives copy k-1 exactly; the transposed reading would give copy k+1."""
    hc, dim = 4, 16
    gen = torch.Generator().manual_seed(3)
    res = torch.randn(2, hc, dim, generator=gen)
    comb = torch.zeros(2, hc, hc)
    for j in range(hc):
        comb[:, j, (j + 1) % hc] = 1.0
    got = hc_post(torch.randn(2, dim, generator=gen), res, torch.zeros(2, hc), comb)
    for k in range(hc):
        assert torch.equal(got[:, k], res[:, (k - 1) % hc])
        assert not torch.equal(got[:, k], res[:, (k + 1) % hc])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hc_post_matches_loop_with_asymmetric_comb(dtype: torch.dtype) -> None:
    """Expand with an asymmetric (permutation-leaning) comb equals the explicit loop, rounded
    once to the residual dtype; the transposed orientation is far away."""
    hc, dim, tokens = 4, 24, 3
    gen = torch.Generator().manual_seed(11)
    y = torch.randn(tokens, dim, generator=gen).to(dtype)
    res = torch.randn(tokens, hc, dim, generator=gen).to(dtype)
    post = torch.rand(tokens, hc, generator=gen) * 2
    perm = torch.zeros(hc, hc)
    for j in range(hc):
        perm[j, (j + 1) % hc] = 0.9
    comb = perm + torch.rand(tokens, hc, hc, generator=gen) * 0.1
    assert not torch.allclose(comb, comb.transpose(1, 2))
    got = hc_post(y, res, post, comb)
    assert got.dtype == dtype and got.shape == res.shape
    want = loop_post(y, res, post, comb)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        # one rounding of a nearly identical fp32 value: at most one bf16 ulp apart
        torch.testing.assert_close(got.float(), want, rtol=2**-7, atol=1e-6)
        exact = want.to(dtype)
        assert (got != exact).float().mean().item() < 0.02
    wrong = loop_post(y, res, post, comb, transposed=True)
    assert (got.float() - wrong).abs().max().item() > 0.5
