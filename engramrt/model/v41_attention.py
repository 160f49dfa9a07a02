"""DeepSeek-V4.1's sparse latent attention, the torch path (``../shared/V41-ARCH.md`` 1.4).

One 512-d latent ``kv_norm(wkv x)`` is both K and V for every query head. A query attends over
its sliding window of latents and, in layers of ratio > 0, over the compressed entries its
layer's top-k picked (``topk`` per run), with a learned per-head sink in the softmax's
denominator only. Per layer role (``engramrt.v41_config``):

- a **source** compresses groups of ``ratio`` tokens into its compressed cache (at ratio 2 a
  gated softmax over each pair, a group split across steps or chunks carried in the tail),
  writes index keys, scans them with its indexer and publishes the top-k; the candidate source
  also publishes candidate blocks;
- a **reindex** layer scores the latest source's index keys inside the candidate blocks;
- a **reuse** layer reads the latest source's cache with the latest published top-k.

Tokens come as runs, one per request (``ForwardContext``): projections run on the whole step,
the window, compressor, indexer and attention run per run, so a request's numbers do not depend
on its batch. Top-k ties (bf16 scores tie often) go to the lower position, always. A source
scores its own index keys at every step (the reference's code scores the last publisher's on a
step where its ratio-2 group stays open: README, "DeepSeek-V4.1 models").
"""

from __future__ import annotations

import math
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from engramrt.model import quant
from engramrt.model.context import ForwardContext
from engramrt.model.layers import RMSNorm
from engramrt.model.quant import StoredLinear
from engramrt.model.v41_cache import V41Cache
from engramrt.tensor_parallel import SINGLE, TensorParallel
from engramrt.v41_config import REINDEX, REUSE, SOURCE, WINDOW, LayerRole, V41Config

QUERY_CHUNK = 256  # queries whose scores are formed at once (bounds a long prefill's memory)
NO_SCORE = -1e30  # the running max of a query that sees nothing: its output is 0, not NaN


@cache
def rope_frequencies(dim: int, theta: float, yarn: tuple[int, float, float, float] | None):
    """The ``dim / 2`` rotary frequencies (fp32, CPU); ``yarn`` = (original_seq_len, factor,
    beta_fast, beta_slow): a dimension whose wavelength fits the training context keeps its
    frequency, one far beyond it is divided by ``factor``, and a linear ramp joins the two."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn is not None:
        original, factor, fast, slow = yarn

        def dim_of(turns: float) -> float:  # the dim that turns ``turns`` times in the context
            return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

        low, high = max(math.floor(dim_of(fast)), 0), min(math.ceil(dim_of(slow)), dim - 1)
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low)
                / max(high - low, 1e-3)).clamp(0, 1)  # fmt: skip
        keep = 1 - ramp
        freqs = freqs / factor * (1 - keep) + freqs * keep
    return freqs


def rotate_tail(x: torch.Tensor, angles: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Rotate the trailing ``2 * angles.shape[-1]`` dims of ``x`` [T, ..., D] by ``angles``
    [T, rd / 2], pairing **adjacent** elements (a complex number each), in fp32, rounded once;
    ``inverse``: the conjugate rotation."""
    rd = 2 * angles.shape[-1]
    while angles.dim() < x.dim():
        angles = angles.unsqueeze(1)
    cos, sin = angles.cos(), angles.sin()
    if inverse:
        sin = -sin
    pairs = x[..., -rd:].float().unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    turned = torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], turned.to(x.dtype)], dim=-1)


def tp_span(tp: TensorParallel, lo: int, hi: int) -> tuple[int, int] | None:
    """A rank's slice of a weight's features, or None when it holds them all."""
    return None if tp.size == 1 else (lo, hi)


class Compressor(nn.Module):
    """Groups of ``ratio`` tokens into one latent, returned before RoPE (the indexer keys are
    made from that form). Ratio 1: ``norm(wkv x)``; ratio 2: fp32 projections and gate scores,
    a softmax over each pair per channel."""

    def __init__(self, cfg: V41Config, ratio: int, dtype: torch.dtype):
        super().__init__()
        self.ratio = ratio
        wdtype = torch.float32 if ratio > 1 else dtype
        self.wkv = nn.Linear(cfg.dim, cfg.head_dim, bias=False, dtype=wdtype)
        self.wgate = (
            nn.Linear(cfg.dim, cfg.head_dim, bias=False, dtype=wdtype) if ratio > 1 else None
        )
        self.norm = RMSNorm(cfg.head_dim, cfg.norm_eps, dtype)

    def forward(self, x: torch.Tensor, p0: int, tail: torch.Tensor | None) -> torch.Tensor:
        """The latents of the groups that complete in a run of ``len(x)`` tokens from position
        ``p0``; ``tail`` [2, D] (ratio 2): the open group's first token, read when ``p0`` is odd
        and written when the run ends on an even position."""
        if self.ratio == 1:
            return self.norm(self.wkv(x))
        xf = x.float()
        a, s = self.wkv(xf), self.wgate(xf)
        if p0 % 2:
            a, s = torch.cat([tail[:1], a]), torch.cat([tail[1:], s])
        if len(a) % 2:
            tail.copy_(torch.stack([a[-1], s[-1]]))
            a, s = a[:-1], s[:-1]
        pooled = (a.unflatten(0, (-1, 2)) * s.unflatten(0, (-1, 2)).softmax(dim=1)).sum(dim=1)
        return self.norm(pooled.to(x.dtype))


class Indexer(nn.Module):
    """Scores the compressed entries a query sees: ``sum_h w_h relu(q_h . k_j)`` in the
    activation dtype (bf16 as the reference), FP4 queries and keys; keeps the best
    ``index_topk``."""

    def __init__(self, cfg: V41Config, owns_keys: bool, dtype: torch.dtype):
        super().__init__()
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.blocks, self.block_size = cfg.candidate_topk_blocks, cfg.candidate_block_size
        self.wq_b = StoredLinear(self.heads * self.dim, cfg.q_lora_rank)
        self.weights_proj = nn.Linear(cfg.dim, self.heads, bias=False, dtype=dtype)
        self.scale = self.dim**-0.5 * self.heads**-0.5
        if owns_keys:
            self.wk = nn.Linear(cfg.head_dim, self.dim, bias=False, dtype=dtype)
            self.k_norm = RMSNorm(self.dim, cfg.norm_eps, dtype)

    def keys(self, latent: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
        """Index keys of pre-RoPE latents: RoPE at each group's first position, FP4 (pow2/32)."""
        k = rotate_tail(self.k_norm(self.wk(latent)), angles)
        return quant.fp4_roundtrip(k, quant.POW2_SCALE)

    def scores(self, x, qr, angles, keys: torch.Tensor) -> torch.Tensor:
        """``[n, C]`` scores of a run's queries against ``keys`` [C, index_head_dim]."""
        q = self.wq_b(qr).unflatten(-1, (self.heads, self.dim))
        q = quant.fp4_roundtrip(rotate_tail(q, angles), quant.POW2_SCALE)
        w = self.weights_proj(x) * self.scale
        s = torch.einsum("nhd,cd->nhc", q, keys).relu()
        return (s * w.unsqueeze(-1)).sum(dim=1)

    def candidates(self, scores: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """The candidate mask ``[n, C]``: per query the ``blocks`` best blocks of
        ``block_size`` entries by their best score, the block of its newest entry always in,
        blocks it cannot reach never."""
        n, width = scores.shape
        padded = F.pad(scores, (0, -width % self.block_size), value=-math.inf)
        best = padded.unflatten(-1, (-1, self.block_size)).amax(-1)
        newest = ((seen - 1) // self.block_size).unsqueeze(-1)
        best = best.masked_fill(torch.arange(best.shape[-1], device=best.device) == newest,
                                math.inf)  # fmt: skip
        order = torch.sort(best, dim=-1, descending=True, stable=True)
        k = min(self.blocks, best.shape[-1])
        keep = torch.zeros_like(best, dtype=torch.bool)
        keep.scatter_(-1, order.indices[:, :k], order.values[:, :k] > -math.inf)
        return keep.repeat_interleave(self.block_size, dim=-1)[:, :width]

    def select(self, scores: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """Top-``index_topk`` entries ``[n, k]`` sorted by position, -1 where a query cannot
        reach the pick; equal scores: the lower position first."""
        k = min(self.topk, scores.shape[-1])
        picks = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
        picks = picks.sort(dim=-1).values
        return torch.where(picks < seen.unsqueeze(-1), picks, -1)


class V41Attention(nn.Module):
    """With tensor parallelism a rank holds whole output groups and their query heads (``wq_b``
    rows, sinks, ``wo_a`` rows, ``wo_b`` columns); the latent, compressor and indexer are
    replicated, so every rank keeps the same caches and picks the same top-k; ``wo_b``'s partial
    sums are all-reduced in fp32."""

    def __init__(
        self, cfg: V41Config, role: LayerRole, dtype: torch.dtype, tp: TensorParallel = SINGLE
    ):
        super().__init__()
        self.role, self.layer_id, self.tp = role, role.layer, tp
        self.kv_heads = 1  # one shared latent is every head's K and V
        g0, g1 = tp.span(cfg.o_groups, "o_groups")
        per_group = cfg.n_heads // cfg.o_groups
        h0, h1 = g0 * per_group, g1 * per_group
        d, rank = cfg.head_dim, cfg.o_lora_rank
        self.heads, self.head_dim, self.rope_dim = h1 - h0, d, cfg.rope_head_dim
        self.window, self.groups, self.rank = cfg.window_size, g1 - g0, rank
        self.wq_a = StoredLinear(cfg.q_lora_rank, cfg.dim)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, dtype)
        self.wq_b = StoredLinear(cfg.n_heads * d, cfg.q_lora_rank, rows=tp_span(tp, h0 * d, h1 * d))
        self.wkv = StoredLinear(d, cfg.dim)
        self.kv_norm = RMSNorm(d, cfg.norm_eps, dtype)
        # block-diagonal over the output groups: kept dequantised (the checkpoint's FP8 scale is
        # applied at load)
        group_in = cfg.n_heads * d // cfg.o_groups
        self.wo_a = nn.Linear(group_in, self.groups * rank, bias=False, dtype=dtype)
        self.wo_b = StoredLinear(
            cfg.dim, cfg.o_groups * rank, cols=tp_span(tp, g0 * rank, g1 * rank)
        )
        self.attn_sink = nn.Parameter(torch.zeros(h1 - h0), requires_grad=False)
        self.shards = {} if tp.size == 1 else {
            "wo_a.weight": (0, g0 * rank, g1 * rank), "attn_sink": (0, h0, h1),
            "wo_a.scale": (0, g0 * rank // 32, g1 * rank // 32),  # whole blocks: rank % 32 == 0
        }  # fmt: skip
        self.softmax_scale = cfg.head_dim**-0.5
        self.compressor = Compressor(cfg, role.ratio, dtype) if role.kind == SOURCE else None
        self.indexer = (Indexer(cfg, role.kind == SOURCE, dtype)
                        if role.kind in (SOURCE, REINDEX) else None)  # fmt: skip
        yarn = None
        if role.ratio:  # compressed layers: YaRN-ramped compress_rope_theta, no mscale
            yarn = (cfg.original_seq_len, cfg.rope_factor, cfg.beta_fast, cfg.beta_slow)
        self.rope_key = (cfg.rope_head_dim, cfg.compress_rope_theta if role.ratio else
                         cfg.rope_theta, yarn)  # fmt: skip

    def angles(self, positions: torch.Tensor) -> torch.Tensor:
        freqs = rope_frequencies(*self.rope_key).to(positions.device)
        return positions.float()[:, None] * freqs

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        cache: V41Cache = ctx.kv
        shared = ctx.step_cache.setdefault("v41", {"topk": {}, "candidates": {}})
        angles = self.angles(ctx.positions)
        qr = self.q_norm(self.wq_a(x))
        q = rotate_tail(self.wq_b(qr).unflatten(-1, (self.heads, self.head_dim)), angles)
        kv = quant.act_roundtrip(rotate_tail(self.kv_norm(self.wkv(x)), angles))
        out = torch.empty_like(q)
        q0 = 0
        for b, (slot, n, p0) in enumerate(zip(ctx.slots, ctx.run_lens, ctx.start_pos, strict=True)):
            if n:
                run = slice(q0, q0 + n)
                out[run] = self._run(x[run], qr[run], q[run], kv[run], angles[run], slot, p0, b,
                                     ctx, cache, shared)  # fmt: skip
            q0 += n
        o = rotate_tail(out, angles, inverse=True).flatten(1).unflatten(-1, (self.groups, -1))
        u = torch.einsum("tgd,grd->tgr", o, self.wo_a.weight.unflatten(0, (self.groups, self.rank)))
        y = self.wo_b(u.flatten(1))
        return y if self.tp.solo else self.tp.all_reduce(y.float()).to(y.dtype)

    def _run(self, x, qr, q, kv, angles, slot, p0, b, ctx, cache: V41Cache, shared):
        """Attention output ``[n, heads, head_dim]`` of one request's run of ``n`` tokens from
        position ``p0``, which updates its window ring (and, at a source, its caches)."""
        n, w, dev = len(x), self.window, x.device
        pos = torch.arange(p0, p0 + n, device=dev)
        ring = cache.window[self.layer_id][slot]
        first = max(0, p0 - w + 1)
        win_pos = torch.arange(first, p0 + n, device=dev)
        win_kv = torch.cat([ring[torch.arange(first, p0, device=dev) % w], kv])
        keep = min(n, w)
        ring[pos[-keep:] % w] = kv[-keep:]
        if self.role.kind == WINDOW:
            comp, picked = win_kv[:0], None
        else:
            comp, picked = self._compressed(x, qr, angles, slot, p0, b, ctx, cache, shared)
        out = torch.empty_like(q)
        for c0 in range(0, n, QUERY_CHUNK):
            c1 = min(n, c0 + QUERY_CHUNK)
            t = pos[c0:c1, None]
            lo = max(0, p0 + c0 - w + 1) - first  # the window rows any query of the chunk sees
            rows = win_kv[lo : p0 + c1 - first]
            rpos = win_pos[lo : p0 + c1 - first]
            seen = (rpos <= t) & (rpos > t - w)
            if picked is not None:
                chosen = torch.zeros(c1 - c0, len(comp) + 1, dtype=torch.bool, device=dev)
                chosen.scatter_(1, picked[c0:c1].long() % (len(comp) + 1), True)
                rows, seen = torch.cat([rows, comp]), torch.cat([seen, chosen[:, :-1]], dim=1)
            out[c0:c1] = self._attend(q[c0:c1], rows, seen)
        return out

    def _compressed(self, x, qr, angles, slot, p0, b, ctx, cache: V41Cache, shared):
        """The compressed entries the run's queries may read ``[C, D]`` (from the KV source's
        cache, after a source writes this run's) and each query's picks among them ``[n, k]``
        (-1: none)."""
        role, n, dev = self.role, len(x), x.device
        r, end = role.ratio, p0 + len(x)
        table = ctx.block_table[b]
        if role.kind == SOURCE:
            latent = self.compressor(x, p0, cache.tail[self.layer_id][slot] if r == 2 else None)
            if len(latent):  # groups p0 // r .. end // r - 1 complete in this run
                js = torch.arange(p0 // r, end // r, device=dev)
                at = self.angles(js * r)
                rows = cache.entry_rows(table, js, r)
                cache.index_keys[self.layer_id][rows] = self.indexer.keys(latent, at)
                cache.compressed[self.layer_id][rows] = quant.fp4_roundtrip(
                    rotate_tail(latent, at), quant.E4M3_SCALE
                )
        count = end // r
        rows = cache.entry_rows(table, torch.arange(count, device=dev), r)
        comp = cache.compressed[role.kv_source][rows]
        if role.kind == REUSE:
            return comp, shared["topk"][b]
        seen = (torch.arange(p0, end, device=dev) + 1) // r
        if count == 0:
            picks = torch.empty(n, 0, dtype=torch.int64, device=dev)
        else:
            keys = cache.index_keys[role.index_source][rows]
            scores = self.indexer.scores(x, qr, angles, keys)
            visible = torch.arange(count, device=dev) < seen.unsqueeze(-1)
            scores = scores.masked_fill(~visible, -math.inf)
            if role.builds_candidates:
                shared["candidates"][b] = self.indexer.candidates(scores, seen)
            elif role.candidates_from is not None:
                scores = scores.masked_fill(~shared["candidates"][b], -math.inf)
            picks = self.indexer.select(scores, seen)
        shared["topk"][b] = picks
        return comp, picks

    def _attend(self, q: torch.Tensor, rows: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """Queries ``[m, H, D]`` over ``rows`` [R, D] where ``seen`` [m, R]: fp32 scores, the
        sink's ``exp`` in the denominator only, probabilities in the activation dtype (as the
        reference's kernel casts them) before they weigh the rows."""
        s = torch.einsum("mhd,rd->mhr", q.float(), rows.float()) * self.softmax_scale
        s = s.masked_fill(~seen[:, None, :], -math.inf)
        top = s.amax(-1, keepdim=True).clamp_min(NO_SCORE)
        p = torch.exp(s - top)
        denom = p.sum(-1) + torch.exp(self.attn_sink.float() - top.squeeze(-1))
        o = torch.einsum("mhr,rd->mhd", p.to(q.dtype).float(), rows.float())
        return (o / denom.unsqueeze(-1)).to(q.dtype)
