"""SwiGLU's fused activation (Triton: interpreter on CPU, native with ``-m triton``) and its
torch path against a float64 re-statement; the stacked w1/w3 projection against separate ones."""

from __future__ import annotations

import pytest
import torch

from engramrt.model.layers import silu_mul
from engramrt.models.gqa.ffn import GQAMLP
from tests.support.kernel_env import kernel_device, triton_runs


def oracle(gate_up: torch.Tensor) -> torch.Tensor:
    a, b = gate_up.double().chunk(2, dim=-1)
    return a / (1 + torch.exp(-a)) * b


def _check(out: torch.Tensor, gate_up: torch.Tensor) -> None:
    ref = oracle(gate_up)
    tol = 1e-6 if gate_up.dtype == torch.float32 else 2**-7  # bf16: one ulp (interpreter truncates)
    assert out.dtype == gate_up.dtype and out.shape == ref.shape
    assert ((out.double().cpu() - ref).abs() <= tol * (1 + ref.abs())).all()


CASES = [
    (1, 8192, torch.bfloat16),
    (7, 96, torch.float32),
    (3, 1500, torch.float32),
    (33, 40, torch.bfloat16),
]


@pytest.mark.parametrize("tokens,inter,dtype", CASES)
def test_torch_silu_mul_equals_oracle(tokens, inter, dtype) -> None:
    g = torch.Generator().manual_seed(tokens + inter)
    gate_up = (torch.randn(tokens, 2 * inter, generator=g) * 4).to(dtype)
    _check(silu_mul(gate_up), gate_up)


@pytest.mark.triton
@pytest.mark.skipif(not triton_runs(), reason="needs Triton (GPU or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("tokens,inter,dtype", CASES)
def test_triton_silu_mul_equals_oracle(tokens, inter, dtype) -> None:
    from engramrt.kernels.swiglu import silu_mul as fused

    g = torch.Generator().manual_seed(tokens * inter)
    gate_up = (torch.randn(tokens, 2 * inter, generator=g) * 4).to(dtype)
    _check(fused(gate_up.to(kernel_device())), gate_up)


def test_stacked_projection_keeps_checkpoint_names_and_equals_separate_ones() -> None:
    """The state dict names w1/w3 (as checkpoints do) and loading them stacks w1 above w3: the
    MLP equals w2(silu(w1 x) * w3 x) with the two loaded separately."""
    g = torch.Generator().manual_seed(3)
    mlp = GQAMLP(16, 24, torch.float32)
    w1, w2, w3 = (torch.randn(s, generator=g) for s in [(24, 16), (16, 24), (24, 16)])
    mlp.load_state_dict({"w1.weight": w1, "w2.weight": w2, "w3.weight": w3})
    assert sorted(mlp.state_dict()) == ["w1.weight", "w2.weight", "w3.weight"]
    assert torch.equal(mlp.state_dict()["w3.weight"], w3)
    x = torch.randn(5, 16, generator=g)
    want = (torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T
    torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(RuntimeError, match="w3.weight"):
        mlp.load_state_dict({"w1.weight": w1, "w2.weight": w2})
