"""The GQA family's attention: grouped query heads with RoPE over the paged KV cache.

Tokens arrive as runs, one per request; each run writes its K/V at its positions (through its
block table) and attends causally over its cached positions. On CUDA the Triton kernels do both
(decode and prefill kernels, no host sync, so a decode step can be a CUDA graph); elsewhere the
torch reference below, which the kernels are tested against.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from engramrt.config import ModelConfig
from engramrt.kernels import use_triton
from engramrt.model.context import ForwardContext
from engramrt.model.layers import StackedLinear, apply_rope
from engramrt.models.gqa.config import GQAConfig
from engramrt.tensor_parallel import SINGLE, TensorParallel


def kv_head_span(kv_heads: int, tp: TensorParallel) -> tuple[int, int]:
    """The KV heads a rank holds: its share when they divide among the ranks, else the one
    its query heads read (replicated on ``tp.size / kv_heads`` ranks, as vLLM does)."""
    if kv_heads % tp.size == 0:
        return tp.span(kv_heads, "num_key_value_heads")
    if tp.size % kv_heads:
        raise ValueError(
            f"--tensor-parallel-size {tp.size} must divide num_key_value_heads ({kv_heads}) "
            "or be a multiple of it"
        )
    head = tp.rank // (tp.size // kv_heads)
    return head, head + 1


class GQAAttention(nn.Module):
    """With tensor parallelism a rank holds its query heads and their KV heads (``shards``:
    the checkpoint rows and columns it reads); its output projection's partial sums are
    all-reduced."""

    def __init__(
        self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype, tp: TensorParallel = SINGLE
    ):
        super().__init__()
        self.layer_id, self.tp = layer_id, tp
        g: GQAConfig = cfg.body
        q0, q1 = tp.span(g.num_heads, "num_attention_heads")
        k0, k1 = kv_head_span(g.num_kv_heads, tp)
        self.heads, self.kv_heads, self.head_dim = q1 - q0, k1 - k0, g.head_dim
        self.theta = g.rope_theta
        d, hd = cfg.hidden_size, g.head_dim
        q_dim, kv_dim = self.heads * hd, self.kv_heads * hd
        self.wqkv = StackedLinear(self, "wqkv", d, {"wq": q_dim, "wk": kv_dim, "wv": kv_dim}, dtype)
        self.wo = nn.Linear(q_dim, d, bias=False, dtype=dtype)
        self.shards = (
            {}
            if tp.size == 1
            else {
                "wq.weight": (0, q0 * hd, q1 * hd),
                "wk.weight": (0, k0 * hd, k1 * hd),
                "wv.weight": (0, k0 * hd, k1 * hd),
                "wo.weight": (1, q0 * hd, q1 * hd),
            }
        )

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        qkv = self.wqkv(x)
        cos, sin = ctx.rope(self.head_dim, self.theta)
        k_cache, v_cache = ctx.kv.k[self.layer_id], ctx.kv.v[self.layer_id]
        if use_triton(x.device):
            out = _triton_attention(qkv, cos, sin, k_cache, v_cache, ctx, self.heads)
        else:
            t, hd = x.shape[0], self.head_dim
            q, k, v = qkv.split(list(self.wqkv.parts.values()), dim=-1)
            q = apply_rope(q.view(t, self.heads, hd), cos, sin)
            k = apply_rope(k.view(t, self.kv_heads, hd), cos, sin)
            out = _torch_attention(q, k, v.view(t, self.kv_heads, hd), k_cache, v_cache, ctx)
        return self.tp.all_reduce(self.wo(out.flatten(1)))


def _triton_attention(qkv, cos, sin, k_cache, v_cache, ctx: ForwardContext, heads: int):
    from engramrt.kernels import paged_attention as pa
    from engramrt.kernels.rope import rope_write_kv

    q = rope_write_kv(qkv, cos, sin, k_cache, v_cache, ctx.slot_mapping, heads)
    bs = ctx.kv.block_size
    if ctx.decode:
        return pa.paged_decode_attention(
            q, k_cache, v_cache, ctx.block_table, ctx.context_lens, bs, ctx.table_width
        )
    if ctx.token_rows:  # a verify graph: each token a decode row, keys up to its position
        _, table, lens = ctx.decode_rows()
        return pa.paged_decode_attention(q, k_cache, v_cache, table, lens, bs, ctx.table_width)
    # a mixed step: prompt chunks by the prefill kernel's tiles, the one-token runs by the
    # decode kernel (a 128-query tile for one query would read its keys once per head); row T
    # takes what graph-padding decode entries write
    t = q.shape[0]
    out = q.new_empty(t + 1, *q.shape[1:])
    pa.paged_prefill_attention(
        q,
        k_cache,
        v_cache,
        ctx.block_table,
        ctx.query_start,
        ctx.start_pos_t,
        *ctx.tiles,
        bs,
        out=out,
    )
    tok, table, lens = ctx.decode_rows()
    if tok.numel():
        o = pa.paged_decode_attention(
            q[tok.clamp(max=t - 1)], k_cache, v_cache, table, lens, bs, ctx.table_width
        )
        out.index_copy_(0, tok, o)
    return out[:t]


def _torch_attention(q, k, v, k_cache, v_cache, ctx: ForwardContext) -> torch.Tensor:
    """The reference: write, then causal SDPA over each request's cached positions. Runs of one
    length attend in one call, keys padded to the group's longest context (masked): a training
    batch of equal windows is one SDPA, not one per window."""
    real = ctx.slot_mapping >= 0
    k_cache[ctx.slot_mapping[real]] = k[real]
    v_cache[ctx.slot_mapping[real]] = v[real]
    out = torch.zeros_like(q)
    groups: dict[int, list[int]] = {}
    for b, n in enumerate(ctx.run_lens):
        if n:
            groups.setdefault(n, []).append(b)
    starts = [0, *itertools.accumulate(ctx.run_lens)]
    for n, reqs in groups.items():
        dev, bs = q.device, ctx.kv.block_size
        p0 = torch.tensor([ctx.start_pos[b] for b in reqs], device=dev)
        pos = torch.arange(max(ctx.start_pos[b] for b in reqs) + n, device=dev)
        table = ctx.block_table[reqs][:, pos // bs].clamp(min=0)  # past a context: masked
        rows = table * bs + pos % bs  # [G, context]
        i = torch.arange(n, device=dev)
        tok = torch.tensor([starts[b] for b in reqs], device=dev)[:, None] + i  # [G, n]
        causal = pos <= (p0[:, None] + i)[..., None]  # [G, n, context]
        # rows past a run's context (the group's padding: stale table entries, earlier owners'
        # K/V) are zeros, as the kernels load them: masked, a NaN there would still make its
        # weight of 0 NaN
        past = (pos > p0[:, None] + n - 1)[..., None, None]  # [G, context, 1, 1]
        with sdpa_kernel(SDPBackend.MATH):  # rows independent of the batch's shape
            o = F.scaled_dot_product_attention(
                q[tok].transpose(1, 2),  # [G, heads, n, dim]
                k_cache[rows].masked_fill_(past, 0).transpose(1, 2),
                v_cache[rows].masked_fill_(past, 0).transpose(1, 2),
                attn_mask=causal[:, None],
                enable_gqa=True,
            )
        out[tok.flatten()] = o.transpose(1, 2).flatten(0, 1)
    return out
