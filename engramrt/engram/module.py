"""The Engram module of DeepSeek-V4.1: table lookup -> wkv -> per-copy gate.

One projection yields a key per hc copy and one value shared by all copies; each copy gates the
value by how well its stream agrees with its key. There is no short conv and no norm weight.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from engramrt.config import EngramConfig
from engramrt.engram.layout import EngramLayout
from engramrt.engram.table import EngramTable
from engramrt.kernels import use_triton
from engramrt.kernels.linear import Linear
from engramrt.tensor_parallel import SINGLE, TensorParallel

GATE_CLAMP = 1e-6  # |dot| floor before the sqrt; keeps the gate away from exactly 0.5


def gate_from_dot(dot: torch.Tensor) -> torch.Tensor:
    """sigmoid(sign(dot) * sqrt(max(|dot|, 1e-6))) with copysign, so -0.0 gives sigmoid(-1e-3)."""
    return torch.sigmoid(torch.copysign(torch.sqrt(dot.abs().clamp(min=GATE_CLAMP)), dot))


def engram_gate(
    x: torch.Tensor,
    kv: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
    dead: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x [T, hc, D]``, ``kv [T, (hc+1)*D]`` -> x + gate * value per copy, rounded once.

    Rows where ``dead`` (image tokens) are returned unchanged, bit for bit. On CUDA the fused
    Triton kernel computes the same (up to fp32 summation order).
    """
    if use_triton(x.device):
        from engramrt.kernels.engram_gate import gate

        return gate(x, kv, q_weight, k_weight, eps, dead)
    tokens, hc, dim = x.shape
    h = x.float()
    key = kv[:, : hc * dim].reshape(tokens, hc, dim).float()
    value = kv[:, hc * dim :].float()
    w = q_weight.float() * k_weight.float()
    rstd = torch.rsqrt(h.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    dot = (h * w * key).sum(-1) * rstd * dim**-0.5
    out = (h + gate_from_dot(dot)[..., None] * value[:, None, :]).to(x.dtype)
    if dead is not None:
        out = torch.where(dead[:, None, None], x, out)
    return out


@functools.cache
def _column_bounds(cfg: EngramConfig, layer_index: int) -> list[int]:
    return EngramLayout.from_config(cfg).column_bounds(layer_index)


class Engram(nn.Module):
    """The Engram of one layer; ``layer_index`` is its position in ``engram_layer_ids``.

    Under tensor parallelism a rank holds the table rows of its hash columns (heads) only, looks
    up those columns and all-gathers the rows of the others: the gathered rows are bitwise the
    unsharded lookup. ``wkv`` and the gate are replicated (gathering 24 rows moves less than
    all-reducing wkv's ``(hc + 1) * D`` outputs would)."""

    def __init__(
        self,
        cfg: EngramConfig,
        layer_index: int,
        table: EngramTable | None = None,
        dtype: torch.dtype = torch.bfloat16,
        tp: TensorParallel = SINGLE,
    ):
        super().__init__()
        self.layer_index, self.tp = layer_index, tp
        self.layer_id = cfg.layer_ids[layer_index]
        self.eps = cfg.rms_norm_eps
        self.hc, self.dim = cfg.hc_mult, cfg.hidden_size
        self.cols, self.head_dim = cfg.n_hash_cols, cfg.head_dim
        self.wkv = Linear(self.cols * cfg.head_dim, (self.hc + 1) * self.dim, dtype=dtype)
        self.q_weight = nn.Parameter(torch.ones(self.hc, self.dim, dtype=dtype))
        self.k_weight = nn.Parameter(torch.ones(self.hc, self.dim, dtype=dtype))
        self.col_span, self.row_span = (0, self.cols), (0, cfg.num_embeddings[layer_index])
        self.shards = {}
        if tp.size > 1:  # the table rows of this rank's hash columns
            c0, c1, _ = tp.padded_span(self.cols)
            bounds = _column_bounds(cfg, layer_index)
            self.col_span, self.row_span = (c0, c1), (bounds[c0], bounds[c1])
            self.shards = {f"embed.{n}": (0, *self.row_span) for n in ("weight", "scale")}
        self.embed = table  # checkpoint name: layers.{i}.engram.embed.{weight,scale}

    def load_wkv(self, weight: torch.Tensor) -> None:
        """Take a bf16/fp32 weight (a checkpoint's FP8 one is dequantised at load, with the
        model's other FP8 weights, unless the family holds it as stored:
        ``checkpoint._install_engram``)."""
        if weight.shape != self.wkv.weight.shape:
            raise ValueError(
                f"engram.wkv.weight of layer {self.layer_id}: expected "
                f"{list(self.wkv.weight.shape)}, got {list(weight.shape)}"
            )
        with torch.no_grad():
            self.wkv.weight.copy_(weight)

    def lookup(self, hash_ids: torch.Tensor) -> torch.Tensor:
        """The rows of this rank's hash columns (all of them without tensor parallelism)."""
        if self.embed is None:
            raise RuntimeError(f"Engram of layer {self.layer_id} has no table")
        c0, c1 = self.col_span
        if (c0, c1) != (0, self.cols):
            hash_ids = hash_ids[:, c0:c1].contiguous()
        return self.embed.lookup(hash_ids)

    def forward(
        self,
        x: torch.Tensor,
        hash_ids: torch.Tensor,
        dead: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``x [T, hc, D]``, ``hash_ids [T, (N-1)*H]`` of this layer, ``dead [T]`` image rows;
        ``rows``: the table rows of ``hash_ids`` when they were read ahead (prefetch)."""
        if hash_ids is None:
            raise RuntimeError(f"Engram of layer {self.layer_id} got no hash ids")
        rows = self.lookup(hash_ids) if rows is None else rows
        rows = self.tp.gather(rows, self.cols * self.head_dim)
        kv = self.wkv(rows.to(self.q_weight.dtype))  # wkv's weight may be stored FP8
        return engram_gate(x, kv, self.q_weight, self.k_weight, self.eps, dead)
