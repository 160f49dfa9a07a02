"""DeepSeek-V4.1's DSpark draft stages (``mtp.*``; restated in
``tests/model/test_dspark_reference.py``): a block of
``dspark_block_size`` tokens drafted in one pass from the target's own features.

- **Features.** Each target forward keeps, at the input of each ``dspark_target_layer_ids``
  layer (after its Engram, before its mixes), the mean of the hc copies; ``main_x =
  main_norm(main_proj(their concatenation))``. Every stage writes its window latent of
  ``main_x`` into its own ring at the token's position (``seed``): the stages' rings hold the
  target's past, never a draft's.
- **Draft** at a request's last accepted position ``p`` (``draft``): the block ``[the token
  sampled after p, noise id, ...]`` sits at positions ``p + 1 ..``, embedded with the shared
  embedding, through the stages (full lagged-mHC blocks without Engram); each block query
  attends over the ring's positions ``p - window + 1 .. p`` (oldest first) and every row of its
  block (non-causal), with the sink. The head is the model's, after the last stage's own norm;
  the Markov head adds, position by position, logits of the previous token (the sampled one,
  then each draft), and each draft is their argmax (greedy: a draft is a point mass, so any
  choice keeps the verified output exact). The confidence head scores each position.

Rollback needs nothing: a verify run writes ring rows at positions past the accepted one, which
no later draft's window reaches before they are written again (rings of ``window + K`` rows,
``engramrt.models.deepseek_v41.cache``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engramrt.kernels import use_triton
from engramrt.model.layers import RMSNorm
from engramrt.model.mhc import collapse_norm, hc_pre
from engramrt.models.deepseek_v41.attention import StepRuns, V41Attention, angles_at
from engramrt.models.deepseek_v41.cache import V41Cache
from engramrt.models.deepseek_v41.quant import StoredLinear


@dataclass
class Drafts:
    tokens: torch.Tensor  # [B, block] the drafts
    logits: torch.Tensor  # [B, block, V] fp32, with the Markov bias
    confidence: torch.Tensor | None  # [B, block] fp32 (None: not asked for)


@dataclass
class DraftContext:
    """What a stage's block reads in a draft pass (in place of a target step's
    ``ForwardContext``): the block queries' positions and window ends, the cache."""

    kv: V41Cache
    runs: StepRuns  # per query: ``pos`` = its window's end p, ``slot``, ``real``
    positions: torch.Tensor  # [N] the query's own position (p + 1 + i)
    rows: torch.Tensor  # [N, block] the rows of the query's block
    tracer = None
    step_cache: dict = field(default_factory=dict)

    def trace(self, *args) -> None:
        pass


@dataclass
class BlockConstants:
    """What a draft pass of ``B`` blocks of ``k`` indexes by, the same every pass."""

    owner: torch.Tensor  # [B * k] each query's block
    offsets: torch.Tensor  # [B * k] its place in the block
    rows: torch.Tensor  # [B * k, k] the rows of its block
    zeros: torch.Tensor  # [B * k]
    ones: torch.Tensor  # [B * k] bool
    noise: torch.Tensor  # [B, k - 1] the noise id, every block's tail


_CONSTANTS: dict[tuple, BlockConstants] = {}


def block_constants(b: int, k: int, noise: int, dev: torch.device) -> BlockConstants:
    """Built once a shape and kept (a CUDA graph then reads them instead of ~15 nodes building
    them); never kept from inside a capture, where they would hold nothing until a replay."""
    key = b, k, noise, dev
    if key in _CONSTANTS:
        return _CONSTANTS[key]
    owner = torch.arange(b, device=dev).repeat_interleave(k)
    offsets = torch.arange(k, device=dev).repeat(b)
    const = BlockConstants(
        owner,
        offsets,
        (owner * k)[:, None] + torch.arange(k, device=dev),
        torch.zeros_like(owner),
        torch.ones_like(owner, dtype=torch.bool),
        torch.full((b, k - 1), noise, dtype=torch.long, device=dev),
    )
    if not (dev.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _CONSTANTS[key] = const
    return const


class DSparkAttention(V41Attention):
    """Ratio-0 window attention over the target's latents (``seed``) and the draft block."""

    def seed(self, main_x: torch.Tensor, step: StepRuns, cache: V41Cache) -> None:
        ring = cache.window[self.layer_id].view(-1, self.head_dim), step.ring_rows(cache)
        self.latents(main_x, step.rotation(self.rope_key), ring)

    def forward(self, x: torch.Tensor, ctx: DraftContext, inputs=None) -> torch.Tensor:
        angles = angles_at(ctx.positions, self.rope_key)
        rot = angles.cos(), angles.sin()
        _, q, kv = self.project(x, rot, inputs)
        out = self.attend(q, kv, kv, ctx.rows, ctx.runs, ctx.kv)
        return self.output(out, rot)


class MarkovHead(nn.Module):
    """A rank-``r`` bigram: the previous token's embedding through its own head."""

    def __init__(self, vocab: int, rank: int, dtype: torch.dtype):
        super().__init__()
        self.embed = nn.Embedding(vocab, rank, dtype=dtype)
        self.head = nn.Linear(rank, vocab, bias=False, dtype=torch.float32)


class ConfidenceHead(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, 1, bias=False, dtype=torch.float32)


def stage_parts(block: nn.Module, cfg, stage: int, dtype: torch.dtype) -> None:
    """A stage's pieces beside its block: the first's feature projection, the last's norm,
    Markov and confidence heads (checkpoint names ``mtp.{s}.main_proj`` ...)."""
    v = cfg.body
    if stage == 0:
        block.main_proj = StoredLinear(v.dim, v.dim * len(v.dspark_target_layer_ids))
        block.main_norm = RMSNorm(v.dim, v.norm_eps, dtype)
    if stage == v.n_mtp_layers - 1:
        block.norm = RMSNorm(v.dim, v.norm_eps, dtype)
        block.markov_head = MarkovHead(cfg.vocab_size, v.dspark_markov_rank, dtype)
        block.confidence_head = ConfidenceHead(v.dim + v.dspark_markov_rank)


def seed(model, ctx) -> None:
    """Every stage's ring rows of this step's tokens, from the target features its blocks kept
    (``ctx.step_cache["features"]``)."""
    feats = ctx.step_cache["features"]
    first = model.mtp[0]
    hidden = torch.cat([feats[i] for i in model.cfg.body.dspark_target_layer_ids], dim=-1)
    main_x = first.main_norm(first.main_proj(hidden))
    step = StepRuns.of(ctx)
    for stage in model.mtp:
        stage.attn.seed(main_x, step, ctx.kv)


def draft(
    model,
    cache: V41Cache,
    ends: torch.Tensor,
    slots: torch.Tensor,
    tokens: torch.Tensor,
    limit: int | None = None,
    targets: torch.Tensor | None = None,
    confidence: bool = True,
) -> Drafts:
    """One draft pass for ``B`` requests: ``ends`` [B] each one's last accepted position,
    ``slots`` [B], ``tokens`` [B] the token sampled after it; no draft at or past ``limit``
    (the tokenizer's size: DeepSeek pads its vocabulary, and the sampler never draws there).
    ``targets`` [B, block] (training, teacher forcing): the true tokens the drafts stand for,
    which the Markov head takes as the previous tokens in place of the drafts. ``confidence``:
    score each draft (training; the verifier reads only the tokens)."""
    v = model.cfg.body
    b, k, dev = len(tokens), v.dspark_block_size, tokens.device
    const = block_constants(b, k, v.dspark_noise_token_id, dev)
    ids = torch.cat([tokens[:, None], const.noise], dim=1)
    p = ends[const.owner]
    q = p + 1
    runs = StepRuns(p, q, const.zeros, q, slots[const.owner], const.ones, const.owner, None, 0)
    ctx = DraftContext(cache, runs, q + const.offsets, const.rows)
    x, pre = model.embed_tokens(ids.flatten())
    for stage in model.mtp:
        x, pre = stage(x, pre, ctx)
    last = model.mtp[-1]
    logits = model.project(collapse_norm(x, pre, last.norm.weight, last.norm.eps))
    logits = logits.unflatten(0, (b, k))
    markov = last.markov_head
    if use_triton(dev):  # one launch a position
        from engramrt.kernels.markov_drafts import markov_drafts

        out = markov_drafts(logits, tokens, markov.embed.weight, markov.head.weight, limit, targets)
    else:
        out = markov_loop(logits, tokens, markov, limit, targets)
    score = None
    if confidence:  # each position's previous token, as the Markov head took it
        prevs = torch.cat([tokens[:, None], (out if targets is None else targets)[:, :-1]], 1)
        both = torch.cat([hc_pre(x, pre).unflatten(0, (b, k)), markov.embed(prevs)], dim=-1)
        score = last.confidence_head.proj(both.float()).squeeze(-1)
    return Drafts(out, logits, score)


def markov_loop(
    logits: torch.Tensor,
    tokens: torch.Tensor,
    markov: MarkovHead,
    limit: int | None,
    targets: torch.Tensor | None,
) -> torch.Tensor:
    """The Markov bias of the previous token added to ``logits`` [B, k, V] position by position,
    then ids at or past ``limit`` set to ``-inf`` (after the bias, so that a NaN bias there is
    never drafted) and the argmax taken (a NaN the largest, the first one winning): the drafts
    [B, k] (the reference of ``kernels.markov_drafts``)."""
    prev, out = tokens, []
    for i in range(logits.shape[1]):
        logits[:, i] += torch.nn.functional.linear(markov.embed(prev).float(), markov.head.weight)
        if limit is not None:
            logits[:, i, limit:] = float("-inf")
        out.append(logits[:, i].argmax(-1))
        prev = out[-1] if targets is None else targets[:, i]
    return torch.stack(out, 1)
