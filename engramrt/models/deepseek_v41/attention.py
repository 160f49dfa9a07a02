"""DeepSeek-V4.1's sparse latent attention, the torch path (restated
independently from the reference's semantics in ``tests/model/test_v41_reference.py``).

One 512-d latent ``kv_norm(wkv x)`` is both K and V for every query head. A query attends over
its sliding window of latents and, in layers of ratio > 0, over the compressed entries its
layer's top-k picked (``topk`` per run), with a learned per-head sink in the softmax's
denominator only. Per layer role (``engramrt.models.deepseek_v41.config``):

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
step where its ratio-2 group stays open: the one deliberate departure, kept switchable and
tested as ``literal_index_slot`` in ``tests/model/test_v41_reference.py``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache

import torch
import torch.nn.functional as F
from torch import nn

from engramrt.kernels import NORM_CODES, use_triton
from engramrt.kernels.linear import Linear
from engramrt.model.context import ForwardContext
from engramrt.model.layers import RMSNorm, take_rows
from engramrt.models.deepseek_v41 import quant
from engramrt.models.deepseek_v41.cache import V41Cache
from engramrt.models.deepseek_v41.config import REINDEX, SOURCE, WINDOW, LayerRole, V41Config
from engramrt.models.deepseek_v41.quant import StoredLinear
from engramrt.tensor_parallel import SINGLE, TensorParallel

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
        ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / max(high - low, 1e-3)).clamp(
            0, 1
        )
        keep = 1 - ramp
        freqs = freqs / factor * (1 - keep) + freqs * keep
    return freqs


@cache
def device_frequencies(key: tuple, device: torch.device) -> torch.Tensor:
    """``rope_frequencies(*key)`` on ``device``, copied there once."""
    return rope_frequencies(*key).to(device)


def angles_at(positions: torch.Tensor, key: tuple) -> torch.Tensor:
    """RoPE angles ``[T, rope_dim / 2]`` at ``positions`` for one frequency table (``key``:
    ``rope_frequencies``' arguments)."""
    return positions.float()[:, None] * device_frequencies(key, positions.device)


def rotate_tail(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False
) -> torch.Tensor:
    """Rotate the trailing ``2 * cos.shape[-1]`` dims of ``x`` [T, ..., D] by the angles whose
    ``cos`` and ``sin`` are given [T, rd / 2], pairing **adjacent** elements (a complex number
    each), in fp32, rounded once; ``inverse``: the conjugate rotation."""
    rd = 2 * cos.shape[-1]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if inverse:
        sin = -sin
    pairs = x[..., -rd:].float().unflatten(-1, (-1, 2))
    re, im = pairs[..., 0], pairs[..., 1]
    turned = torch.stack([re * cos - im * sin, re * sin + im * cos], dim=-1).flatten(-2)
    return torch.cat([x[..., :-rd], turned.to(x.dtype)], dim=-1)


ACT = "act"  # rope_quant's kinds: the window KV's FP8 round trip, or an FP4 scale kind


def rope_quant(
    x: torch.Tensor,
    rot: tuple[torch.Tensor, torch.Tensor],
    kind: str | None = None,
    inverse: bool = False,
    cache: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
    norm: RMSNorm | None = None,
) -> torch.Tensor:
    """``norm`` (a one-head projection's) first, ``rotate_tail`` by ``rot`` (cos, sin), then
    the ``kind`` round trip (None: none; ``ACT``; ``quant.POW2_SCALE`` or
    ``quant.E4M3_SCALE``: FP4), also written to ``cache`` at ``rows`` [T] (one row a token).
    On CUDA one launch (``engramrt.kernels.rope_quant``)."""
    if use_triton(x.device):
        from engramrt.kernels import quant_roundtrip as rt
        from engramrt.kernels.rope_quant import NONE
        from engramrt.kernels.rope_quant import rope_quant as fused

        code = {
            None: NONE,
            ACT: rt.ACT,
            quant.POW2_SCALE: rt.FP4_POW2,
            quant.E4M3_SCALE: rt.FP4_E4M3,
        }[kind]
        held = None if norm is None else (norm.weight, norm.eps)
        return fused(x, *rot, code, inverse, cache, rows, held)
    y = rotate_tail(x if norm is None else norm(x), *rot, inverse)
    if kind == ACT:
        y = quant.act_roundtrip(y)
    elif kind is not None:
        y = quant.fp4_roundtrip(y, kind)
    if cache is not None:
        cache.index_copy_(0, rows, y.reshape(len(rows), *cache.shape[1:]))
    return y


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
        self.wkv = Linear(cfg.dim, cfg.head_dim, dtype=wdtype)
        self.wgate = Linear(cfg.dim, cfg.head_dim, dtype=wdtype) if ratio > 1 else None
        self.norm = RMSNorm(cfg.head_dim, cfg.norm_eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        inside: torch.Tensor,
        tail: torch.Tensor | None,
        reads: torch.Tensor | None,
        writes: torch.Tensor | None,
    ) -> torch.Tensor:
        """Each token's group latent ``[T, D]``, meaningful where the token closes its group
        (ratio 1: every token; ratio 2: odd positions, whose group's first token is the previous
        row where ``inside`` its run, else row ``reads`` of ``tail`` [rows, 2, D]). The tokens'
        projections and scores then go to the tail rows ``writes`` (a spare row for those that
        keep nothing)."""
        if self.ratio == 1:
            return self.norm(self.wkv(x))
        xf = x.float()
        a, s = self.wkv(xf), self.wgate(xf)
        if use_triton(x.device):  # one launch (engramrt.kernels.compressor)
            from engramrt.kernels.compressor import pool_norm

            out = pool_norm(a, s, tail, inside, reads, self.norm.weight, self.norm.eps, x.dtype)
        else:
            held = tail[reads]
            before = inside.unsqueeze(-1)
            pa = torch.where(before, a.roll(1, 0), held[:, 0])
            ps = torch.where(before, s.roll(1, 0), held[:, 1])
            pooled = (torch.stack([pa, a], 1) * torch.stack([ps, s], 1).softmax(dim=1)).sum(1)
            out = self.norm(pooled.to(x.dtype))
        tail.index_copy_(0, writes, torch.stack([a, s], dim=1))  # after the reads above
        return out


class Indexer(nn.Module):
    """Scores the compressed entries a query sees: ``sum_h w_h relu(q_h . k_j)`` in the
    activation dtype (bf16 as the reference), FP4 queries and keys; keeps the best
    ``index_topk``."""

    def __init__(self, cfg: V41Config, owns_keys: bool, dtype: torch.dtype):
        super().__init__()
        self.heads, self.dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.blocks, self.block_size = cfg.candidate_topk_blocks, cfg.candidate_block_size
        self.wq_b = StoredLinear(self.heads * self.dim, cfg.q_lora_rank)
        self.weights_proj = Linear(cfg.dim, self.heads, dtype=dtype)
        self.scale = self.dim**-0.5 * self.heads**-0.5
        if owns_keys:
            self.wk = Linear(cfg.head_dim, self.dim, dtype=dtype)
            self.k_norm = RMSNorm(self.dim, cfg.norm_eps, dtype)

    def write_keys(self, latent, rot, keys: torch.Tensor, rows: torch.Tensor) -> None:
        """Index keys of pre-RoPE latents into ``keys`` at ``rows``: RoPE at each group's first
        position (``rot``), FP4 (pow2/32)."""
        rope_quant(self.wk(latent), rot, quant.POW2_SCALE, cache=keys, rows=rows, norm=self.k_norm)

    def queries(self, x, qr, rot) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's FP4 queries ``[T, heads, dim]`` and head weights ``[T, heads]``."""
        q = self.wq_b(qr).unflatten(-1, (self.heads, self.dim))
        return rope_quant(q, rot, quant.POW2_SCALE), self.weights_proj(x) * self.scale

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """``[n, C]`` scores of queries ``q`` [n, heads, dim] (head weights ``w``) against
        their own ``keys`` [n, C, dim]."""
        s = torch.einsum("nhd,ncd->nhc", q, keys).relu()
        return (s * w.unsqueeze(-1)).sum(dim=1)

    def candidates(self, scores: torch.Tensor, seen: torch.Tensor) -> torch.Tensor:
        """The candidate blocks ``[n, NB]`` (bool) of ``block_size`` entries: per query the
        ``blocks`` best by their best score, the block of its newest entry always in, blocks it
        cannot reach never."""
        width = scores.shape[1]
        padded = F.pad(scores, (0, -width % self.block_size), value=-math.inf)
        best = padded.unflatten(-1, (-1, self.block_size)).amax(-1)
        reach = (seen + self.block_size - 1) // self.block_size  # blocks it can reach
        nb = best.shape[-1]
        best = best.masked_fill(
            torch.arange(nb, device=best.device) == reach.unsqueeze(-1) - 1, math.inf
        )
        picks = top_by_position(best, reach, min(self.blocks, nb))
        keep = torch.zeros(len(best), nb + 1, dtype=torch.bool, device=best.device)
        return keep.scatter_(1, torch.where(picks >= 0, picks, nb), True)[:, :nb]

    def select(
        self, scores: torch.Tensor, seen: torch.Tensor, allowed: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Top-``index_topk`` entries ``[n, k]`` (``top_by_position``); ``allowed``: the
        candidate blocks, outside which an entry scores ``-inf``."""
        k = min(self.topk, scores.shape[-1])
        return top_by_position(scores, seen, k, allowed, self.block_size)


def top_by_position(
    scores: torch.Tensor,
    seen: torch.Tensor,
    k: int,
    allowed: torch.Tensor | None = None,
    block: int = 1,
) -> torch.Tensor:
    """The ``k`` best of each row's first ``seen`` entries ``[n, k]``, sorted by position, -1
    past the last; equal scores: the lower position first. ``allowed`` [n, NB]: entry ``c``
    scores ``-inf`` unless ``allowed[:, c // block]`` (still a pick if fewer than ``k`` others
    are left). On CUDA one kernel that finds the k-th score without sorting
    (``engramrt.kernels.top_select``): a CUDA graph's row is as wide as the cache's capacity."""
    if use_triton(scores.device):
        from engramrt.kernels.top_select import top_select

        return top_select(scores, seen, k, allowed, block)
    return sorted_picks(scores, seen, k, allowed, block)


def sorted_picks(
    scores: torch.Tensor,
    seen: torch.Tensor,
    k: int,
    allowed: torch.Tensor | None = None,
    block: int = 1,
) -> torch.Tensor:
    """``top_by_position`` by a stable sort of each whole row (the torch path)."""
    width = scores.shape[-1]
    entries = torch.arange(width, device=scores.device)
    hidden = entries >= seen.unsqueeze(-1)
    if allowed is not None:
        hidden |= ~allowed.repeat_interleave(block, dim=-1)[:, :width]
    scores = scores.masked_fill(hidden, -math.inf)
    picks = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :k]
    picks = picks.sort(dim=-1).values
    return torch.where(picks < seen.unsqueeze(-1), picks, -1)


def rope_key(cfg: V41Config, ratio: int) -> tuple:
    """``rope_frequencies``' arguments for a layer of ``ratio``: compressed layers rotate by
    a YaRN-ramped ``compress_rope_theta`` (no mscale), window-only ones by ``rope_theta``."""
    if not ratio:
        return (cfg.rope_head_dim, cfg.rope_theta, None)
    yarn = (cfg.original_seq_len, cfg.rope_factor, cfg.beta_fast, cfg.beta_slow)
    return (cfg.rope_head_dim, cfg.compress_rope_theta, yarn)


@dataclass(frozen=True)
class StepPlan:
    """What the layers of a model ask a step's ``StepRuns`` for, so that a GPU makes it all in
    one launch: the rotations (rope key, back) and the sources' ratios (the rows of the groups
    tokens close). Anything else is still made when first asked for."""

    rotations: tuple[tuple[tuple, int], ...]
    ratios: tuple[int, ...]

    @classmethod
    def of(cls, cfg: V41Config) -> StepPlan:
        ratios = tuple(sorted({r.ratio for r in cfg.roles if r.kind == SOURCE}))
        rotations = [(rope_key(cfg, 0), 0)]  # window layers and DSpark stages
        if any(r.ratio for r in cfg.roles):
            squeezed = rope_key(cfg, 1)
            rotations += [(squeezed, 0)] + [(squeezed, r - 1) for r in ratios]
        return cls(tuple(dict.fromkeys(rotations)), ratios)

    @cache  # noqa: B019 (a plan per model, a few devices: kept for the process)
    def tensors(self, spares: tuple[int, ...], device: torch.device) -> tuple:
        """(ratios, their ``spares`` rows and the backs as int64, the frequencies [A, H] fp32)
        on ``device``, once: ``kernels.step_rows``' constants."""
        small = [*self.ratios, *spares, *(back for _, back in self.rotations)]
        freqs = torch.stack([rope_frequencies(*key) for key, _ in self.rotations])
        return torch.tensor(small, dtype=torch.int64, device=device), freqs.to(device)


@dataclass
class StepRuns:
    """A step's runs seen from each of its ``T`` tokens, built by the step's first V4.1 layer
    (``of``); later layers also read what the sources publish: ``topk`` [T, k] (entry ids in
    the token's request, -1: none) and ``candidates`` [T, NB] (candidate blocks)."""

    pos: torch.Tensor  # [T] position
    p0: torch.Tensor  # [T] its run's first position
    q0: torch.Tensor  # [T] its run's first row in the step
    end: torch.Tensor  # [T] its run's end position
    slot: torch.Tensor  # [T] its cache slot
    real: torch.Tensor  # [T] False: a CUDA-graph padding token, written nowhere
    req: torch.Tensor  # [T] its run
    tables: torch.Tensor  # [B, W] the runs' block tables
    max_end: int  # the largest run end (a graph's: the cache's capacity): what tokens may see
    topk: torch.Tensor | None = None
    candidates: torch.Tensor | None = None
    memo: dict = field(default_factory=dict)  # what every layer of the step would recompute

    @classmethod
    def of(cls, ctx: ForwardContext, plan: StepPlan | None = None) -> StepRuns:
        """The step's runs, built by its first caller: on a GPU, given the layers' ``plan``, in
        one launch with every row the plan names (``kernels.step_rows``), the same values."""
        runs = ctx.step_cache.get("v41")
        if runs is None:
            ends = [p + n for p, n in zip(ctx.start_pos, ctx.run_lens, strict=True)]
            if ctx.padded:  # a graph replays any lengths: scan what the cache can hold
                ends = [ctx.kv.max_len]
            cache: V41Cache = ctx.kv
            if (
                plan is not None
                and use_triton(ctx.positions.device)
                and all(cache.block_size % r == 0 for r in plan.ratios)
            ):
                runs = cls._planned(ctx, plan, max(ends, default=0))
            else:
                req = ctx.token_req
                p0 = ctx.start_pos_t[req]
                lens = ctx.query_start[1:] - ctx.query_start[:-1]
                runs = cls(
                    ctx.positions,
                    p0,
                    ctx.query_start[req],
                    p0 + lens[req],
                    ctx.slot_ids[req],
                    ctx.slot_mapping >= 0,
                    req,
                    ctx.full_table(),
                    max(ends, default=0),
                )
            ctx.step_cache["v41"] = runs
        return runs

    @classmethod
    def _planned(cls, ctx: ForwardContext, plan: StepPlan, max_end: int) -> StepRuns:
        from engramrt.kernels import step_rows as k

        cache: V41Cache = ctx.kv
        consts, freqs = plan.tensors(tuple(map(cache.spare_row, plan.ratios)), ctx.positions.device)
        sizes = (cache.num_slots, cache.ring_len, cache.tail_rows, cache.block_size)
        got = k.step_rows(
            ctx.positions,
            ctx.token_req,
            ctx.start_pos_t,
            ctx.query_start,
            ctx.slot_ids,
            ctx.slot_mapping,
            ctx.full_table(),
            sizes,
            consts,
            freqs,
        )
        n = got.ints
        runs = cls(
            ctx.positions, n[k.RUN], n[k.Q0], n[k.END], n[k.SLOT], got.real, ctx.token_req,
            ctx.full_table(), max_end,
        )  # fmt: skip
        runs.memo["ring"] = n[k.RING]
        runs.memo["tail"] = n[k.TAIL_READ], n[k.TAIL_WRITE]
        for j, r in enumerate(plan.ratios):
            runs.memo["closes", r] = n[k.CLOSES + j]
        cos, sin = got.angles.cos(), got.angles.sin()  # every table's at once: two launches
        for a, key_back in enumerate(plan.rotations):
            runs.memo[key_back] = cos[a], sin[a]
        return runs

    def rotation(self, key: tuple, back: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, rope_dim / 2]`` of one frequency table at each token's position
        less ``back`` (a group's first position), once a step."""
        if (key, back) not in self.memo:
            angles = angles_at(self.pos - back, key)
            self.memo[key, back] = angles.cos(), angles.sin()
        return self.memo[key, back]

    def ring_rows(self, cache: V41Cache) -> torch.Tensor:
        """Each token's window-ring row: the last ``ring_len`` tokens of each run stay in its
        slot's ring, the rest (and padding) go to the spare slot."""
        if "ring" not in self.memo:
            n = cache.ring_len
            keep = self.real & (self.pos >= self.end - n)
            self.memo["ring"] = torch.where(keep, self.slot, cache.num_slots) * n + self.pos % n
        return self.memo["ring"]

    def tail_rows(self, cache: V41Cache) -> tuple[torch.Tensor, torch.Tensor]:
        """(the compressor-tail row each token would read: its group's first half, position
        ``p - 1``; the row it writes: even positions among its run's last ``2 * tail_rows``,
        the spare slot's last row for the rest)."""
        if "tail" not in self.memo:
            n = cache.tail_rows
            reads = self.slot * n + ((self.pos - 1) // 2) % n
            keep = self.real & (self.pos % 2 == 0) & (self.pos >= self.end - 2 * n)
            spare = (cache.num_slots + 1) * n - 1
            self.memo["tail"] = reads, torch.where(keep, self.slot * n + (self.pos // 2) % n, spare)
        return self.memo["tail"]

    def closing_rows(self, cache: V41Cache, ratio: int) -> torch.Tensor:
        """The compressed-cache row of the group each token closes; the spare row where it
        closes none."""
        if ("closes", ratio) not in self.memo:
            closes = self.real & ((self.pos + 1) % ratio == 0)
            entries = torch.where(closes, self.pos // ratio, -1)
            spare = cache.spare_row(ratio)
            self.memo["closes", ratio] = cache.entry_rows(
                self.tables, self.req, entries, ratio, spare
            )
        return self.memo["closes", ratio]

    def picked_rows(self, cache: V41Cache, ratio: int) -> torch.Tensor:
        """The compressed-cache rows of the entries ``topk`` picks, -1 where none; the layers
        that reuse a source's picks read its rows (once per picks, not once a layer)."""
        kept = self.memo.get(("picked", ratio))
        if kept is None or kept[0] is not self.topk:
            picks = self.topk
            kept = self.memo["picked", ratio] = (
                picks,
                cache.entry_rows(self.tables, self.req, picks, ratio, -1),
            )
        return kept[1]

    def chunks(self) -> list[slice]:
        """Query chunks whose scores are formed at once (bounds a long prefill's memory)."""
        t = len(self.pos)
        return [slice(c, min(t, c + QUERY_CHUNK)) for c in range(0, t, QUERY_CHUNK)]


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
        self.heads, self.head_dim = h1 - h0, d
        self.window, self.groups, self.rank = cfg.window_size, g1 - g0, rank
        self.wq_a = StoredLinear(cfg.q_lora_rank, cfg.dim)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, dtype)
        self.wq_b = StoredLinear(cfg.n_heads * d, cfg.q_lora_rank, rows=tp_span(tp, h0 * d, h1 * d))
        self.wkv = StoredLinear(d, cfg.dim)
        self.kv_norm = RMSNorm(d, cfg.norm_eps, dtype)
        # block-diagonal over the output groups: a dense layer, which a checkpoint's FP8 weight
        # with its scales replaces at load (``quant.grouped_linear`` reads either)
        group_in = cfg.n_heads * d // cfg.o_groups
        self.wo_a = nn.Linear(group_in, self.groups * rank, bias=False, dtype=dtype)
        self.wo_b = StoredLinear(
            cfg.dim, cfg.o_groups * rank, cols=tp_span(tp, g0 * rank, g1 * rank)
        )
        self.attn_sink = nn.Parameter(torch.zeros(h1 - h0), requires_grad=False)
        self.shards = (
            {}
            if tp.size == 1
            else {
                "wo_a.weight": (0, g0 * rank, g1 * rank),
                "attn_sink": (0, h0, h1),
                "wo_a.scale": (0, g0 * rank // 32, g1 * rank // 32),  # whole blocks: rank % 32 == 0
            }
        )
        self.softmax_scale = cfg.head_dim**-0.5
        self.low_stack: tuple[torch.Tensor, torch.Tensor] | None = None  # ``low_ranks``
        self.compressor = Compressor(cfg, role.ratio, dtype) if role.kind == SOURCE else None
        self.indexer = (
            Indexer(cfg, role.kind == SOURCE, dtype) if role.kind in (SOURCE, REINDEX) else None
        )
        self.rope_key = rope_key(cfg, role.ratio)
        self.plan = StepPlan.of(cfg)
        self.norm_inputs = NORM_CODES  # the norm before makes the codes wq_a and wkv read

    def forward(self, x: torch.Tensor, ctx: ForwardContext, inputs=None) -> torch.Tensor:
        """``inputs``: ``x``'s codes from the norm's launch (``norm_inputs``)."""
        cache: V41Cache = ctx.kv
        step = StepRuns.of(ctx, self.plan)
        rot = step.rotation(self.rope_key)
        ring = cache.window[self.layer_id].view(-1, self.head_dim), step.ring_rows(cache)
        # a decode or verify step's runs are no longer than the ring's slack + 1, so its writes
        # land on no ring row its tokens read: the latents go to the ring as they are made (no
        # launch of their own); a longer run's would, so they go after attending
        early = ctx.decode or ctx.token_rows
        qr, q, kv = self.project(x, rot, inputs, ring if early else None)
        comp, rows = None, None
        if self.role.kind == SOURCE:
            self._compress(x, step, cache)
        if self.role.kind in (SOURCE, REINDEX):
            self._index(x, qr, rot, step, cache)
        if self.role.kind != WINDOW:
            comp = cache.compressed[self.role.kv_source]
            rows = step.picked_rows(cache, self.role.ratio)
        out = self.attend(q, kv, comp, rows, step, cache)
        if not early:  # after attending: a run's latents may overwrite rows its first tokens read
            ring[0].index_copy_(0, ring[1], kv)
        return self.output(out, rot)

    def project(self, x: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor], inputs=None,
                ring=None):  # fmt: skip
        """(qr, q, kv) of ``x``: the queries' low rank as the linears after it read it (``wq_b``
        and the indexer's), the rotated queries and the window latents (also written to
        ``ring``: (the ring rows, each token's row), if given)."""
        q_low, kv_low = self.low_ranks(quant.shared_input(x, inputs))
        qr = quant.normed_input(q_low, self.q_norm)
        return qr, self.queries(qr, rot), self._window_latents(kv_low, rot, ring)

    def low_ranks(self, xs) -> tuple[torch.Tensor, torch.Tensor]:
        """``wq_a``'s and ``wkv``'s products of one input (``shared_input``'s): on a GPU in one
        launch over their weights stacked at the first use (each a view of the stack after; a
        weight replaced since, by a load or a move, is stacked again); else one each."""
        a, b = self.wq_a, self.wkv
        if isinstance(xs, torch.Tensor) or len(a.weight) % 32:  # whole scale blocks only
            return a(xs), b(xs)
        w, scale = self.low_stack or (None, None)
        if (
            w is None
            or a.weight.data_ptr() != w.data_ptr()
            or b.weight.data_ptr() != (w[len(a.weight) :].data_ptr())
        ):
            w, scale = self.low_stack = quant.stack_outputs(a, b)
        from engramrt.kernels.stored_linear import stored_linear

        return stored_linear(xs, w, scale, False).split([len(a.weight), len(b.weight)], -1)

    def queries(self, qr: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return rope_quant(self.wq_b(qr).unflatten(-1, (self.heads, self.head_dim)), rot)

    def latents(self, x: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor], ring=None):
        """The window latents (K and V) ``[T, D]``: rotated, FP8 round-tripped (and written to
        ``ring``, as ``project``)."""
        return self._window_latents(self.wkv(x), rot, ring)

    def _window_latents(self, low: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor], ring):
        at = ring or (None, None)
        return rope_quant(low, rot, ACT, cache=at[0], rows=at[1], norm=self.kv_norm)

    def output(self, out: torch.Tensor, rot: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """Rotated back, through the grouped ``wo_a`` and ``wo_b`` (all-reduced under TP)."""
        o = rope_quant(out, rot, inverse=True).flatten(1).unflatten(-1, (self.groups, -1))
        u = quant.grouped_linear(o, self.wo_a, self.groups)
        y = self.wo_b(u.flatten(1))
        return y if self.tp.solo else self.tp.all_reduce(y.float()).to(y.dtype)

    def _compress(self, x: torch.Tensor, step: StepRuns, cache: V41Cache) -> None:
        """A source's compressed entries and index keys of the groups its tokens close."""
        r, i = self.role.ratio, self.layer_id
        pos = step.pos
        latent = self.compressor(
            x,
            pos > step.p0,
            cache.tail.get(i),
            *(step.tail_rows(cache) if r == 2 else (None, None)),
        )
        at = step.rotation(self.rope_key, r - 1)  # RoPE at the group's first position
        rows = step.closing_rows(cache, r)
        self.indexer.write_keys(latent, at, cache.index_keys[i], rows)
        rope_quant(latent, at, quant.E4M3_SCALE, cache=cache.compressed[i], rows=rows)

    def _index(self, x, qr, rot, step: StepRuns, cache: V41Cache) -> None:
        """Publish each token's top-k entries of the index source's keys (and, at the candidate
        source, its candidate blocks): ``step.topk`` [T, k], -1 where none."""
        role, dev, r = self.role, x.device, self.role.ratio
        count = step.max_end // r  # entries some token of the step may see
        if count == 0:
            step.topk = torch.full((len(x), 0), -1, dtype=torch.int64, device=dev)
            return
        q, w = self.indexer.queries(x, qr, rot)
        keys = cache.index_keys[role.index_source]
        picks, cands = [], []
        for c in step.chunks():
            seen = (step.pos[c] + 1) // r
            if use_triton(dev):  # keys read through the block tables, no copy in memory
                from engramrt.kernels.index_scores import index_scores

                scores = index_scores(
                    q[c],
                    w[c],
                    keys,
                    step.tables,
                    step.req[c],
                    step.pos[c],
                    r,
                    cache.block_size,
                    count,
                )
            else:
                entries = torch.arange(count, device=dev)
                rows = cache.entry_rows(step.tables, step.req[c], entries.expand(len(seen), -1), r)
                scores = self.indexer.scores(q[c], w[c], take_rows(keys, rows))
                scores = scores.masked_fill(entries >= seen.unsqueeze(-1), -math.inf)
            allowed = None
            if role.builds_candidates:
                cands.append(self.indexer.candidates(scores, seen))
            elif role.candidates_from is not None:
                allowed = step.candidates[c]
            picks.append(self.indexer.select(scores, seen, allowed))
        if cands:
            step.candidates = cands[0] if len(cands) == 1 else torch.cat(cands)
        step.topk = picks[0] if len(picks) == 1 else torch.cat(picks)  # (a decode: one chunk)

    def attend(self, q, kv, comp, rows, step: StepRuns, cache: V41Cache) -> torch.Tensor:
        """Each query over its window (positions ``p - window + 1 .. p``, this run's latents
        from ``kv``, earlier ones from the ring) and the rows ``rows`` [T, k] of ``comp`` (-1:
        none; None: no such rows): fp32 scores, the sink's ``exp`` in the denominator only,
        probabilities in the activation dtype (as the reference's kernel casts them) before
        they weigh the rows."""
        w, dev = self.window, q.device
        ring = cache.window[self.layer_id].view(-1, self.head_dim)
        if use_triton(dev):  # the same, one launch, no rows gathered into memory
            from engramrt.kernels.sparse_attention import sparse_attention

            return sparse_attention(
                q,
                kv,
                ring,
                comp,
                rows,
                step.pos,
                step.p0,
                step.q0,
                step.slot,
                self.attn_sink,
                self.softmax_scale,
                w,
                cache.ring_len,
            )
        out = torch.empty_like(q)
        span = torch.arange(w, device=dev)
        for c in step.chunks():
            pos, p0 = step.pos[c, None], step.p0[c, None]
            at = (pos - w + 1).clamp_min(0) + span  # [m, W]: oldest first, past ``pos`` unseen
            seen = at <= pos
            here = step.q0[c, None] + (at - p0)  # this run's rows
            ring_rows = step.slot[c, None] * cache.ring_len + at % cache.ring_len
            both = torch.where(
                (at >= p0).unsqueeze(-1),
                take_rows(kv, here.clamp(0, len(kv) - 1)),
                take_rows(ring, ring_rows),
            )
            if rows is not None:
                both = torch.cat([both, take_rows(comp, rows[c].clamp_min(0))], dim=1)
                seen = torch.cat([seen, rows[c] >= 0], dim=1)
            # rows it cannot see are zeros, as the kernel loads them: a stale row (an earlier
            # owner's ring or blocks) holding NaN would make its 0 weight NaN
            both = both.masked_fill(~seen.unsqueeze(-1), 0)
            s = torch.einsum("mhd,mrd->mhr", q[c].float(), both.float()) * self.softmax_scale
            s = s.masked_fill(~seen[:, None, :], -math.inf)
            top = s.amax(-1, keepdim=True).clamp_min(NO_SCORE)
            p = torch.exp(s - top)
            denom = p.sum(-1) + torch.exp(self.attn_sink.float() - top.squeeze(-1))
            o = torch.einsum("mhr,mrd->mhd", p.to(q.dtype).float(), both.float())
            out[c] = (o / denom.unsqueeze(-1)).to(q.dtype)
        return out
