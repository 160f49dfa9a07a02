"""Token sampling with per-request parameters, on the stage that holds the logits.

Each row carries its own temperature, top-k, top-p, min-p and optional seed. A seeded row draws
its noise from a generator keyed by (seed, token index), so a request's samples do not depend on
its batch neighbours or on how its steps were scheduled. Logprobs are of the raw model
distribution (before temperature and truncation), as vLLM reports them, and are computed once.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import replace

import torch

from engramrt.runner.batch import DeviceResult, SampleRow, StepBatch, StepResult
from engramrt.runner.logit_controls import LogitControls
from engramrt.runner.slots import SlotTable
from engramrt.transfer import to_device

_SEED_STRIDE = 1_000_003
GREEDY_BELOW = 1e-5


def _to(values: list, device: torch.device, dtype=torch.int64) -> torch.Tensor:
    """Host values on ``device`` without waiting for the work queued there."""
    return to_device(torch.tensor(values, dtype=dtype), device)


def _columns(rows: list[SampleRow], device: torch.device) -> torch.Tensor:
    """``[n, 4]`` (temperature, top_p, min_p, top_k) of host rows, in one copy."""
    values = [[r.temperature, r.top_p, r.min_p, float(r.top_k)] for r in rows]
    return _to(values, device, torch.float32).view(-1, 4)


def _filtered_probs(
    logits: torch.Tensor, rows: list[SampleRow], params: torch.Tensor
) -> torch.Tensor:
    """Temperature, then top-k, min-p and top-p truncation, each row with its own values
    (``params``: the rows' ``[n, 4]`` columns on the device; ``rows`` decide on the host which
    truncations any row asks for)."""
    vocab = logits.shape[-1]
    probs = torch.softmax(logits.float() / params[:, 0:1], dim=-1)
    ks = [r.top_k if r.top_k < vocab else 0 for r in rows]
    if any(ks):
        k = params[:, 3:4].to(torch.int64)
        k = k.masked_fill(k >= vocab, 0)
        kth = probs.topk(max(ks), dim=-1).values.gather(1, (k - 1).clamp(min=0))
        probs = probs.masked_fill((k > 0) & (probs < kth), 0.0)
    if any(r.min_p > 0 for r in rows):
        floor = params[:, 2:3] * probs.max(-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    if any(r.top_p < 1 for r in rows):
        top_p = params[:, 1:2]
        sorted_p, order = probs.sort(dim=-1, descending=True)
        outside = sorted_p.cumsum(-1) - sorted_p >= top_p * sorted_p.sum(-1, keepdim=True)
        outside &= top_p < 1  # the top one always stays; rows without top-p keep everything
        probs = probs.scatter(1, order, sorted_p.masked_fill(outside, 0.0))
    return probs


def sample_tokens(
    logits: torch.Tensor, rows: list[SampleRow], generator: torch.Generator | None
) -> list[int]:
    """``logits [B, V]`` -> one token per row: argmax for greedy rows, else argmax of
    probs / Exp(1) noise. Batched on the logits' device: greedy rows move nothing but the tokens
    read back at the end; sampled rows add a few small parameter copies."""
    return sample_tokens_device(logits, rows, generator).tolist() if rows else []


def sample_tokens_device(
    logits: torch.Tensor,
    rows: list[SampleRow],
    generator: torch.Generator | None,
    params_of: Callable[[list[int]], torch.Tensor] | None = None,
) -> torch.Tensor:
    """``sample_tokens`` left on the device: ``[B]`` int64, nothing read back. ``params_of``
    gives the device columns of the rows at the given indices (default: copied from ``rows``;
    the sampler gathers them by slot)."""
    tokens = logits.argmax(-1)
    hot = [i for i, r in enumerate(rows) if r.temperature >= GREEDY_BELOW]  # vanishing: argmax
    if hot:
        dev = logits.device
        hot_at = _to(hot, dev) if len(hot) < len(rows) else slice(None)
        hot_rows = [rows[i] for i in hot]
        params = params_of(hot) if params_of is not None else _columns(hot_rows, dev)
        probs = _filtered_probs(logits[hot_at], hot_rows, params)
        noise = torch.empty_like(probs)
        unseeded = [j for j, i in enumerate(hot) if rows[i].seed is None]
        if unseeded:
            at = _to(unseeded, dev)
            noise[at] = torch.empty_like(probs[at]).exponential_(generator=generator)
        for j, i in enumerate(hot):
            row = rows[i]
            if row.seed is not None:
                gen = torch.Generator(device=logits.device)
                gen.manual_seed((row.seed * _SEED_STRIDE + row.index) % 2**63)
                noise[j].exponential_(generator=gen)
        tokens[hot_at] = (probs / noise).argmax(-1)
    return tokens


def apply_token_masks(logits: torch.Tensor, masks: list[tuple[int, list[int]]]) -> torch.Tensor:
    """``-inf`` for every token a row's grammar does not allow: ``masks`` are (row, int32 words,
    token t being bit t % 32 of word t // 32); ids past the mask's width are not allowed."""
    dev, vocab = logits.device, logits.shape[-1]
    rows = _to([r for r, _ in masks], dev)
    words = _to([w for _, w in masks], dev, torch.int32)  # [n, W]
    bits = (words[:, :, None] >> torch.arange(32, device=dev, dtype=torch.int32)) & 1
    allowed = bits.flatten(1).bool()[:, :vocab]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    out = logits.clone()
    out[rows] = logits[rows].masked_fill(~allowed, float("-inf"))
    return out


def token_logprobs_device(
    logits: torch.Tensor, targets: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probability of ``targets[i]`` under row i, and the row's top ``k``, on the device:
    ``[B]``, ``[B, k]`` and ``[B, k]``."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    picked = lp.gather(1, to_device(targets.to(torch.int64), lp.device)[:, None])[:, 0]
    top = lp.topk(min(k, lp.shape[-1]), dim=-1)
    return picked, top.indices, top.values


def sample(
    logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None
) -> torch.Tensor:
    """One set of parameters for every row of ``logits [B, V]``."""
    row = SampleRow(temperature, top_p)
    row.validate()
    return torch.tensor(sample_tokens(logits, [row] * logits.shape[0], generator))


def _samples(batch: StepBatch, run_rows: list[SampleRow]):
    """Where each sample's logits are (``ends``: a row per token with full logits, else a row
    per sample) and its run's row, slot and length, and which run it is: one sample per run, or
    with drafts one after each of a run's last ``1 + drafts`` tokens (their token indices
    counted on for seeded noise). ``run_rows``: each run's sampling row."""
    if batch.drafts is None:
        n = len(batch.run_lens)
        if batch.full_logits:  # a row per token: each run's is its last
            ends = (torch.tensor(batch.run_lens, dtype=torch.int64).cumsum(0) - 1).tolist()
        else:
            ends = list(range(n))
        return ends, run_rows, batch.slots, batch.run_lens, range(n)
    tails = batch.tails
    if batch.full_logits:
        ends = [
            e - t + 1 + j
            for e, t in zip(itertools.accumulate(batch.run_lens), tails, strict=True)
            for j in range(t)
        ]
    else:
        ends = list(range(batch.num_samples))
    owner = [b for b, t in enumerate(tails) for _ in range(t)]
    # the output index keys a seeded row's noise (a run with drafts has no logit controls)
    rows = [
        replace(r, index=r.index + j) if j and r.seed is not None else r
        for r, t in zip(run_rows, tails, strict=True)
        for j in range(t)
    ]
    return (ends, rows, [batch.slots[b] for b in owner], [batch.run_lens[b] for b in owner], owner)


class Sampler:
    """The last stage's sampler: one token per request from the logits of its last token this
    step, the logprobs the batch asked for, and the prompt-token scores of ``targets``.
    ``token_limit`` masks head rows past the tokenizer (DeepSeek pads its vocab), so a padding
    id is never sampled or reported. ``seed`` drives the rows that carry no seed of their own."""

    def __init__(self, slots: SlotTable, seed: int = 0, token_limit: int | None = None):
        self.slots = slots  # the stage's: sampling parameters and logit controls by slot
        self.generator = torch.Generator(device=slots.device).manual_seed(seed)
        self.token_limit = token_limit

    @property
    def controls(self) -> LogitControls:
        return self.slots.controls

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, batch: StepBatch) -> StepResult:
        """Sample and wait for the result (a later pipeline stage, a synchronous step)."""
        return self.launch(logits, batch)[0].wait()

    @torch.inference_mode()
    def launch(self, logits: torch.Tensor, batch: StepBatch) -> tuple[DeviceResult, torch.Tensor]:
        """Sample on the device and start copying the results to the host: the pending result,
        and the sampled tokens on the device (``[B]``, -1 for an empty run). Nothing here waits
        on the GPU. ``logits`` may be a CUDA graph's output, so anything kept past this step is
        a copy."""
        ends, rows, slots, run_lens, owner = _samples(batch, self.slots.rows(batch))
        live = [i for i, n in enumerate(run_lens) if n > 0]
        asked = [r.logprobs for r in rows if r.logprobs is not None]
        limit, k = self.token_limit, max(asked) if asked else None
        if batch.return_logits or batch.targets is not None or k is not None:
            logits = logits.clone()  # kept or scored whole: mask every row
            if limit is not None:
                logits[:, limit:] = float("-inf")
        rows_at = [ends[i] for i in live]
        if rows_at == list(range(len(rows_at))):  # decode: no index to copy to the device
            last = logits[: len(rows_at)].clone()
        else:
            last = logits[_to(rows_at, logits.device)]  # a copy
        # NaN or infinity in a row the model computed (a broken weight, an overflow): its
        # request ends with an error. Found on the device and copied back with the tokens,
        # so no step waits for it
        finite = torch.isfinite(last[:, :limit]).all(-1)
        if limit is not None:
            last[:, limit:] = float("-inf")
        live_slots = [slots[i] for i in live]
        controlled = self.controls.apply(last, live_slots, [rows[i].index for i in live])
        base = last  # what a row falls back to when its controls leave no token allowed
        if batch.masks:  # the grammar's mask (a guided run has no drafts): both ways
            at = {owner[i]: j for j, i in enumerate(live)}  # request -> its sampled row
            masks = [(at[row], words) for row, words in batch.masks]
            base, controlled = apply_token_masks(last, masks), apply_token_masks(controlled, masks)
        if controlled is not last:
            dead = torch.isinf(controlled).all(-1, keepdim=True)
            controlled = torch.where(dead, base, controlled)
        last = controlled
        live_rows = [rows[i] for i in live]
        sampled = sample_tokens_device(
            last,
            live_rows,
            self.generator,
            lambda at: self.slots.gather([live_slots[j] for j in at]),
        )
        self.controls.count(live_slots, [rows[i].final for i in live], sampled)
        if len(live) == len(rows):
            tokens = sampled
        else:
            at, live_finite = _to(live, logits.device), finite
            tokens = torch.full((len(rows),), -1, dtype=torch.int64, device=logits.device)
            tokens[at] = sampled
            finite = torch.ones(len(rows), dtype=torch.bool, device=logits.device)
            finite[at] = live_finite  # an empty run samples nothing
        parts = {"tokens": tokens, "finite": finite}
        if k is not None:  # rows of empty runs are scored on row 0 and ignored by the engine
            picked = [ends[i] if run_lens[i] else 0 for i in range(len(rows))]
            parts["logprobs"], parts["top_ids"], parts["top_logprobs"] = token_logprobs_device(
                logits[_to(picked, logits.device)], tokens.clamp(min=0), k
            )
        if batch.targets is not None:
            targets = torch.tensor(batch.targets).clamp(min=0)
            lp, ids, tops = token_logprobs_device(logits, targets, batch.target_k)
            parts["target_logprobs"], parts["target_top_ids"] = lp, ids
            parts["target_top_logprobs"] = tops
        pending = DeviceResult(parts, logits if batch.return_logits else None, batch.targets)
        return pending, tokens
