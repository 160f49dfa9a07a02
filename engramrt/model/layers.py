"""Standard transformer pieces every family uses: RMSNorm, rotary embedding, stacked linears and
SwiGLU's activation."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engramrt.kernels import use_triton
from engramrt.kernels.linear import linear


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """fp32 ``x * rsqrt(mean(x^2) + eps) * weight``, rounded once to x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    return (xf * weight.float()).to(x.dtype)


def take_rows(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``x[idx]``: the rows of ``x`` [N, ...] at ``idx`` (any shape), as an embedding lookup.
    The same values; in training, its backward sums repeated rows by sorted segments, where
    indexing's backward (and, deterministically, its in-place writes) ran a kernel that took
    3.5 s of a 4 s step of the bundled model on an H200."""
    return F.embedding(idx, x.flatten(1)).unflatten(-1, x.shape[1:])


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_triton(x.device):
            from engramrt.kernels import rms_norm as kernel

            if x.shape[-1] <= kernel.MAX_WIDTH:  # one launch, not eight (one program a row)
                return kernel.rms_norm(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps)


def rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[T, 1, head_dim / 2]`` in fp32: computed once per forward, shared by every
    layer's q and k."""
    half = head_dim // 2
    ar = torch.arange(0, half, device=positions.device, dtype=torch.float32)
    inv_freq = 1.0 / theta ** (ar / half)
    angles = positions.float()[:, None] * inv_freq  # [T, half]
    return angles.cos()[:, None, :], angles.sin()[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [T, heads, head_dim]`` by ``rope_tables``' rows, rotate-half (Llama/HF)
    convention, in fp32, rounded once. The reference of ``engramrt.kernels.rope``, which on CUDA
    rotates q and k and writes the KV cache in one launch."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class StackedLinear(nn.Module):
    """Projections of one input stacked into one weight: a decode step reads them in one GEMM
    (one launch, and a wider GEMV that runs nearer the copy bandwidth). Checkpoints keep the
    separate names (``wq``, ``wk``, ``wv`` beside this module): the parent's state-dict hooks
    split the weight on the way out and stack the parts on the way in."""

    def __init__(self, parent: nn.Module, name: str, dim: int, parts: dict[str, int], dtype):
        super().__init__()
        self.parts = parts
        self.weight = nn.Parameter(torch.empty(sum(parts.values()), dim, dtype=dtype))
        key = f"{name}.weight"

        def split(module, state, prefix, local_metadata) -> None:
            pieces = state.pop(prefix + key).split(list(parts.values()))
            state.update({f"{prefix}{n}.weight": w for n, w in zip(parts, pieces, strict=True)})

        def stack(module, state, prefix, local_metadata, strict, missing, *rest) -> None:
            names = [f"{prefix}{n}.weight" for n in parts]
            if all(n in state for n in names):
                state[prefix + key] = torch.cat([state.pop(n) for n in names])
            else:  # a missing part is reported by its own name
                missing.extend(n for n in names if n not in state)

        parent.register_state_dict_post_hook(split)
        parent.register_load_state_dict_pre_hook(stack)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's ``silu(a) * b`` of ``gate_up = [a | b]`` in fp32, rounded once; one Triton launch
    on CUDA (torch takes three kernels and a bf16 round trip between them)."""
    if use_triton(gate_up.device):
        from engramrt.kernels.swiglu import silu_mul as fused

        return fused(gate_up)
    a, b = gate_up.float().chunk(2, dim=-1)
    return (F.silu(a) * b).to(gate_up.dtype)
