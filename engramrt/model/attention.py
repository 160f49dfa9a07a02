"""Grouped-query attention with RoPE over the paged KV cache.

Tokens arrive as runs, one per request; each run writes its K/V at its positions (through its
block table) and attends causally over its cached positions. On CUDA the Triton kernels do both
(decode and prefill kernels, no host sync, so a decode step can be a CUDA graph); elsewhere the
torch reference below, which the kernels are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engramrt.config import ModelConfig
from engramrt.kernels import use_triton
from engramrt.model.context import ForwardContext
from engramrt.model.layers import StackedLinear, apply_rope


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.layer_id = layer_id
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        d, q_dim = cfg.hidden_size, self.heads * self.head_dim
        kv_dim = self.kv_heads * self.head_dim
        self.wqkv = StackedLinear(self, "wqkv", d, {"wq": q_dim, "wk": kv_dim, "wv": kv_dim}, dtype)
        self.wo = nn.Linear(q_dim, d, bias=False, dtype=dtype)

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
        return self.wo(out.flatten(1))


def _triton_attention(qkv, cos, sin, k_cache, v_cache, ctx: ForwardContext, heads: int):
    from engramrt.kernels import paged_attention as pa
    from engramrt.kernels.rope import rope_write_kv

    q = rope_write_kv(qkv, cos, sin, k_cache, v_cache, ctx.slot_mapping, heads)
    bs = ctx.kv.block_size
    if ctx.decode:
        return pa.paged_decode_attention(
            q, k_cache, v_cache, ctx.block_table, ctx.context_lens, bs, ctx.table_width
        )
    # a mixed step: prompt chunks by the prefill kernel's tiles, the one-token runs by the
    # decode kernel (a 128-query tile for one query would read its keys once per head); row T
    # takes what graph-padding decode entries write
    t = q.shape[0]
    out = q.new_empty(t + 1, *q.shape[1:])
    pa.paged_prefill_attention(q, k_cache, v_cache, ctx.block_table, ctx.query_start,
                               ctx.start_pos_t, *ctx.tiles, bs, out=out)  # fmt: skip
    tok, table, lens = ctx.decode_rows()
    if tok.numel():
        o = pa.paged_decode_attention(q[tok.clamp(max=t - 1)], k_cache, v_cache, table, lens, bs,
                                      ctx.table_width)  # fmt: skip
        out.index_copy_(0, tok, o)
    return out[:t]


def _torch_attention(q, k, v, k_cache, v_cache, ctx: ForwardContext) -> torch.Tensor:
    """The reference: write, then per request causal SDPA over its cached positions."""
    real = ctx.slot_mapping >= 0
    k_cache[ctx.slot_mapping[real]] = k[real]
    v_cache[ctx.slot_mapping[real]] = v[real]
    out = torch.zeros_like(q)
    bs, start = ctx.kv.block_size, 0
    for b, (n, p0) in enumerate(zip(ctx.run_lens, ctx.start_pos, strict=True)):
        if n == 0:
            continue
        end = p0 + n
        pos = torch.arange(end, device=q.device)
        rows = ctx.block_table[b, pos // bs] * bs + pos % bs
        causal = pos <= pos[p0:, None]
        o = F.scaled_dot_product_attention(
            q[start : start + n].transpose(0, 1),
            k_cache[rows].transpose(0, 1),
            v_cache[rows].transpose(0, 1),
            attn_mask=causal,
            enable_gqa=True,
        )
        out[start : start + n] = o.transpose(0, 1)
        start += n
    return out
