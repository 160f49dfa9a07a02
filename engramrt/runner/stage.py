"""One process's stage of the model: its layers, their KV cache, on the first stage the Engram
hasher (which owns the n-gram history), on the last the sampler. ``run`` executes one step.

The first stage hashes once where the token ids are and embeds; every other stage starts from
what the previous one handed over (``Carry``) and refuses to run without it. Which stage a
process is changes where the stream comes from and where it goes, never what a layer does
(ARCHITECTURE.md, "one layer-entry path"). Eager steps and CUDA-graph replays run the same
``forward``.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from tokenizers import Tokenizer

from engramrt import tensor_parallel
from engramrt.engram import load_hasher, load_tokenizer, prefetch
from engramrt.engram.hashing import EngramHasher
from engramrt.engram.host_memory import check_reads, choose_placement, describe
from engramrt.kernels import use_triton
from engramrt.kernels.row_invariant import row_invariant
from engramrt.model.checkpoint import engram_table_bytes, load_model
from engramrt.model.context import ForwardContext, PagedCache
from engramrt.model.decoder import EngramMHCModel
from engramrt.model.trace import Tracer
from engramrt.runner.batch import DeviceResult, SampleRow, StepBatch, StepResult
from engramrt.runner.carry import Carry
from engramrt.runner.graphs import StepGraphs, batch_sizes
from engramrt.runner.images import ImageSpans
from engramrt.runner.kv_budget import MemoryProfile
from engramrt.runner.sampler import Sampler, sample_tokens
from engramrt.runner.slots import SlotTable
from engramrt.runner.verify import Verifier, ngram_drafts
from engramrt.tensor_parallel import TensorParallel
from engramrt.transfer import to_device


def new_kv_cache(
    model: EngramMHCModel,
    num_slots: int,
    max_len: int | None = None,
    block_size: int = 16,
    num_blocks: int | None = None,
    snapshots: int | None = None,
    slack: int = 0,
) -> PagedCache:
    """Enough blocks for ``num_slots`` sequences of ``max_len`` unless ``num_blocks`` says;
    ``snapshots``: V4.1's window snapshots for prefix caching (default: the family's);
    ``slack``: the drafts a verify run may carry (V4.1's rings and tails make room for them)."""
    cfg = model.cfg
    max_len = max_len or cfg.max_position_embeddings
    if max_len > cfg.max_position_embeddings:
        raise ValueError(
            f"{max_len} tokens exceed the model's max_position_embeddings "
            f"({cfg.max_position_embeddings})"
        )
    if num_blocks is None:
        num_blocks = num_slots * -(-max_len // block_size)
    return cfg.family.new_cache(model, num_blocks, block_size, max_len, num_slots, snapshots, slack)


@dataclass
class StageRunner:
    model: EngramMHCModel
    hasher: EngramHasher | None  # the first stage's: hashing and the history table
    kv: PagedCache | None
    tokenizer: Tokenizer | None = None
    seed: int = 0  # drives the sampled rows that carry no seed of their own
    tracer: Tracer | None = None
    # runs of each Engram layer so far: a count, so a long-running server's memory stays flat
    engram_ran: Counter[int] = field(default_factory=Counter)
    graphs: StepGraphs | None = None
    # speculative decoding's device half (``speculate``; None: no speculation, or the host's)
    verifier: Verifier | None = None
    sampler: Sampler | None = field(init=False, default=None)  # the last stage's
    # what the request in each slot leaves on this stage (``engramrt.runner.slots``)
    slots: SlotTable = field(init=False)
    # reads the host tables' rows ahead at forward entry (CUDA, host tables; None: off)
    prefetcher: prefetch.Prefetch | None = field(init=False, default=None)
    images: ImageSpans | None = field(init=False, default=None)  # the first stage's

    def __post_init__(self) -> None:
        if self.device.type == "cuda" and prefetch.host_engrams(self.model):
            self.prefetcher = prefetch.Prefetch(self.model, self.device)
        self.slots = SlotTable(self.device, self.hasher, self.model.head is not None, self.is_first)
        if self.is_first:
            self.images = ImageSpans(self.model, self.device)
        if self.kv is not None:
            self.slots.size_for(self.kv)
        if self.model.head is not None:
            tok = self.tokenizer
            limit = tok.get_vocab_size(with_added_tokens=True) if tok is not None else None
            self.sampler = Sampler(self.slots, self.seed, limit)

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        num_slots: int = 1,
        max_len: int | None = None,
        device: str | torch.device = "cpu",
        dtype: str | torch.dtype | None = None,
        layer_ids: list[int] | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
        seed: int = 0,
        table_memory: str = "device",
        tp: TensorParallel | None = None,
        dspark: bool = False,
    ) -> StageRunner:
        """``num_blocks=0`` loads without a KV cache (``allocate_kv`` gives it one later).
        ``table_memory``: where the Engram tables live (``auto``, ``device``, ``host``;
        ``engramrt.engram.host_memory``); said in a log line when the stage has any. ``tp``:
        this rank's slice of its stage (default: this process's place, ``tensor_parallel.current``);
        only the leader of the first stage hashes. ``dspark``: with V4.1's DSpark stages, which
        ``draft`` runs."""
        tp = tp or tensor_parallel.current()
        placement = table_memory
        if table_memory == "auto":
            size = engram_table_bytes(model_dir, layer_ids) // tp.size
            placement = choose_placement(table_memory, size, device)
        model = load_model(model_dir, dtype, device, layer_ids, placement, tp, dspark)
        tables = [model.layers[str(i)].engram.embed for i in model.engram_layer_ids]
        if tables:
            # a log line: stderr, so that what a command prints (generated text, reports)
            # stays its output
            print(
                f"engramrt: {describe(tables, str(torch.device(device)))}",
                file=sys.stderr,
                flush=True,
            )
        if placement == "host" and use_triton(device):
            for table in tables:
                check_reads(table, device)
        if model.layer_ids[0] == 0 and tp.rank == 0:  # the first stage hashes (its leader)
            hasher, tokenizer = load_hasher(model_dir, num_slots, device)
        else:
            hasher, tokenizer = None, load_tokenizer(model_dir)
        runner = cls(model, hasher, None, tokenizer, seed)
        if num_blocks != 0:
            runner.allocate_kv(num_slots, max_len, block_size, num_blocks)
        return runner

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def is_first(self) -> bool:
        """Takes token ids (embeds them); its TP leader also hashes them."""
        return self.model.layer_ids[0] == 0

    @property
    def is_last(self) -> bool:
        return self.sampler is not None

    @property
    def keeps_samples(self) -> bool:
        """Samples where it embeds (one stage of one rank): each final sample goes into its
        slot's token row on the device, and the next step reads it there (overlap scheduling:
        the host need not have seen it)."""
        return self.is_first and self.is_last and self.model.tp.solo

    def allocate_kv(
        self,
        num_slots: int,
        max_len: int | None,
        block_size: int,
        num_blocks: int | None,
        snapshots: int | None = None,
        slack: int = 0,
    ) -> None:
        self.kv = self.verifier = None  # the old cache goes before the new one is allocated
        self.kv = new_kv_cache(
            self.model, num_slots, max_len, block_size, num_blocks, snapshots, slack
        )
        self.slots.size_for(self.kv, slack)

    def speculate(self, k: int, lookup: tuple[int, int] | None = None) -> None:
        """Verify up to ``k`` drafts a run on the device (``engramrt.runner.verify``), after
        ``allocate_kv`` (its ``slack`` at least ``k``) and before ``capture_graphs``: on the
        last stage, with DSpark's drafts where the model has its stages, else where this stage
        keeps the token rows with n-gram drafts (``lookup``: the longest and shortest suffix)
        looked up there. Elsewhere the host drafts and commits (pipeline parallelism)."""
        if self.graphs is not None:  # their buffers were laid out without the lag flags
            raise RuntimeError("speculate before capture_graphs")
        if not self.is_last or self.kv is None:
            return
        rows = self.slots.tokens if self.keeps_samples else None
        if self.model.mtp is not None:
            limit, family = self.sampler.token_limit, self.model.cfg.family

            def propose(last, slots, bonus):
                return family.draft(
                    self.model, self.kv, last, slots, bonus, limit, confidence=False
                ).tokens
        elif rows is not None and lookup is not None:

            def propose(last, slots, bonus):
                return ngram_drafts(rows, slots, last + 1, k, *lookup)
        else:
            return
        table = self.slots if rows is not None else None
        self.slots.states = [s for s in self.slots.states if s is not self.verifier]
        self.verifier = Verifier(self.kv.num_slots, k, propose, table, self.hasher, self.device)
        self.slots.states.append(self.verifier)

    def capture_graphs(self, max_batch: int, max_tokens: int = 0, verify: int = 0) -> None:
        """Capture decode steps up to ``max_batch`` requests, mixed steps up to ``max_tokens``
        tokens and verify steps of ``verify`` drafts a run (``StepGraphs``; CUDA only), within
        the family's ``capture_limit``."""
        limit = self.model.cfg.family.capture_limit(self.model, max_tokens)
        if limit is None:
            return
        max_tokens = limit
        if not use_triton(self.device):  # the torch reference attention is not capturable
            print("engramrt: CUDA graphs need the Triton kernels; decoding eagerly", flush=True)
            return
        if not self.model.tp.solo and dist.get_backend(self.model.tp.group) != "nccl":
            print(
                "engramrt: tensor parallelism over gloo cannot be captured in CUDA graphs; "
                "decoding eagerly",
                flush=True,
            )
            return
        carry_for = None if self.is_first else (lambda n: Carry.empty(self.model, n, torch.zeros))
        v = self.verifier
        self.graphs = StepGraphs(
            self.forward,
            self.kv,
            self.slots.blocks,
            self.device,
            max_batch,
            max_tokens,
            self.is_last,
            carry_for,
            verify,
            lagging=v is not None and v.rows is not None,
        )
        if v is not None:  # what follows the sampler (drafting included), by batch size
            v.capture(batch_sizes(min(max_batch, self.kv.num_slots)))

    @torch.inference_mode()
    def profile_memory(self, tokens: int, max_len: int, block_size: int, rows: int):
        """vLLM's sizing run: the largest batch the scheduler can form (``tokens`` prefill
        tokens in runs of at most ``max_len``, then the sampler at ``rows`` rows), on a cache
        just big enough; the memory figures it leaves (CUDA only). Leaves no cache and no
        history behind."""
        dev = self.device
        runs = [max_len] * (tokens // max_len) + ([tokens % max_len] if tokens % max_len else [])
        per_seq = -(-max_len // block_size)
        tables = [
            list(range(i * per_seq, i * per_seq + -(-n // block_size))) for i, n in enumerate(runs)
        ]
        self.allocate_kv(len(runs), max_len, block_size, len(runs) * per_seq)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(dev)
        carry = None if self.is_first else Carry.empty(self.model, tokens, torch.zeros)
        fake = [self.model.cfg.bos_token_id or 0] * tokens if self.is_first else None
        batch = StepBatch(fake, list(range(len(runs))), runs, [0] * len(runs), new_blocks=tables)
        logits = self.compute(batch, carry)
        if self.is_last:  # the sampler's temporaries at the largest batch
            n = min(tokens, rows)
            sample_tokens(logits[:n], [SampleRow(temperature=1.0, top_p=0.9)] * n, None)
        del logits
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev)
        cache_bytes = self.kv.nbytes
        self.kv = None
        if self.hasher is not None:
            self.hasher.history.table.zero_()  # the profile's history rows mean nothing
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(dev)
        return MemoryProfile(
            total=total,
            free=free,
            reserved=torch.cuda.memory_reserved(dev),
            weights=torch.cuda.memory_allocated(dev),
            peak=peak,
            profile_cache=cache_bytes,
            tokens=tokens,
        )

    @torch.inference_mode()
    def warm_up(self, max_tokens: int) -> None:
        """Compile, before the first request, every kernel variant a mixed step can need: Triton
        compiles on first use (~0.5 s a variant, paid by whichever request meets it), and the
        launch parameters depend on the step only through a few buckets (``warm_up_plan``);
        decode sizes are covered by graph capture, the rest by the family's ``warm_up``. Leaves
        no history behind (its KV rows are in blocks the engine has not handed out yet)."""
        if self.device.type != "cuda" or self.kv is None:
            return
        block = self.kv.block_size
        for runs in warm_up_plan(max_tokens, self.kv.num_slots, self.kv.max_len):
            ends = np.cumsum([-(-n // block) for n in runs])  # scratch blocks, reused each step
            if ends[-1] > self.kv.num_blocks:
                continue
            tables = [
                list(range(int(e) - -(-n // block), int(e)))
                for n, e in zip(runs, ends, strict=True)
            ]
            tokens = sum(runs)
            carry = None if self.is_first else Carry.empty(self.model, tokens, torch.zeros)
            fake = [self.model.cfg.bos_token_id or 0] * tokens if self.is_first else None
            slots = list(range(len(runs)))
            self.compute(StepBatch(fake, slots, runs, [0] * len(runs), new_blocks=tables), carry)
        self.model.cfg.family.warm_up(self.model)
        torch.cuda.synchronize(self.device)
        if self.hasher is not None:
            self.hasher.history.table.zero_()

    def run(self, batch: StepBatch, carry: Carry | None = None) -> Carry | StepResult:
        """One step on this stage: the ``Carry`` for the next stage, or on the last stage what
        it sampled."""
        out = self.launch(batch, carry)
        return out.wait() if isinstance(out, DeviceResult) else out

    @torch.inference_mode()
    def launch(self, batch: StepBatch, carry: Carry | None = None) -> Carry | DeviceResult:
        """``run`` without waiting for the sampled tokens: on the last stage a ``DeviceResult``.
        Where it ``keeps_samples``, they also go into the token rows, on the stream after the
        sampler; with speculation the verifier keeps what each run accepted and the next
        step's drafts, which the result carries too (``engramrt.runner.verify``)."""
        with self._invariant():
            v = self.verifier
            if v is not None and self._shape(batch, not batch.full_logits) is None:
                batch = v.settle(batch)  # an eager step: its runs' true starts, from the device
            out = self.compute(batch, carry, last_only=not batch.full_logits)
            if not self.is_last:
                return out
            pending, tokens = self.sampler.launch(out, batch)
            if v is not None:
                pending.add("drafts", v.after(batch, tokens))
            elif self.keeps_samples:
                self.slots.keep_samples(batch, tokens)
            return pending

    def _invariant(self) -> contextlib.AbstractContextManager:
        """On the CPU a token's numbers do not depend on its step's other tokens
        (``engramrt.kernels.row_invariant``): speculation and batching keep greedy output."""
        return row_invariant() if self.device.type == "cpu" else contextlib.nullcontext()

    def _shape(self, batch: StepBatch, last_only: bool):
        """The captured graph this step replays (None: it runs eagerly)."""
        if self.graphs is None:
            return None
        drafts = batch.drafts if batch.drafts is not None and any(batch.drafts) else None
        return self.graphs.shape_for(batch.run_lens, not last_only, self.tracer, drafts)

    @torch.inference_mode()
    def compute(
        self, batch: StepBatch, carry: Carry | None = None, last_only: bool = False
    ) -> torch.Tensor | Carry:
        """Logits ``[T, V]`` on the last stage (``last_only``: ``[B, V]``, at each run's last
        token, which is all sampling reads), else the ``Carry`` for the next stage. A step of a
        captured shape replays its graph; its outputs are then valid until the next step."""
        with self._invariant():
            return self._compute(batch, carry, last_only)

    def _compute(self, batch: StepBatch, carry: Carry | None, last_only: bool):
        if self.kv is None:
            raise RuntimeError("this stage has no KV cache (allocate_kv first)")
        if carry is None and not self.is_first:
            first = self.model.layer_ids[0]
            raise RuntimeError(
                f"the stage starting at layer {first} needs the stream, lagged pre-mix and "
                "hash ids of the previous stage and received none"
            )
        if self.hasher is not None:  # before admission: a slot's new owner rebuilds after
            self._commit_verified(batch.commits)
        self.slots.admit(batch.admitted, self.model.cfg.vocab_size)
        self.slots.advance(batch)
        images = None
        if self.images is not None:
            self.images.admit(batch.admitted)
            images = self.images.step(batch)
        # a step with image rows runs eagerly (a graph reads no such rows)
        graphs, shape = self.graphs, None if images is not None else self._shape(batch, last_only)
        drafts = batch.drafts if batch.drafts is not None and any(batch.drafts) else None
        lag = None
        if self.verifier is not None and self.verifier.rows is not None:
            lag = batch.lag or [0] * len(batch.slots)  # the graphs' buffers have the part
        ctx = ForwardContext.for_runs(
            batch.slots,
            batch.run_lens,
            batch.start_pos,
            self.kv,
            self.slots.blocks,
            "cpu" if shape else self.device,
            # a mixed graph's prefill kernel strides the table by its static width
            width=graphs.width if shape and not shape.decode else None,
            pad=shape,
            last_rows=shape is not None or (last_only and self.is_last),
            tracer=self.tracer,
            drafts=drafts,
            lag=lag,
        )
        ctx.images = images
        if shape is not None:
            out, ran = graphs.replay(ctx, shape, carry)
        else:
            out = self.forward(ctx, carry)
            ran = ctx.engram_ran
        self.engram_ran.update(ran)
        if batch.snapshots:
            self.kv.save_windows(batch.snapshots)
        return out

    def forward(self, ctx: ForwardContext, carry: Carry | None) -> torch.Tensor | Carry:
        """The step on device tensors only: what a CUDA graph captures. The first stage hashes
        once where the token ids are and embeds; runs behind a verify run in flight first move
        to where they start (``Verifier.shift``). What the step caches (``ctx.step_cache``) is
        computed anew: a graph's context is forwarded at its warm-up and again at its capture,
        with another step in it (the capture once moved lagging runs by the warm-up's table)."""
        ctx.step_cache.clear()
        if self.verifier is not None:
            self.verifier.shift(ctx)
        if carry is None:
            t = self.slots.token_ids(ctx)
            ids, dead = self._hash(ctx, t)
            x, pre = self.model.embed_tokens(t, ctx.images)
            carry = Carry(x, pre, ids, dead)
        ctx.hash_ids, ctx.dead = carry.hash_ids, carry.dead
        if self.prefetcher is not None:
            self.prefetcher.start(ctx)
        ctx.trace("stage_entry", self.model.layer_ids[0], carry.x)
        x, pre = self.model.forward_layers(carry.x, carry.pre, ctx)
        prefetch.join_all(ctx)
        ctx.trace("stage_exit", self.model.layer_ids[-1], x)
        if self.model.mtp is not None:  # the step's target features into the DSpark rings
            self.model.cfg.family.seed_drafts(self.model, ctx)
        if self.model.head is not None:
            if ctx.logits_rows is not None:
                x, pre = x[ctx.logits_rows], pre[ctx.logits_rows]
            return self.model.logits(x, pre)
        return Carry(x, pre, carry.hash_ids, carry.dead)

    def _hash(self, ctx: ForwardContext, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's hash ids and image-token mask: computed by the one hasher (the first
        stage's TP leader, which owns the history) and broadcast to its TP followers."""
        tp = self.model.tp
        if self.hasher is not None:
            if ctx.decode:
                ids = self.hasher.decode(t, ctx.slot_ids, ctx.positions, ctx.num_real, check=False)
            else:
                lens = ctx.query_start.diff()
                ids = self.hasher.extend(
                    t, ctx.slot_ids, lens, ctx.start_pos_t, check=False, commit=ctx.commit_runs
                )
            dead = self.hasher.is_dead(t)
            if tp.solo:
                return ids, dead
        else:
            like = Carry.empty(self.model, len(t))
            ids, dead = like.hash_ids, like.dead
        return tp.broadcast(ids), tp.broadcast(dead.to(torch.uint8)).bool()

    def _commit_verified(self, commits: list[tuple[int, list[int], int]]) -> None:
        """The history commits of the previous step's verify runs: each block's anchor and
        accepted drafts (``engramrt.engine.speculative``)."""
        if not commits:
            return
        width = max(len(block) for _, block, _ in commits)
        blocks = [block + [0] * (width - len(block)) for _, block, _ in commits]
        dev = self.device
        self.hasher.commit_verify(
            to_device(torch.tensor(blocks, dtype=torch.int64).flatten(), dev),
            to_device(torch.tensor([slot for slot, _, _ in commits]), dev),
            to_device(torch.tensor([n for _, _, n in commits]), dev),
        )


def warm_up_plan(max_tokens: int, slots: int, max_len: int) -> list[list[int]]:
    """The run lengths of the warm-up's mixed steps: one step with a token count in each bucket
    of the mHC kernels' compile-time tiles (``WARM_UP_TOKENS``), one with each power-of-two
    request count (the hash kernel's ``REQ_PAD``); no run longer than ``max_len``. None is a
    decode step (all runs of one token), which graph capture covers."""
    from engramrt.kernels.mhc_fused import WARM_UP_TOKENS

    plan = []
    for t in WARM_UP_TOKENS:
        if t > min(max_tokens, slots * max_len):
            continue  # no step can hold this many tokens
        rest, runs = t, []
        if t > 2 and slots > 1:  # a one-token run beside a chunk, as in serving
            runs, rest = [1], t - 1
        runs += [max_len] * (rest // max_len) + ([rest % max_len] if rest % max_len else [])
        if len(runs) <= slots and max(runs) > 1:
            plan.append(runs)
        elif max_len > 1:  # the same count with the runs spread over every slot
            plan.append([t // slots + (i < t % slots) for i in range(slots)])
    most, r = min(slots, max_tokens - 1), 4  # an extend step has a run of 2 or more
    while min(r, most) > r // 2:  # the bucket (r/2, r] holds a reachable count
        n = min(r, most)
        plan.append([1] * (n - 1) + [2])
        r *= 2
    return plan
