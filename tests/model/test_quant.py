"""V4.1's rounding points (``engramrt.models.deepseek_v41.quant``) against an independent
restatement: every
format's value set built from its bit fields, nearest-even rounding done in exact rational
arithmetic (``fractions.Fraction``), fp32 steps done by numpy's float32. Inputs cover every
representable value, every midpoint and its fp32 neighbours, +-0, subnormals and saturation;
the block round trips are checked at every scale byte they can produce."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import numpy as np
import pytest
import torch

from engramrt.models.deepseek_v41 import quant

# --- the formats, from their bit fields ---------------------------------------------------------


def e4m3_value(byte: int) -> Fraction | None:
    """E4M3 (fn): bias 7, no infinities, S.1111.111 is NaN."""
    s, e, m = byte >> 7, (byte >> 3) & 0xF, byte & 7
    if e == 15 and m == 7:
        return None
    v = Fraction(2) ** (e - 7) * (1 + Fraction(m, 8)) if e else Fraction(2) ** -6 * Fraction(m, 8)
    return -v if s else v


def e2m1_value(code: int) -> Fraction:
    """E2M1: bias 1, bit 3 the sign."""
    s, e, m = code >> 3, (code >> 1) & 3, code & 1
    v = Fraction(2) ** (e - 1) * (1 + Fraction(m, 2)) if e else Fraction(m, 2)
    return -v if s else v


def nearest_even(x: Fraction, table: dict[int, Fraction], top: Fraction) -> tuple[int, Fraction]:
    """Round to the nearest of ``table``'s non-negative values (code -> value), ties to the even
    code, saturating at ``top``; the sign applied after (so -0 stays -0 by the caller)."""
    mag = min(abs(x), top)
    best = min(table.items(), key=lambda kv: (abs(kv[1] - mag), kv[0] & 1))
    return best


E4M3_POS = {b: e4m3_value(b) for b in range(128) if e4m3_value(b) is not None}
E2M1_POS = {c: e2m1_value(c) for c in range(8)}


def fr(x) -> Fraction:
    return Fraction(float(x))


def f32(x) -> np.float32:
    with np.errstate(over="ignore"):
        return np.float32(x)


def oracle_e4m3(x: float) -> float:
    code, v = nearest_even(fr(x), E4M3_POS, Fraction(448))
    return math.copysign(float(v), x)


def oracle_e2m1(x: float) -> float:
    _, v = nearest_even(fr(x), E2M1_POS, Fraction(6))
    return math.copysign(float(v), x)


def ceil_pow2(p: Fraction) -> Fraction:
    k = math.floor(math.log2(p)) - 1
    while Fraction(2) ** k < p:
        k += 1
    return Fraction(2) ** k


def oracle_pow2_scale(amax: float, inv: float) -> float:
    return float(ceil_pow2(fr(f32(amax) * f32(inv))))


def around(values) -> list[float]:
    """Each value, the midpoints between neighbours, and each one's fp32 neighbours."""
    vs = sorted({float(v) for v in values})
    pts = set(vs) | {(a + b) / 2 for a, b in zip(vs, vs[1:], strict=False)}
    out = set()
    for p in pts:
        p32 = f32(p)
        out |= {
            float(p32),
            float(np.nextafter(p32, f32(np.inf))),
            float(np.nextafter(p32, f32(-np.inf))),
        }
    return sorted(out)


# --- single values ------------------------------------------------------------------------------


def test_e4m3_cast_rounds_to_nearest_even_and_saturates() -> None:
    pos = around(E4M3_POS.values()) + [464.0, 480.0, 1e6, 3e38, 2.0**-10, 2.0**-12, 2.0**-149]
    xs = sorted({*pos, *(-p for p in pos)}) + [0.0, -0.0]
    got = quant.to_e4m3(torch.tensor(xs, dtype=torch.float32)).float().tolist()
    for x, g in zip(xs, got, strict=True):
        want = oracle_e4m3(x)
        assert g == want and math.copysign(1, g) == math.copysign(1, want), (x, g, want)


def test_every_e4m3_byte_is_what_torch_reads() -> None:
    raw = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    for b, v in enumerate(raw):
        want = e4m3_value(b)
        assert math.isnan(v) if want is None else v == float(want), (b, v, want)


def test_every_e8m0_byte() -> None:
    got = quant.decode_e8m0(torch.arange(256, dtype=torch.uint8)).tolist()
    for b, v in enumerate(got):
        assert math.isnan(v) if b == 255 else fr(v) == Fraction(2) ** (b - 127), (b, v)


def test_every_e2m1_code_and_rounding() -> None:
    assert quant.decode_e2m1(torch.arange(16)).tolist() == [float(e2m1_value(c)) for c in range(16)]
    pos = around(E2M1_POS.values()) + [6.0]
    xs = sorted({*(p for p in pos if p <= 6), *(-p for p in pos if p <= 6)}) + [0.0, -0.0]
    codes = quant.e2m1_codes(torch.tensor(xs, dtype=torch.float32))
    for x, c in zip(xs, codes.tolist(), strict=True):
        want = oracle_e2m1(x)
        assert float(e2m1_value(c)) == want and (c >> 3) == (math.copysign(1, x) < 0), (x, c)


def test_packing_puts_the_even_element_in_the_low_nibble() -> None:
    rng = random.Random(0)
    raw = [rng.randrange(256) for _ in range(64)]
    got = quant.unpack_e2m1(torch.tensor(raw, dtype=torch.uint8).view(torch.int8)).tolist()
    want = [float(e2m1_value(c)) for b in raw for c in (b & 0xF, b >> 4)]
    assert got == want
    codes = torch.tensor([c for b in raw for c in (b & 0xF, b >> 4)], dtype=torch.uint8)
    assert quant.pack_e2m1(codes).view(torch.uint8).tolist() == raw


def amax_giving(product: float, inv: float) -> float | None:
    """An fp32 amax whose fp32 product with fp32(inv) is exactly ``product``, if one exists
    near product / inv."""
    a = f32(product / inv)
    if not np.isfinite(a):
        return None
    for _ in range(8):
        got = f32(a) * f32(inv)
        if got == f32(product):
            return float(a)
        a = np.nextafter(a, f32(np.inf) if got < f32(product) else f32(-np.inf))
    return None


def test_power_of_two_scale_is_the_ceiling_of_the_fp32_product() -> None:
    """Products on a power of two, one ulp either side of it, and in between: the mantissa
    test must see even the last bit."""
    for inv in (1 / 448, 1 / 6):
        keep = []
        for e in range(-125, 120):
            for m in (1.0, 1.0 + 2.0**-23, 1.0 + 2.0**-22, 1.5, 2.0 - 2.0**-23):
                a = amax_giving(m * 2.0**e, inv)
                if a is not None:
                    keep.append(a)
        products = np.array([f32(a) * f32(inv) for a in keep], dtype=np.float32)
        assert ((products.view(np.int32) & 0x7FFFFF) == 1).sum() > 100  # the last bit alone
        got = quant.pow2_scale(torch.tensor(keep, dtype=torch.float32), torch.tensor(inv))
        for a, g in zip(keep, got.tolist(), strict=True):
            assert g == oracle_pow2_scale(a, inv), (a, inv, g)


# --- the block round trips ----------------------------------------------------------------------


def _blocks(rng: random.Random, block: int, amaxes: list[float], dtype) -> torch.Tensor:
    """One block per amax: random values below it, the amax itself at a random place and
    sign, some zeros, -0 and values a few ulps from it."""
    rows = []
    for a in amaxes:
        row = [rng.uniform(-a, a) * rng.choice([1, 1, 1, 0, 2.0**-8]) for _ in range(block)]
        row[rng.randrange(block)] = a * rng.choice([1, -1])
        row[rng.randrange(block)] = -0.0
        rows.append(row)
    return torch.tensor(rows, dtype=torch.float32).to(dtype)


def _oracle_act(row: list[float], out_dtype) -> list[float]:
    amax = max(max(abs(v) for v in row), 1e-4)
    s = fr(oracle_pow2_scale(amax, 1 / 448))
    q = [oracle_e4m3(float(fr(v) / s)) for v in row]  # dividing by a power of two is exact
    return [torch.tensor(float(fr(v) * s)).to(out_dtype).item() if v else v for v in q]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_act_roundtrip_at_every_scale(dtype) -> None:
    rng = random.Random(1)
    # amax at every power of two the scale can take (subnormal bf16 ones too), at 448 times one
    # (the product of amax and fp32(1/448) may round onto a power of two) and at the floor
    amaxes = [2.0**e * m for e in range(-133, 120) for m in (1.0, 1.3)] + [448.0 * 2.0**-5, 0.0]
    amaxes = [a for a in amaxes if torch.tensor(a).to(dtype).item() == a or a == 0]
    x = _blocks(rng, 32, amaxes, dtype)
    got = quant.act_roundtrip(x)
    assert got.dtype == dtype
    for row, g in zip(x.float().tolist(), got.float().tolist(), strict=True):
        want = _oracle_act(row, dtype)
        assert g == want, (row, g, want)


def _oracle_fp4(row: list[float], kind: str) -> list[float]:
    amax = max(abs(v) for v in row)
    if kind == quant.E4M3_SCALE:
        s = oracle_e4m3(float(f32(max(amax, 6 * 2.0**-9)) / f32(6)))
    else:
        s = oracle_pow2_scale(max(amax, 6 * 2.0**-126), 1 / 6)
    out = []
    for v in row:
        w = min(max(float(f32(v) / f32(s)), -6.0), 6.0)  # fp32 division, as the kernel
        out.append(math.copysign(float(fr(oracle_e2m1(w)) * fr(s)), oracle_e2m1(w)))
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fp4_roundtrip_with_e4m3_scales_at_every_scale_byte(dtype) -> None:
    rng = random.Random(2)
    # amax = 6 x every positive E4M3 value: each scale byte; 6 x every midpoint between two
    # (amax / 6 must be a true division: a product with fp32(1/6) would not tie); the all-zero
    # block's floor
    scales = sorted(float(v) for v in E4M3_POS.values() if v > 0)
    mids = [(a + b) / 2 for a, b in zip(scales, scales[1:], strict=False)]
    amaxes = [6 * v for v in scales + mids] + [0.0, 6 * 2.0**-10]
    # and the amaxes near those where dividing by 6 and multiplying by fp32(1/6) pick
    # different scales: the reference divides
    split = []
    for m in mids:
        a = f32(6 * m)
        for _ in range(40):
            a = np.nextafter(a, f32(0))
            by_div = oracle_e4m3(float(f32(a) / f32(6)))
            if by_div != oracle_e4m3(float(f32(a) * f32(1 / 6))):
                split.append(float(a))
    assert len(split) > 10  # (none is a bf16 value: from bf16 inputs both ways agree)
    amaxes += split
    amaxes = [a for a in amaxes if torch.tensor(a).to(dtype).item() == a]
    x = _blocks(rng, 16, amaxes, dtype)
    got = quant.fp4_roundtrip(x, quant.E4M3_SCALE).float().tolist()
    for row, g in zip(x.float().tolist(), got, strict=True):
        want = [torch.tensor(w).to(dtype).item() for w in _oracle_fp4(row, quant.E4M3_SCALE)]
        assert g == want, (row, g, want)


def test_fp4_roundtrip_with_power_of_two_scales_at_every_exponent() -> None:
    rng = random.Random(3)
    amaxes = [6 * 2.0**e * m for e in range(-128, 120) for m in (1.0, 1.2)] + [0.0]
    amaxes = [a for a in amaxes if torch.tensor(a).bfloat16().item() == a]
    x = _blocks(rng, 32, amaxes, torch.bfloat16)
    got = quant.fp4_roundtrip(x, quant.POW2_SCALE).float().tolist()
    for row, g in zip(x.float().tolist(), got, strict=True):
        want = [torch.tensor(w).bfloat16().item() for w in _oracle_fp4(row, quant.POW2_SCALE)]
        assert g == want, (row, g, want)


def test_blocks_must_divide_the_last_dim() -> None:
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.act_quant(torch.zeros(2, 48))
    with pytest.raises(ValueError, match="unknown FP4 scale kind"):
        quant.fp4_quant(torch.zeros(32), "nvfp4")


# --- weights as stored ----------------------------------------------------------------------------


def _finite_e4m3_bytes(g: torch.Generator, shape) -> torch.Tensor:
    raw = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    return torch.where((raw & 0x7F) == 0x7F, raw & 0xF0, raw)  # no NaN bytes


def test_fp8_weights_dequantise_block_by_block() -> None:
    g = torch.Generator().manual_seed(4)
    out_f, in_f = 40, 72  # neither a multiple of 32: the last blocks are partial
    raw = _finite_e4m3_bytes(g, (out_f, in_f))
    scale = torch.randint(120, 135, (2, 3), generator=g, dtype=torch.uint8)
    got = quant.dequant_fp8_weight(raw.view(torch.float8_e4m3fn), scale, torch.bfloat16)
    for i in range(out_f):
        for j in range(in_f):
            want = e4m3_value(int(raw[i, j])) * Fraction(2) ** (int(scale[i // 32, j // 32]) - 127)
            assert fr(got[i, j].item()) == want, (i, j)
    with pytest.raises(ValueError, match=r"needs scales \[2, 3\]"):
        quant.dequant_fp8_weight(raw.view(torch.float8_e4m3fn), scale[:1], torch.bfloat16)


def test_fp4_weights_dequantise_with_the_even_element_low() -> None:
    g = torch.Generator().manual_seed(5)
    raw = torch.randint(0, 256, (6, 32), generator=g, dtype=torch.uint8)  # [out, in / 2]
    scale = torch.randint(118, 136, (6, 2), generator=g, dtype=torch.uint8)
    got = quant.dequant_fp4_weight(raw.view(torch.int8), scale, torch.bfloat16)
    for i in range(6):
        for j in range(64):
            byte = int(raw[i, j // 2])
            code = byte & 0xF if j % 2 == 0 else byte >> 4
            want = e2m1_value(code) * Fraction(2) ** (int(scale[i, j // 32]) - 127)
            assert fr(got[i, j].item()) == want, (i, j)


@pytest.mark.parametrize("k", [32, 64, 96, 160, 2304])
def test_paired_fp4_bytes_hold_a_block_and_the_next(k: int) -> None:
    """``pair_fp4`` against a restatement: in each 64-element group byte j holds element j low
    and j + 32 high; a last group of 32 (odd blocks) holds j and j + 16. ``unpair_fp4`` gives
    the checkpoint's bytes back, and the decoded weight is the same either way."""
    g = torch.Generator().manual_seed(k)
    raw = torch.randint(0, 256, (3, 2, k // 2), generator=g, dtype=torch.uint8)
    elements = [[(int(b) & 0xF, int(b) >> 4) for b in row] for row in raw.flatten(0, 1)]
    elements = [[c for pair in row for c in pair] for row in elements]  # even element low
    paired = quant.pair_fp4(raw.view(torch.int8)).view(torch.uint8).flatten(0, 1)
    for row, codes in zip(paired.tolist(), elements, strict=True):
        for j, byte in enumerate(row):
            start = j // 32 * 64
            width = 64 if start + 64 <= k else 32
            at = start + j % (width // 2)
            assert (byte & 0xF, byte >> 4) == (codes[at], codes[at + width // 2]), (k, j)
    assert torch.equal(quant.unpair_fp4(quant.pair_fp4(raw.view(torch.int8))), raw.view(torch.int8))


def test_a_paired_layer_decodes_saves_and_loads_as_stored() -> None:
    """A paired ``StoredLinear`` dequantises as before, saves the checkpoint's bytes, and pairs
    a checkpoint's bytes it loads."""
    g = torch.Generator().manual_seed(3)
    layer = quant.StoredLinear(40, 96, fp4=True)
    layer.weight, layer.scale = quant.fp4_weight(torch.randn(40, 96, generator=g))
    stored, want = layer.weight.clone(), layer.dequantized(torch.float32)
    layer.pair()
    assert layer.paired and not torch.equal(layer.weight, stored)
    assert torch.equal(layer.dequantized(torch.float32), want)
    assert torch.equal(layer.state_dict()["weight"], stored)
    other = quant.StoredLinear(40, 96, fp4=True)
    other.pair()
    other.load_state_dict(layer.state_dict())
    assert torch.equal(other.weight, layer.weight)


def test_a_scale_the_gpu_kernel_cannot_decode_is_refused_at_pairing() -> None:
    """The GPU kernel decodes FP4 blocks with scales up to ``2**1`` (a bf16 ``2**(s - 1)``):
    a block of values up to 12 pairs, one with a larger scale (values above 12) is an error
    naming the scale before anything is paired."""
    layer = quant.StoredLinear(32, 64, fp4=True)
    layer.weight, layer.scale = quant.fp4_weight(torch.full((32, 64), 12.0))
    assert int(layer.scale.view(torch.uint8).max()) == quant.FP4_KERNEL_MAX_SCALE
    layer.pair()
    big = quant.StoredLinear(32, 64, fp4=True)
    big.weight, big.scale = quant.fp4_weight(torch.full((32, 64), 12.5))
    with pytest.raises(ValueError, match=r"scale of 2\*\*2 is above"):
        big.pair()
    assert not big.paired


def test_weight_quantisers_write_what_a_checkpoint_writer_would() -> None:
    """``fp8_weight`` / ``fp4_weight`` (the preset writer's) against a Fraction restatement:
    per block the smallest power of two at or above amax / 448 (/ 6), each value rounded to the
    nearest even E4M3 (E2M1) code of value / scale; partial blocks included."""
    g = torch.Generator().manual_seed(9)
    w = torch.randn(40, 72, generator=g) * torch.logspace(-3, 2, 72)  # blocks of every size
    values, scale = quant.fp8_weight(w)
    assert values.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu
    for bi in range(2):
        for bj in range(3):
            block = w[bi * 32 : bi * 32 + 32, bj * 32 : bj * 32 + 32]
            want = ceil_pow2(fr(block.abs().max()) / 448)
            assert Fraction(2) ** (int(scale.view(torch.uint8)[bi, bj]) - 127) == want
            for x, got in zip(
                block.flatten().tolist(),
                values[bi * 32 : bi * 32 + 32, bj * 32 : bj * 32 + 32].flatten().tolist(),
                strict=True,
            ):
                assert got == oracle_e4m3(float(fr(x) / want)), (bi, bj, x)
    packed, scale = quant.fp4_weight(w[:, :64])
    codes = quant.unpack_e2m1(packed)
    for i in range(40):
        for b in range(2):
            block = w[i, b * 32 : b * 32 + 32]
            want = ceil_pow2(fr(block.abs().max()) / 6)
            assert Fraction(2) ** (int(scale.view(torch.uint8)[i, b]) - 127) == want
            for j, x in enumerate(block.tolist()):
                assert codes[i, b * 32 + j].item() == oracle_e2m1(float(fr(x) / want)), (i, j)


def test_quantized_linear_matches_the_references_block_accumulation() -> None:
    """The reference sums each 32-wide K block of raw E4M3 x E4M3 products in fp32, scales it
    by both blocks' scales and accumulates in K order; dequantising first gives the same
    products in another order: at most one bf16 ulp apart, and mostly equal."""
    g = torch.Generator().manual_seed(6)
    m, out_f, in_f = 8, 64, 256
    x = (torch.randn(m, in_f, generator=g) * 3).bfloat16()
    raw = _finite_e4m3_bytes(g, (out_f, in_f)).view(torch.float8_e4m3fn)
    scale = torch.randint(112, 122, (2, 8), generator=g, dtype=torch.uint8)
    got = quant.quantized_linear(x, quant.dequant_fp8_weight(raw, scale, torch.bfloat16))
    q, a_s = quant.act_quant(x)
    w_s = torch.tensor([[2.0 ** (int(s) - 127) for s in row] for row in scale])
    acc = torch.zeros(m, out_f)
    for k in range(in_f // 32):
        ks = slice(32 * k, 32 * (k + 1))
        part = q[:, ks].float() @ raw[:, ks].float().T
        acc += part * a_s[:, k : k + 1] * w_s[:, k].repeat_interleave(32)[None, :out_f]
    want = acc.bfloat16()
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()
    assert int(ulps.max()) <= 1 and float((ulps == 0).float().mean()) > 0.9
