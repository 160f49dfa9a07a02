"""V4.1's MoE routing kernels (``engramrt.kernels.moe_routing``) against the torch path they
replace on CUDA: ``route`` against ``route_logits`` (``V41MoE.route`` after the gate's logits),
``expert_rows`` against ``ExpertPairs``' sort and ``group_tiles``.

Ties are made on purpose: duplicated logits and biases, equal biased scores from different raw
scores (``sqrt`` of exact squares above softplus's threshold, so both sides compute them
exactly), rows of ``-inf`` logits (scores 0, chosen by bias alone), NaN logits of both signs
(torch's sort puts NaN first), ids repeated within a token, every pair on one expert.

Tolerances: the expert ids and all of ``expert_rows`` are compared exactly everywhere. The
weights are compared bitwise on CUDA, where the kernel computes softplus with libdevice's
``expf``/``log1pf`` (torch's CUDA functions), a correctly rounded sqrt and division, and adds the
weights in the order of torch's CUDA reduction. Under the interpreter the kernel has no libdevice
(numpy's ``exp`` and a ``log1p`` built from ``log``) and torch's CPU kernels differ again, so
scores agree to a few fp32 ulps there: weights to ``rtol=2**-20``.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from engramrt.kernels import moe_routing
from engramrt.kernels.moe_routing import expert_rows, route
from engramrt.kernels.stored_linear import group_tile_rows, group_tiles
from engramrt.models.deepseek_v41.moe import ExpertPairs, route_logits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def tied_logits(g: torch.Generator, tokens: int, experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits [tokens, experts], bias [experts]): random rows (scale 3, some past softplus's
    threshold of 20 and below exp's underflow) after six rows of deliberate ties."""
    logits = torch.randn(tokens, experts, generator=g) * 3
    logits[:, ::5] *= 12
    bias = torch.randn(experts, generator=g) * 0.1
    bias[1] = bias[5] = bias[6]  # equal biases: equal logits there tie
    bias[3], bias[4] = 0.5, -0.5
    logits[0] = 0.25  # every score equal; ties broken by bias, then by id
    logits[1, [1, 5, 6]] = 9.0  # a three-way tie at the top
    logits[2, [3, 4]] = torch.tensor([36.0, 49.0])  # 6 + 0.5 == 7 - 0.5 exactly
    logits[3] = -math.inf  # scores 0: the bias alone orders them, tied at bias[1] = bias[5]
    logits[4, [2, 7]] = torch.tensor([math.nan, -math.nan])  # NaNs of both signs sort first
    logits[5, : experts // 2] = logits[5, experts // 2 : 2 * (experts // 2)]  # duplicated halves
    return logits, bias


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns, any NaN equal to any NaN."""
    same = (a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())
    return bool(same.all())


def check_route(logits, bias, k, bias_vl=None, image=None) -> None:
    on = [t if t is None else t.to(DEVICE) for t in (logits, bias, bias_vl, image)]
    got_w, got_ids = route(on[0], on[1], k, 1.5, on[2], on[3])
    want_w, want_ids = route_logits(on[0], on[1], k, 1.5, on[2], on[3])
    assert got_ids.dtype == want_ids.dtype and got_w.dtype == want_w.dtype == torch.float32
    assert torch.equal(got_ids, want_ids)
    if DEVICE == "cuda":
        assert same_bits(got_w, want_w)
    else:
        torch.testing.assert_close(got_w, want_w, rtol=2**-20, atol=0, equal_nan=True)


@pytest.mark.triton
@pytest.mark.parametrize(("experts", "k"), [(16, 6), (8, 3), (16, 1), (12, 8), (16, 2)])
def test_route_is_the_torch_path(experts: int, k: int) -> None:
    g = torch.Generator().manual_seed(experts * 10 + k)
    logits, bias = tied_logits(g, 14, experts)
    check_route(logits, bias, k)
    # image tokens take bias_vl (with its own ties); without image flags, or without a
    # bias_vl, every token takes the plain bias
    bias_vl = torch.randn(experts, generator=g).round()
    image = torch.rand(len(logits), generator=g) < 0.5
    image[:4] = torch.tensor([True, False, True, True])
    check_route(logits, bias, k, bias_vl, image)
    check_route(logits, bias, k, bias_vl, None)
    check_route(logits, bias, k, None, image)


def test_route_refuses_what_it_cannot_route() -> None:
    with pytest.raises(ValueError, match="fp32 logits"):
        route(torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(8), 2, 1.0)
    with pytest.raises(ValueError, match="k <= min"):
        route(torch.zeros(2, 8), torch.zeros(8), 9, 1.0)
    with pytest.raises(ValueError, match="k <= min"):
        route(torch.zeros(2, 64), torch.zeros(64), 33, 1.0)


def check_rows(ids: torch.Tensor, experts: int, tile_rows: int | None) -> None:
    want = ExpertPairs(ids, experts, tile_rows)  # on the CPU: torch's sort
    got = expert_rows(ids.to(DEVICE), experts, tile_rows)
    assert torch.equal(got.order.cpu(), want.order)
    assert torch.equal(got.counts.cpu(), want.counts)
    assert torch.equal(got.by_id.cpu(), want.by_id)
    if tile_rows is None:
        assert got.tiles is None
    else:
        assert torch.equal(got.tiles.cpu(), want.tiles)
        assert torch.equal(want.tiles, group_tiles(want.counts, ids.numel(), tile_rows))


@pytest.mark.triton
@pytest.mark.parametrize(
    ("experts", "tokens", "k"), [(16, 1, 6), (16, 64, 6), (16, 5, 1), (8, 0, 3), (5, 9, 3)]
)
def test_expert_rows_are_the_sorted_pairs(experts: int, tokens: int, k: int, monkeypatch) -> None:
    """Distinct experts a token (as routing gives them) and, in a second draw, ids repeated
    within tokens; tiles of the grouped launch's size, of 1 and 16 rows, and none."""
    monkeypatch.setattr(moe_routing, "BLOCK", 128)  # 384 pairs span several steps
    g = torch.Generator().manual_seed(experts + tokens + k)
    distinct = torch.rand(tokens, experts, generator=g).argsort(dim=1)[:, :k]
    repeats = torch.randint(0, experts, (tokens, k), generator=g)
    for ids in (distinct, repeats):
        for tile_rows in dict.fromkeys([group_tile_rows(tokens * k, experts), 1, 16, None]):
            check_rows(ids, experts, tile_rows)


@pytest.mark.triton
@pytest.mark.parametrize("tokens", [1, 64])
def test_expert_rows_of_flash_sized_experts(tokens: int) -> None:
    """256 experts (a program each: the interpreter's slowest case, so one draw), most of
    them without rows."""
    g = torch.Generator().manual_seed(tokens)
    ids = torch.rand(tokens, 256, generator=g).argsort(dim=1)[:, :6]
    check_rows(ids, 256, group_tile_rows(tokens * 6, 256))


@pytest.mark.triton
def test_expert_rows_of_one_expert() -> None:
    """Every pair on one expert (the first, a middle one, the last): one expert's rows are
    every row, the others' none, and their tiles empty."""
    for expert in (0, 9, 15):
        check_rows(torch.full((7, 1), expert), 16, 4)
        check_rows(torch.full((3, 6), expert), 16, 16)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("experts", "k"), [(384, 6), (256, 6), (128, 3), (256, 8), (256, 1), (256, 7), (64, 32)]
)
def test_route_is_bitwise_torch_on_cuda(experts: int, k: int) -> None:
    """Flash's and DSpark's router shapes, 4096 tokens: the kernel's weights and ids are the
    torch ops' bits on the GPU, with and without image tokens."""
    g = torch.Generator().manual_seed(experts + k)
    logits, bias = tied_logits(g, 4096, experts)
    check_route(logits, bias, k)
    image = torch.rand(len(logits), generator=g) < 0.5
    check_route(logits, bias, k, torch.randn(experts, generator=g), image)


@pytest.mark.gpu
def test_expert_rows_on_cuda_at_flash_size() -> None:
    """The largest step that runs grouped at Flash's shape (384 experts, 6 each: 4096 tokens)
    and a decode step, against torch's sort."""
    g = torch.Generator().manual_seed(3)
    for tokens in (1, 4096):
        ids = torch.rand(tokens, 384, generator=g).argsort(dim=1)[:, :6]
        check_rows(ids, 384, group_tile_rows(tokens * 6, 384))


@triton.jit
def _scores_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + i, moe_routing.sqrt_softplus(tl.load(x_ptr + i), True))


@pytest.mark.gpu
def test_scores_are_torch_bitwise_for_every_fp32() -> None:
    """``sqrt_softplus`` on all 2**32 fp32 bit patterns against ``F.softplus(x).sqrt()`` on the
    GPU: the same bits (NaN for NaN), denormals and the threshold included."""
    chunk, block = 1 << 28, 1024
    out = torch.empty(chunk, dtype=torch.float32, device="cuda")
    bad = 0
    for c in range(1 << 4):
        bits = torch.arange(c * chunk, (c + 1) * chunk, dtype=torch.int64, device="cuda")
        x = bits.to(torch.int32).view(torch.float32)  # wraps past 2**31: the negatives
        _scores_kernel[(chunk // block,)](x, out, BLOCK=block, **moe_routing.exact_options())
        want = torch.nn.functional.softplus(x).sqrt()
        same = (out.view(torch.int32) == want.view(torch.int32)) | (out.isnan() & want.isnan())
        bad += int((~same).sum())
    assert bad == 0
