"""Engram gate and module against float64 oracles.

The gate oracle is the reference's gate written out with numpy in float64, one (token, copy) at a
time; the fp8 oracle decodes e4m3 / e8m0 bytes bit by bit. Neither calls the code under test.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from engramrt.config import EngramConfig
from engramrt.engram.module import Engram, engram_gate, gate_from_dot
from engramrt.engram.table import EngramTable
from engramrt.models.deepseek_v41 import quant
from tests.support.fp8_oracle import e4m3_value

CLAMP = 1e-6  # hard-coded gate clamp


# ----------------------------------------------------------------------------- oracles


def sigmoid64(z: float) -> float:
    return 1.0 / (1.0 + math.exp(-z))


def gate64(dot: float) -> float:
    """g = sigmoid(copysign(sqrt(max(|dot|, 1e-6)), dot)), in float64."""
    return sigmoid64(math.copysign(math.sqrt(max(abs(dot), CLAMP)), dot))


def f64(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).numpy()


def oracle_gate(x, kv, q_weight, k_weight, eps, dead=None) -> np.ndarray:
    """The gate in float64: out[t, j] = h + g(t, j) * value[t]; dead rows return x."""
    x, kv, q, k = f64(x), f64(kv), f64(q_weight), f64(k_weight)
    tokens, hc, dim = x.shape
    out = np.empty_like(x)
    for t in range(tokens):
        value = kv[t, hc * dim :]
        for j in range(hc):
            h = x[t, j]
            key = kv[t, j * dim : (j + 1) * dim]
            w = q[j] * k[j]
            rstd = 1.0 / math.sqrt(np.mean(h * h) + eps) / math.sqrt(np.mean(key * key) + eps)
            dot = float(np.sum(h * w * key)) * rstd * dim**-0.5
            out[t, j] = h + gate64(dot) * value
            if dead is not None and bool(dead[t]):
                out[t, j] = h
    return out


def random_fp8(rng: np.random.Generator, shape) -> np.ndarray:
    """Random e4m3 bytes without the NaN encodings."""
    w = rng.integers(0, 256, size=shape, dtype=np.uint8)
    nan = (w & 0x7F) == 0x7F
    w[nan] &= 0xF8
    return w


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[t.dtype])


def assert_bitwise(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    mism = (bits(got) != bits(want)).nonzero()
    assert mism.numel() == 0, f"{len(mism)} bit mismatches, first at {mism[0].tolist()}"


def random_gate_inputs(seed: int, dtype: torch.dtype, tokens=5, hc=4, dim=64, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(tokens, hc, dim, generator=g) * scale).to(dtype)
    kv = torch.randn(tokens, (hc + 1) * dim, generator=g)
    kv[:, : hc * dim] *= scale  # keys share the stream's scale; the value stays O(1)
    kv = kv.to(dtype)
    q = (1 + 0.5 * torch.randn(hc, dim, generator=g)).to(dtype)
    k = (1 + 0.5 * torch.randn(hc, dim, generator=g)).to(dtype)
    return x, kv, q, k


# ----------------------------------------------------------------------------- gate


def test_gate_matches_float64_oracle_fp32():
    """engram_gate on fp32 inputs == the float64 oracle within fp32 rounding."""
    x, kv, q, k = random_gate_inputs(0, torch.float32)
    got = engram_gate(x, kv, q, k, eps=1e-20)
    assert got.dtype == torch.float32 and got.shape == x.shape
    np.testing.assert_allclose(f64(got), oracle_gate(x, kv, q, k, 1e-20), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_gate_matches_float64_oracle_bf16(seed):
    """bf16 inputs: computed in fp32 and rounded once, so within one bf16 rounding of the oracle."""
    x, kv, q, k = random_gate_inputs(seed, torch.bfloat16)
    got = engram_gate(x, kv, q, k, eps=1e-20)
    assert got.dtype == torch.bfloat16
    want = oracle_gate(x, kv, q, k, 1e-20)
    # one rounding to bf16 is at most half an ulp (2**-9 relative); allow a whole ulp
    np.testing.assert_allclose(f64(got), want, rtol=2**-8, atol=1e-30)
    # and nearly every element is exactly the correctly rounded oracle value
    rounded = torch.from_numpy(want).to(torch.bfloat16)
    assert (bits(got) == bits(rounded)).float().mean() > 0.99


@pytest.mark.parametrize("scale", [1e-12, 1e-9])
def test_gate_uses_given_eps_on_tiny_norm_inputs(scale):
    """With eps=1e-20, tiny streams/keys match the eps=1e-20 oracle, not the 1e-6 one."""
    x, kv, q, k = random_gate_inputs(4, torch.float32, scale=scale)
    got = f64(engram_gate(x, kv, q, k, eps=1e-20))
    right = oracle_gate(x, kv, q, k, 1e-20)
    wrong = oracle_gate(x, kv, q, k, 1e-6)
    np.testing.assert_allclose(got, right, rtol=1e-5, atol=1e-7)
    assert np.abs(right - wrong).max() > 1e-3  # the inputs do tell the two eps values apart
    assert np.abs(got - wrong).max() > 1e-3
    # and the eps argument is honoured: with eps=1e-6 it follows the other oracle
    got_wrong = f64(engram_gate(x, kv, q, k, eps=1e-6))
    np.testing.assert_allclose(got_wrong, wrong, rtol=1e-5, atol=1e-7)


def test_gate_from_dot_signed_zero():
    """Copysign semantics, -0.0 -> sigmoid(-1e-3) and +0.0 -> sigmoid(+1e-3)."""
    neg = gate_from_dot(torch.tensor([-0.0]))
    pos = gate_from_dot(torch.tensor([0.0]))
    assert_bitwise(neg, torch.sigmoid(torch.tensor([-1e-3])))
    assert_bitwise(pos, torch.sigmoid(torch.tensor([1e-3])))
    assert neg.item() < 0.5 < pos.item()


def test_gate_from_dot_never_half_for_tiny_dots():
    """|dot| < 1e-6 (zeros, subnormals) clamps to sigmoid(+-1e-3), never 0.5."""
    g = torch.Generator().manual_seed(5)
    mags = torch.cat(
        [
            torch.rand(200, generator=g) * 1e-6,
            torch.rand(50, generator=g) * 1e-30,
            torch.tensor([0.0, 1e-45, 1e-40, 9.9e-7]),
        ]
    )
    signs = torch.where(torch.rand(mags.numel(), generator=g) < 0.5, -1.0, 1.0)
    dots = torch.cat([mags * signs, -mags, mags])  # includes -0.0 and +0.0
    gates = gate_from_dot(dots)
    assert (gates != 0.5).all()
    negative = torch.signbit(dots)
    want = torch.where(
        negative, gate_from_dot(torch.tensor(-0.0)), gate_from_dot(torch.tensor(0.0))
    )
    assert_bitwise(gates, want)
    assert ((gates < 0.5) == negative).all()


def test_gate_from_dot_large_values():
    """|dot| >= 1e-6: g == sigmoid(sign(dot) * sqrt(|dot|)) (float64 oracle, fp32 tolerance)."""
    g = torch.Generator().manual_seed(6)
    mags = torch.exp(torch.empty(400).uniform_(math.log(1e-6), math.log(1e4), generator=g))
    signs = torch.where(torch.rand(400, generator=g) < 0.5, -1.0, 1.0)
    dots = mags * signs
    got = gate_from_dot(dots)
    want = np.array([sigmoid64(math.copysign(math.sqrt(abs(d)), d)) for d in f64(dots)])
    np.testing.assert_allclose(f64(got), want, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gate_dead_rows_pass_through_bitwise(dtype):
    """Dead (image) rows come back bit for bit; other rows equal the unmasked gate."""
    x, kv, q, k = random_gate_inputs(7, dtype, tokens=6)
    x[1, 2, :5] = -0.0  # a stray +0.0 write would show in the bits
    x[3, 0, :3] = -0.0
    dead = torch.tensor([False, True, False, True, True, False])
    got = engram_gate(x, kv, q, k, eps=1e-20, dead=dead)
    plain = engram_gate(x, kv, q, k, eps=1e-20)
    assert_bitwise(got[dead], x[dead])
    assert_bitwise(got[~dead], plain[~dead])
    assert not torch.equal(bits(plain[dead]), bits(x[dead]))  # the mask did something


# ----------------------------------------------------------------------------- module


def make_config(
    layer_ids=(1,), hidden=64, head_dim=32, hc=4, n=3, heads=2, rows=300
) -> EngramConfig:
    return EngramConfig(
        layer_ids=tuple(layer_ids),
        num_embeddings=(rows,) * len(layer_ids),
        max_ngram_size=n,
        n_heads=heads,
        head_dim=head_dim,
        vocab_size=100,
        pad_token_id=2,
        compressed_vocab_size=50,
        hidden_size=hidden,
        hc_mult=hc,
        rms_norm_eps=1e-20,
    )


def random_module(cfg: EngramConfig, table, dtype: torch.dtype, seed: int):
    """An Engram with random wkv / q / k weights; returns the module and fp32 master weights."""
    g = torch.Generator().manual_seed(seed)
    mod = Engram(cfg, 0, table, dtype=dtype)
    out_f, in_f = (cfg.hc_mult + 1) * cfg.hidden_size, cfg.n_hash_cols * cfg.head_dim
    assert tuple(mod.wkv.weight.shape) == (out_f, in_f)
    w = (torch.randn(out_f, in_f, generator=g) / math.sqrt(in_f)).to(dtype)
    q = (1 + 0.3 * torch.randn(cfg.hc_mult, cfg.hidden_size, generator=g)).to(dtype)
    k = (1 + 0.3 * torch.randn(cfg.hc_mult, cfg.hidden_size, generator=g)).to(dtype)
    mod.load_wkv(w)
    with torch.no_grad():
        mod.q_weight.copy_(q)
        mod.k_weight.copy_(k)
    return mod, w, q, k


def gathered64(rows: np.ndarray, ids: torch.Tensor) -> np.ndarray:
    """E[t] = concat over columns c of rows[ids[t, c]], by Python indexing, in float64."""
    return np.stack(
        [np.concatenate([rows[int(i)] for i in ids[t]]) for t in range(ids.shape[0])]
    ).astype(np.float64)


def test_gated_engram_forward_fp32_matches_oracle():
    """forward(x, ids) == gather rows -> wkv matmul (float64) -> float64 gate, fp32 module."""
    cfg = make_config()
    g = torch.Generator().manual_seed(10)
    rows = torch.randn(cfg.num_embeddings[0], cfg.head_dim, generator=g)
    mod, w, q, k = random_module(cfg, EngramTable(rows), torch.float32, seed=11)
    ids = torch.randint(0, cfg.num_embeddings[0], (7, cfg.n_hash_cols), generator=g)
    x = torch.randn(7, cfg.hc_mult, cfg.hidden_size, generator=g)
    got = mod(x, ids)
    assert got.shape == x.shape and got.dtype == torch.float32
    kv = gathered64(f64(rows), ids) @ f64(w).T
    want = oracle_gate(x, torch.from_numpy(kv), q, k, cfg.rms_norm_eps)
    np.testing.assert_allclose(f64(got), want, rtol=1e-4, atol=1e-5)
    dead = torch.tensor([True, False, False, True, False, False, False])
    masked = mod(x, ids, dead)
    assert_bitwise(masked[dead], x[dead])
    assert_bitwise(masked[~dead], got[~dead])


def test_gated_engram_forward_bf16_fp8_table_matches_oracle():
    """bf16 module on an fp8 table: oracle decodes rows by bytes, rounds kv to bf16, then gates."""
    cfg = make_config(rows=120)
    rng = np.random.default_rng(12)
    wb = random_fp8(rng, (cfg.num_embeddings[0], cfg.head_dim))
    sb = rng.integers(120, 131, size=(cfg.num_embeddings[0], cfg.head_dim // 32), dtype=np.uint8)
    rows64 = np.array(
        [
            [math.ldexp(e4m3_value(int(wb[r, d])), int(sb[r, d // 32]) - 127) for d in range(32)]
            for r in range(len(wb))
        ]
    )
    table = EngramTable(torch.from_numpy(wb).view(torch.float8_e4m3fn), torch.from_numpy(sb))
    mod, w, q, k = random_module(cfg, table, torch.bfloat16, seed=13)
    g = torch.Generator().manual_seed(14)
    ids = torch.randint(0, cfg.num_embeddings[0], (6, cfg.n_hash_cols), generator=g)
    x = torch.randn(6, cfg.hc_mult, cfg.hidden_size, generator=g).to(torch.bfloat16)
    got = mod(x, ids)
    assert got.dtype == torch.bfloat16
    kv = torch.from_numpy(gathered64(rows64, ids) @ f64(w).T).to(torch.bfloat16)  # kv is bf16
    want = oracle_gate(x, kv, q, k, cfg.rms_norm_eps)
    np.testing.assert_allclose(f64(got), want, rtol=2**-7, atol=2**-7)


def test_gated_engram_forward_without_ids_or_table():
    """Missing hash ids or a missing table raise RuntimeError naming the global layer id."""
    cfg = make_config(layer_ids=(3, 7))
    table = EngramTable(torch.zeros(cfg.num_embeddings[1], cfg.head_dim))
    mod = Engram(cfg, 1, table, dtype=torch.float32)
    x = torch.zeros(2, cfg.hc_mult, cfg.hidden_size)
    with pytest.raises(RuntimeError, match=r"\blayer 7\b"):
        mod(x, None)
    bare = Engram(cfg, 1, None, dtype=torch.float32)
    ids = torch.zeros(2, cfg.n_hash_cols, dtype=torch.long)
    with pytest.raises(RuntimeError, match=r"\blayer 7\b.*table|table.*\blayer 7\b"):
        bare(x, ids)


# ----------------------------------------------------------------------------- load_wkv


def fp8_dequant(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return quant.dequant_fp8_weight(weight, scale, torch.bfloat16)


def block_oracle(wb: np.ndarray, sb: np.ndarray) -> torch.Tensor:
    """value[r, c] = e4m3(w[r, c]) * 2**(s[r//32, c//32] - 127), rounded once to bf16."""
    rows, cols = wb.shape
    vals = [
        [
            math.ldexp(e4m3_value(int(wb[r, c])), int(sb[r // 32, c // 32]) - 127)
            for c in range(cols)
        ]
        for r in range(rows)
    ]
    return torch.tensor(vals, dtype=torch.float64).to(torch.bfloat16)


# hidden 40 -> out 200 (7 row blocks, last partial); 4 cols x 20 -> in 80 (3 col blocks, partial)
WKV_CFG = make_config(hidden=40, head_dim=20, n=3, heads=2)
WKV_OUT, WKV_IN = (WKV_CFG.hc_mult + 1) * WKV_CFG.hidden_size, WKV_CFG.n_hash_cols * 20


def fp8_wkv(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    wb = random_fp8(rng, (WKV_OUT, WKV_IN))
    sb = rng.integers(100, 150, size=(-(-WKV_OUT // 32), -(-WKV_IN // 32)), dtype=np.uint8)
    sb[0, 0], sb[-1, -1] = 0, 1  # e8m0 edge bytes: 2**-127 and 2**-126
    return wb, sb


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale_as", ["e8m0", "uint8"])
def test_gated_engram_load_wkv_fp8_blocks_match_oracle(dtype, scale_as):
    """An FP8 wkv (as a checkpoint stores it, dequantised at load by
    ``quant.dequant_fp8_weight``) becomes e4m3 times one e8m0 scale per 32x32 block (ceil
    blocks), exactly."""
    wb, sb = fp8_wkv(20)
    assert sb.shape == (7, 3)
    scale = torch.from_numpy(sb)
    if scale_as == "e8m0":
        scale = scale.view(torch.float8_e8m0fnu)
    mod = Engram(WKV_CFG, 0, None, dtype=dtype)
    mod.load_wkv(fp8_dequant(torch.from_numpy(wb).view(torch.float8_e4m3fn), scale))
    want = block_oracle(wb, sb)
    assert (want[:32, :32] != 0).any()  # the scale-byte-0 block is 2**-127, not zero
    assert_bitwise(mod.wkv.weight.detach(), want.to(dtype))


def test_gated_engram_load_wkv_wrong_weight_shape():
    """A wkv weight of the wrong shape raises ValueError naming expected and got shapes."""
    mod = Engram(WKV_CFG, 0, None, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"expected \[200, 80\].*got \[80, 200\]"):
        mod.load_wkv(torch.zeros(WKV_IN, WKV_OUT))
    wb = np.zeros((WKV_OUT, WKV_IN + 32), dtype=np.uint8)
    sb = np.full((7, 4), 127, dtype=np.uint8)
    with pytest.raises(ValueError, match=r"expected \[200, 80\].*got \[200, 112\]"):
        mod.load_wkv(
            fp8_dequant(torch.from_numpy(wb).view(torch.float8_e4m3fn), torch.from_numpy(sb))
        )


@pytest.mark.parametrize("shape", [(7, 2), (6, 3), (200, 80), (3, 7)])
def test_gated_engram_load_wkv_wrong_scale_shape(shape):
    """A block scale that is not [ceil(out/32), ceil(in/32)] raises ValueError naming it."""
    wb, _ = fp8_wkv(21)
    with pytest.raises(ValueError, match=r"\[7, 3\]") as err:
        fp8_dequant(
            torch.from_numpy(wb).view(torch.float8_e4m3fn),
            torch.full(shape, 127, dtype=torch.uint8),
        )
    assert str(list(shape)) in str(err.value)
