"""V4.1's attention kernel inside the model: every ``V41Attention._attend`` call of a mixed
workload on ``v41-small`` (prefill chunks that split ratio-2 groups, decode rows, two requests
in one step) computed by the Triton kernel and by the torch path from the same inputs and
caches, so the kernel's reading of rings, runs and block tables is checked on real states.
Off CUDA the kernel runs under Triton's interpreter (float32)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engramrt.model import v41_attention
from engramrt.runner.stage import StageRunner
from tests.model.test_v41_engine import prompt, run_steps

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_attention_kernel_equals_the_torch_path_on_every_call(v41_small: Path, monkeypatch):
    dtype = "bfloat16" if DEVICE == "cuda" else "float32"
    runner = StageRunner.load(v41_small, num_slots=4, max_len=256, device=DEVICE, dtype=dtype)
    attend, calls = v41_attention.V41Attention._attend, []

    def both(self, q, kv, picks, step, cache):
        monkeypatch.setattr(v41_attention, "use_triton", lambda device: True)
        got = attend(self, q, kv, picks, step, cache)
        monkeypatch.setattr(v41_attention, "use_triton", lambda device: False)
        want = attend(self, q, kv, picks, step, cache)
        calls.append((self.role.kind, picks is not None and bool((picks >= 0).any())))
        scale = want.float().abs().amax().clamp_min(1e-6)
        tol = 1e-5 if q.dtype == torch.float32 else 2e-2  # bf16 probabilities, another max
        torch.testing.assert_close(got.float() / scale, want.float() / scale, rtol=0, atol=tol)
        return got

    monkeypatch.setattr(v41_attention.V41Attention, "_attend", both)
    a, b = prompt(45, 11), prompt(30, 12)
    run_steps(runner, [[(0, a[:13])], [(0, a[13:40]), (1, b[:21])],
                       [(1, b[21:22]), (0, a[40:41])], [(0, a[41:44]), (1, b[22:23])]])  # fmt: skip
    kinds = {kind for kind, _ in calls}
    assert len(kinds) == 4 and any(picked for _, picked in calls)  # every role, real picks
