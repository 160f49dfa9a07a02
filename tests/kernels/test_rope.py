"""The rotary embedding: the Triton launch (interpreter on CPU, native with ``-m gpu``) and the
torch path both equal a float64 re-statement at arbitrary positions; the cos/sin rows are
computed once per forward and shared by every layer."""

from __future__ import annotations

import math

import pytest
import torch

from engramrt.model.layers import apply_rope, rope_tables
from tests.support.kernel_env import kernel_device, triton_runs


def oracle(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE written out per element pair, in float64 but for the angle, which the
    model defines in float32 (position x frequency, each rounded to float32; at position 70k the
    float32 angle is ~1e-2 rad from the exact one, the same in every engine that does this)."""
    tokens, heads, dim = x.shape
    half = dim // 2
    out = torch.empty(tokens, heads, dim, dtype=torch.float64)
    xd = x.double()
    for i in range(half):
        freq = torch.tensor(1.0 / theta ** (i / half), dtype=torch.float32)
        ang = (positions.float() * freq).double()
        c, s = ang.cos()[:, None], ang.sin()[:, None]
        out[:, :, i] = xd[:, :, i] * c - xd[:, :, i + half] * s
        out[:, :, i + half] = xd[:, :, i + half] * c + xd[:, :, i] * s
    return out


CASES = [
    (1, 24, 128, torch.bfloat16),
    (5, 3, 64, torch.float32),
    (17, 8, 48, torch.float32),
    (9, 2, 32, torch.bfloat16),
]


def _check(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, max_pos: int) -> None:
    """float32 rounding (bf16: one rounding of the result), plus the float32 frequency's few
    ulps of error, which grow with the position."""
    tol = (1e-6 if dtype == torch.float32 else 2**-8) + max_pos * 5e-7
    assert out.dtype == dtype and out.shape == ref.shape
    assert (out.double().cpu() - ref).abs().max().item() <= tol * (1 + ref.abs().max().item())


@pytest.mark.parametrize("tokens,heads,dim,dtype", CASES)
def test_torch_rope_equals_oracle(tokens, heads, dim, dtype) -> None:
    g = torch.Generator().manual_seed(tokens * heads + dim)
    x = torch.randn(tokens, heads, dim, generator=g).to(dtype)
    pos = torch.randint(0, 5000, (tokens,), generator=g)
    cos, sin = rope_tables(pos, dim, 10000.0)
    _check(apply_rope(x, cos, sin), oracle(x, pos, 10000.0), dtype, int(pos.max()))


@pytest.mark.triton
@pytest.mark.skipif(not triton_runs(), reason="needs Triton (GPU or TRITON_INTERPRET=1)")
@pytest.mark.parametrize(
    "tokens,heads,kv_heads,dim,dtype", [(t, h, h // 3 or 1, d, dt) for t, h, d, dt in CASES]
)
def test_triton_rope_write_equals_oracle_and_torch(tokens, heads, kv_heads, dim, dtype) -> None:
    """One launch rotates q and k of a stacked [q | k | v] row and writes k and v into the
    token's cache row: q and the written k equal the oracle (and the torch path), v lands
    unchanged, and padded rows (slot -1) and rows no token owns stay as they were."""
    from engramrt.kernels.rope import rope_write_kv

    dev = kernel_device()
    g = torch.Generator().manual_seed(7 * tokens + heads)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
    pos = torch.randint(0, 70000, (tokens,), generator=g)
    rows = 2 * tokens + 3
    slots = torch.randperm(rows, generator=g)[:tokens]
    slots[1::3] = -1  # padded rows
    k_cache = torch.randn(rows, kv_heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(rows, kv_heads, dim, generator=g).to(dtype)
    kd, vd = k_cache.to(dev), v_cache.to(dev)
    cos, sin = rope_tables(pos.to(dev), dim, 1e6)
    q = rope_write_kv(qkv.to(dev), cos, sin, kd, vd, slots.to(dev), heads).cpu()
    q_in, k_in, v_in = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    q_in, k_in = q_in.view(tokens, heads, dim), k_in.view(tokens, kv_heads, dim)
    k_ref = oracle(k_in, pos, 1e6)
    _check(q, oracle(q_in, pos, 1e6), dtype, int(pos.max()))
    ref = apply_rope(q_in, *(t.cpu() for t in (cos, sin)))  # the torch path on the CPU
    diff = (q.float() - ref.float()).abs()
    ulp = 1e-6 if dtype == torch.float32 else 2**-7
    assert diff.max().item() <= ulp * (1 + ref.float().abs().max())
    real = slots >= 0
    _check(kd.cpu()[slots[real]], k_ref[real], dtype, int(pos.max()))
    assert torch.equal(vd.cpu()[slots[real]], v_in.view(tokens, kv_heads, dim)[real])
    untouched = torch.ones(rows, dtype=torch.bool)
    untouched[slots[real]] = False
    assert torch.equal(kd.cpu()[untouched], k_cache[untouched])
    assert torch.equal(vd.cpu()[untouched], v_cache[untouched])
    assert not math.isnan(q.float().sum().item())


def test_tables_computed_once_per_forward(monkeypatch) -> None:
    """Every layer reads the same cos/sin rows in one forward; a second forward recomputes them
    (a stale table would rotate by the previous step's positions)."""
    from engramrt.model import context as context_mod
    from engramrt.model import layers

    calls = []

    def counting(positions, head_dim, theta):
        calls.append(positions.clone())
        return layers.rope_tables(positions, head_dim, theta)

    monkeypatch.setattr(context_mod, "rope_tables", counting)
    from engramrt.bundled import GQA_MODEL_DIR
    from engramrt.runner.batch import StepBatch
    from engramrt.runner.stage import StageRunner

    runner = StageRunner.load(GQA_MODEL_DIR, dtype="float32")
    runner.compute(StepBatch([5, 6, 7], [0], [3], [0], new_blocks=[[0]]))
    runner.compute(StepBatch([8], [0], [1], [3], new_blocks=[[]], block_starts=[1]))
    assert [c.tolist() for c in calls] == [[0, 1, 2], [3]]
