"""V4.1's MoE (``engramrt.models.deepseek_v41.moe``) against a restatement written token by token
from the
reference's semantics, in float64 where the reference has no rounding of its own: the experts
chosen (ties to the lower id), their weights, and the output with the SwiGLU clamps in force;
the image-span bias routes image tokens."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from engramrt.bundled import FLASH_CONFIG
from engramrt.models.deepseek_v41 import quant
from engramrt.models.deepseek_v41.config import v41_config
from engramrt.models.deepseek_v41.moe import V41MoE

E, K, DIM, INTER, LIMIT = 8, 3, 64, 96, 0.75


def small_moe(seed: int, image_bias: bool = False) -> V41MoE:
    flash = json.loads(FLASH_CONFIG.read_text())["text_config"]
    cfg = v41_config(
        dict(
            flash,
            n_routed_experts=E,
            num_experts_per_tok=K,
            moe_intermediate_size=INTER,
            hidden_size=DIM,
            q_lora_rank=64,
            swiglu_limit=LIMIT,
        )
    )
    moe = V41MoE(cfg, image_bias)
    g = torch.Generator().manual_seed(seed)
    moe.gate.weight.copy_(torch.randn(E, DIM, generator=g) * 0.2)
    moe.gate.bias.copy_(torch.randn(E, generator=g) * 0.1)
    if image_bias:
        moe.gate.bias_vl.copy_(torch.randn(E, generator=g) * 5)
    for lin in [m for m in moe.modules() if hasattr(m, "fp4")]:
        if lin.fp4:
            lin.weight.copy_(torch.randint(-128, 128, lin.weight.shape, generator=g))
            lin.scale.view(torch.uint8).copy_(torch.randint(121, 124, lin.scale.shape, generator=g))
        else:
            raw = torch.randint(0, 256, lin.weight.shape, generator=g, dtype=torch.uint8)
            raw = torch.where((raw & 0x78) >= 0x40, raw & 0xBF, raw)  # |w| <= 2: no NaN, modest
            lin.weight.copy_(raw.view(torch.float8_e4m3fn))
            lin.scale.view(torch.uint8).copy_(torch.randint(122, 125, lin.scale.shape, generator=g))
    return moe


def restated_route(moe: V41MoE, x: torch.Tensor, image=None) -> tuple[list, list]:
    ids, weights = [], []
    for t in range(len(x)):
        logits = moe.gate.weight.double() @ x[t].double()
        scores = torch.log1p(torch.exp(logits)).sqrt()
        bias = moe.gate.bias_vl if image is not None and image[t] else moe.gate.bias
        order = sorted(range(E), key=lambda e: (-(scores[e] + bias[e].double()).item(), e))[:K]
        w = scores[order]
        ids.append(order)
        weights.append((w / (w.sum() + 1e-20) * moe.route_scale).tolist())
    return ids, weights


def restated_expert(expert, x: torch.Tensor, weight: float | None) -> torch.Tensor:
    def lin(m, v):
        return quant.act_roundtrip(v).double() @ m.dequantized(torch.float32).double().T

    gate = lin(expert.w1, x).to(x.dtype).double().clamp(max=LIMIT)
    up = lin(expert.w3, x).to(x.dtype).double().clamp(-LIMIT, LIMIT)
    h = F.silu(gate) * up * (1.0 if weight is None else weight)
    return lin(expert.w2, h.to(x.dtype)).to(x.dtype)


def test_routing_and_output_equal_a_token_by_token_restatement() -> None:
    moe = small_moe(0)
    x = (torch.randn(24, DIM, generator=torch.Generator().manual_seed(1)) * 2).bfloat16()
    weights, ids = moe.route(x)
    want_ids, want_w = restated_route(moe, x)
    assert [sorted(r) for r in ids.tolist()] == [sorted(r) for r in want_ids]
    assert torch.allclose(weights.double(), torch.tensor(want_w, dtype=torch.float64), atol=1e-6)
    got = moe(x).double()
    clamped = 0
    for t in range(len(x)):
        y = torch.zeros(DIM, dtype=torch.float64)
        for e, w in sorted(zip(want_ids[t], want_w[t], strict=True)):  # ascending expert id
            y += restated_expert(moe.experts[e], x[t : t + 1], w)[0].double()
            clamped += int((moe.experts[e].w1(x[t : t + 1]).float() > LIMIT).sum())
        y += restated_expert(moe.shared_experts, x[t : t + 1], None)[0].double()
        scale = float(y.abs().max())
        assert scale > 0.2  # outputs of a size the tolerance cannot hide
        torch.testing.assert_close(got[t], y.bfloat16().double(), rtol=1e-2, atol=1e-2 * scale)
    assert clamped > 0  # the clamps were in force


def test_equal_scores_choose_the_lower_expert_ids() -> None:
    moe = small_moe(2)
    moe.gate.weight.zero_()
    moe.gate.bias.zero_()
    _, ids = moe.route(torch.randn(5, DIM).bfloat16())
    assert ids.tolist() == [list(range(K))] * 5


def test_image_tokens_route_with_their_own_bias() -> None:
    moe = small_moe(3, image_bias=True)
    x = torch.randn(10, DIM, generator=torch.Generator().manual_seed(4)).bfloat16()
    image = torch.tensor([i % 2 == 0 for i in range(10)])
    _, ids = moe.route(x, image)
    want_ids, _ = restated_route(moe, x, image)
    assert [sorted(r) for r in ids.tolist()] == [sorted(r) for r in want_ids]
    _, plain = moe.route(x)
    assert ids[1::2].tolist() == plain[1::2].tolist() and ids[0::2].tolist() != plain[0::2].tolist()


@pytest.mark.triton
@pytest.mark.parametrize("tokens", [2, 24])  # one-row expert tiles; 16-row ones
def test_grouped_kernels_equal_the_restatement(tokens: int) -> None:
    """The experts in grouped launches (``V41MoE._grouped``: routed rows sorted by expert, on
    device, no host sync; the SwiGLU and the combine fused, the shared expert after the routed
    ones) against the token-by-token restatement; every expert's tensors are views of the
    stacked ones afterwards (one copy in memory)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the interpreter's dot: fp32
    moe = small_moe(5).to(device)
    x = (torch.randn(tokens, DIM, generator=torch.Generator().manual_seed(6)) * 2).to(dtype)
    weights, ids = moe.route(x.to(device))
    got = moe._grouped(x.to(device), weights, ids).cpu().double()
    assert moe.experts[3].w3.weight.data_ptr() == moe.stack[0][3, INTER:].data_ptr()
    assert moe.shared_experts.w3.scale.data_ptr() == moe.stack[5][INTER // 32 :].data_ptr()
    want_ids, want_w = restated_route(moe.cpu(), x)
    for t in range(tokens):
        y = torch.zeros(DIM, dtype=torch.float64)
        for e, w in sorted(zip(want_ids[t], want_w[t], strict=True)):
            y += restated_expert(moe.experts[e], x[t : t + 1], w)[0].double()
        y += restated_expert(moe.shared_experts, x[t : t + 1], None)[0].double()
        scale = float(y.abs().max())
        torch.testing.assert_close(got[t], y, rtol=1e-2, atol=1e-2 * scale)


def test_looped_experts_add_each_tokens_outputs_in_ascending_expert_id() -> None:
    """The per-expert path (CPU, prefills) over one stable sort of the (token, expert) pairs is
    bitwise the plain loop it replaced (each expert over its tokens' rows, added to an fp32
    sum in ascending id), and passes the same gradients back (training runs it)."""
    moe = small_moe(3)
    x = torch.randn(29, DIM, generator=torch.Generator().manual_seed(4))
    weights, ids = moe.route(x)
    moe.requires_grad_(False)

    def plain(x: torch.Tensor) -> torch.Tensor:
        y = torch.zeros_like(x, dtype=torch.float32)
        for e in range(E):
            rows, slot = torch.where(ids == e)
            if len(rows):
                y = y.index_put(
                    (rows,), y[rows] + moe.experts[e](x[rows], weights[rows, slot, None])
                )
        return y

    xs = [x.clone().requires_grad_(True) for _ in range(2)]
    got, want = moe._looped(xs[0], weights, ids), plain(xs[1])
    assert torch.equal(got, want)
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(5))
    (got * g).sum().backward()
    (want * g).sum().backward()
    torch.testing.assert_close(xs[0].grad, xs[1].grad, rtol=1e-5, atol=1e-6)


def test_take_rows_is_indexing_forward_and_backward() -> None:
    """``take_rows`` (training's gathers) against ``x[idx]``: the same rows, and the gradient of
    each row the sum over its repeats."""
    from engramrt.model.layers import take_rows

    g = torch.Generator().manual_seed(6)
    x = torch.randn(7, 3, 4, generator=g, dtype=torch.float64)
    idx = torch.randint(0, 7, (5, 9), generator=g)
    a, b = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    out = take_rows(a, idx)
    assert torch.equal(out, b[idx])
    w = torch.randn(out.shape, generator=g, dtype=torch.float64)
    (out * w).sum().backward()
    (b[idx] * w).sum().backward()
    torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize(("expert", "kind"), [(5, "w3"), (2, "w2")])
def test_stacking_refuses_a_scale_the_gpu_kernel_cannot_decode(expert: int, kind: str) -> None:
    """The experts' scales are checked once a layer as they are stacked (not three syncs an
    expert): a block scale above the GPU kernel's largest is an error naming the projection
    and the expert, raised before any weight is paired; the largest it takes stacks."""
    moe = small_moe(4)
    lin = getattr(moe.experts[expert], kind)
    lin.scale.view(torch.uint8)[1, 0] = quant.FP4_KERNEL_MAX_SCALE + 1
    named = "w1/w3" if kind == "w3" else "w2"
    with pytest.raises(ValueError, match=rf"experts' {named}, expert {expert}: an FP4 block"):
        moe._stacked()
    assert not any(m.paired for e in moe.experts for m in (e.w1, e.w2, e.w3))
    lin.scale.view(torch.uint8)[1, 0] = quant.FP4_KERNEL_MAX_SCALE
    w13 = moe._stacked()[0]
    assert torch.equal(moe.experts[expert].w1.weight, w13[expert, :INTER])
