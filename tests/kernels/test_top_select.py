"""V4.1's top-k selection (``engramrt.kernels.top_select`` and the torch path of
``top_by_position``) against a brute-force restatement: each row's first ``seen`` entries
ordered by (score descending, position ascending) in Python, the first ``k`` kept and sorted by
position, -1 after. Rows full of ties (few distinct values, ``-0.0`` beside ``+0.0``, ``-inf``),
rows that see nothing, fewer entries than ``k``, and block masks that leave entries out."""

from __future__ import annotations

import math

import pytest
import torch

from engramrt.kernels import top_select as kernel
from engramrt.kernels.top_select import top_select
from engramrt.models.deepseek_v41.attention import top_by_position

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def brute(scores, seen, k, allowed=None, block=1) -> list[list[int]]:
    out = []
    for i, row in enumerate(scores.float().tolist()):
        s = [
            v if allowed is None or allowed[i, c // block] else -math.inf for c, v in enumerate(row)
        ]
        order = sorted(range(int(seen[i])), key=lambda c: (-s[c], c))[:k]
        out.append(sorted(order) + [-1] * (k - len(order)))
    return out


def rows(g: torch.Generator, n: int, width: int, dtype: torch.dtype) -> torch.Tensor:
    """Half the rows drawn from a few values (ties everywhere), half continuous."""
    few = torch.tensor([-math.inf, -1.5, -0.0, 0.0, 0.25, 3.0])
    tied = few[torch.randint(len(few), (n // 2, width), generator=g)]
    return torch.cat([tied, torch.randn(n - n // 2, width, generator=g)]).to(dtype)


@pytest.mark.triton
@pytest.mark.parametrize("dtype,masked", [(torch.float32, False), (torch.bfloat16, True)])
def test_kernel_is_the_restatement(dtype: torch.dtype, masked: bool, monkeypatch) -> None:
    monkeypatch.setattr(kernel, "BLOCK", 16)  # rows span several blocks
    g = torch.Generator().manual_seed(int(masked) + 2 * (dtype == torch.bfloat16))
    n, width, block = 12, 70, 8
    scores = rows(g, n, width, dtype)
    seen = torch.randint(0, width + 1, (n,), generator=g)
    seen[:4] = torch.tensor([0, width, 1, 14])
    # the fifth best is a zero: two of the four zeros are -0.0, at the lowest positions
    zeros = [-0.0, 3.0, -0.0, -math.inf, 3.0, -math.inf, 3.0, -1.5, 0.0, -1.5, 0.0, -math.inf]
    scores[3, :12] = torch.tensor(zeros)
    allowed = torch.rand(n, -(-width // block), generator=g) < 0.6 if masked else None
    if masked:
        allowed[3] = True
    for k in (1, 5, width):
        on = [t if t is None else t.to(DEVICE) for t in (scores, seen, allowed)]
        got = top_select(on[0], on[1], k, on[2], block).cpu()
        assert got.tolist() == brute(scores, seen, k, allowed, block), k


@pytest.mark.parametrize("masked", [False, True])
def test_torch_path_is_the_restatement(masked: bool) -> None:
    """The sort the CPU runs, and the kernel's oracle on the GPU."""
    g = torch.Generator().manual_seed(7 + masked)
    n, width, block = 16, 40, 4
    scores = rows(g, n, width, torch.float32)
    seen = torch.randint(0, width + 1, (n,), generator=g)
    allowed = torch.rand(n, width // block, generator=g) < 0.5 if masked else None
    for k in (3, 12, width):
        got = top_by_position(scores, seen, k, allowed, block)
        assert got.tolist() == brute(scores, seen, k, allowed, block), k


def test_scores_of_another_width_are_refused() -> None:
    with pytest.raises(ValueError, match="fp32 or a 16-bit"):
        top_select(torch.zeros(2, 4, dtype=torch.float64), torch.ones(2, dtype=torch.int64), 2)
