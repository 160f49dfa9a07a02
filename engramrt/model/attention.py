"""Grouped-query attention with RoPE over a contiguous per-slot KV cache.

Tokens arrive as runs, one per request; each run writes its K/V at its positions (through its
block table) and attends causally over its cached positions. Prefill, chunked prefill and decode
are the same code.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engramrt.config import ModelConfig
from engramrt.model.context import ForwardContext
from engramrt.model.layers import apply_rope


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.layer_id = layer_id
        self.heads, self.kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.theta = cfg.rope_theta
        d = cfg.hidden_size
        self.wq = nn.Linear(d, self.heads * self.head_dim, bias=False, dtype=dtype)
        self.wk = nn.Linear(d, self.kv_heads * self.head_dim, bias=False, dtype=dtype)
        self.wv = nn.Linear(d, self.kv_heads * self.head_dim, bias=False, dtype=dtype)
        self.wo = nn.Linear(self.heads * self.head_dim, d, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        t = x.shape[0]
        q = apply_rope(self.wq(x).view(t, self.heads, self.head_dim), ctx.positions, self.theta)
        k = apply_rope(self.wk(x).view(t, self.kv_heads, self.head_dim), ctx.positions, self.theta)
        v = self.wv(x).view(t, self.kv_heads, self.head_dim)
        kv = ctx.kv
        k_cache, v_cache = kv.k[self.layer_id], kv.v[self.layer_id]
        out = torch.zeros_like(q)
        start = 0
        for n, p0, table in zip(ctx.run_lens, ctx.start_pos, ctx.block_tables, strict=True):
            if n == 0:
                continue
            end = p0 + n
            rows = kv.token_slots(table, 0, end, x.device)
            k_cache[rows[p0:]] = k[start : start + n]
            v_cache[rows[p0:]] = v[start : start + n]
            causal = torch.arange(end, device=x.device) <= rows.new_tensor(range(p0, end))[:, None]
            o = F.scaled_dot_product_attention(
                q[start : start + n].transpose(0, 1),
                k_cache[rows].transpose(0, 1),
                v_cache[rows].transpose(0, 1),
                attn_mask=causal,
                enable_gqa=True,
            )
            out[start : start + n] = o.transpose(0, 1)
            start += n
        return self.wo(out.flatten(1))
