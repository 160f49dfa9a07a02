"""One process's share of the model: its layers, their KV cache and, on the first stage, the
Engram hasher. ``step`` runs one forward over a flat batch.

The first stage hashes once where the token ids are (DESIGN §3) and embeds; every other stage
starts from what the previous one handed over (``Carry``) and refuses to run without it
(DESIGN §2). Which stage a process is changes where the stream comes from and where it goes,
never what a layer does (DESIGN §1). Eager steps and CUDA-graph replays run the same ``forward``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from tokenizers import Tokenizer

from engramrt.engram import load_hasher, load_tokenizer
from engramrt.engram.hashing import EngramHasher
from engramrt.kernels import use_triton
from engramrt.model.checkpoint import load_model
from engramrt.model.context import ForwardContext, KVCache
from engramrt.model.decoder import EngramMHCModel
from engramrt.model.trace import Tracer

if TYPE_CHECKING:
    from engramrt.model.cuda_graphs import DecodeGraphs


@dataclass
class Carry:
    """What crosses a stage boundary: the hc stream, the lagged pre-mix (fp32), the hash ids
    computed on the first stage, and the image-token mask."""

    x: torch.Tensor  # [T, hc, D]
    pre: torch.Tensor  # [T, hc] fp32
    hash_ids: torch.Tensor  # [T, L, (N-1)*H] int64
    dead: torch.Tensor  # [T] bool

    @classmethod
    def zeros(cls, model: EngramMHCModel, tokens: int) -> Carry:
        """A carry of the right shapes (graph inputs, memory profiling)."""
        cfg, e, dev = model.cfg, model.cfg.engram, next(model.parameters()).device
        return cls(
            torch.zeros(tokens, cfg.hc_mult, cfg.hidden_size, dtype=model.dtype, device=dev),
            torch.zeros(tokens, cfg.hc_mult, dtype=torch.float32, device=dev),
            torch.zeros(tokens, e.num_layers, e.n_hash_cols, dtype=torch.int64, device=dev),
            torch.zeros(tokens, dtype=torch.bool, device=dev),
        )


@dataclass
class Session:
    model: EngramMHCModel
    hasher: EngramHasher | None
    kv: KVCache
    tokenizer: Tokenizer | None = None
    engram_ran: list[int] = field(default_factory=list)  # every Engram layer run, in order
    graphs: DecodeGraphs | None = None

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
    ) -> Session:
        model = load_model(model_dir, dtype, device, layer_ids)
        if model.embed is not None:  # the first stage hashes; the others need the vocab size
            hasher, tokenizer = load_hasher(model_dir, num_slots, device)
        else:
            hasher, tokenizer = None, load_tokenizer(model_dir)
        kv = cls.new_cache(model, num_slots, max_len, block_size, num_blocks)
        return cls(model, hasher, kv, tokenizer)

    @staticmethod
    def new_cache(
        model: EngramMHCModel,
        num_slots: int,
        max_len: int | None = None,
        block_size: int = 16,
        num_blocks: int | None = None,
    ) -> KVCache:
        """Enough blocks for ``num_slots`` sequences of ``max_len`` unless ``num_blocks`` says."""
        cfg = model.cfg
        max_len = max_len or cfg.max_position_embeddings
        if max_len > cfg.max_position_embeddings:
            raise ValueError(
                f"{max_len} tokens exceed the model's max_position_embeddings "
                f"({cfg.max_position_embeddings})"
            )
        device = next(model.parameters()).device
        if num_blocks is None:
            num_blocks = num_slots * -(-max_len // block_size)
        return KVCache(
            model.layer_ids,
            num_blocks,
            block_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            model.dtype,
            device,
            max_len,
        )

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def capture_graphs(self, max_batch: int) -> None:
        """Capture the decode step for padded batch sizes up to ``max_batch`` (CUDA only). The
        reference MoE routes with data-dependent shapes, so MoE models stay eager."""
        from engramrt.model.cuda_graphs import DecodeGraphs

        if self.model.cfg.ffn_type == "moe":
            print("engramrt: MoE routing is not graph-capturable yet; decoding eagerly", flush=True)
            return
        if not use_triton(self.device):  # the torch reference attention is not capturable
            print("engramrt: CUDA graphs need the Triton kernels; decoding eagerly", flush=True)
            return
        self.graphs = DecodeGraphs(self, max_batch)

    @torch.inference_mode()
    def step(
        self,
        tokens: list[int] | None,
        slots: list[int],
        run_lens: list[int],
        start_pos: list[int],
        tracer: Tracer | None = None,
        carry: Carry | None = None,
        block_tables: list[list[int]] | None = None,
    ) -> torch.Tensor | Carry:
        """Logits ``[T, V]`` on the last stage, else the ``Carry`` for the next stage. Without
        ``block_tables`` each slot uses its own fixed blocks. A decode step replays a captured
        graph when there is one; its outputs are then valid until the next step."""
        if carry is None:
            if self.hasher is None:
                first = self.model.layer_ids[0]
                raise RuntimeError(
                    f"the stage starting at layer {first} needs the stream, lagged pre-mix and "
                    "hash ids of the previous stage and received none"
                )
            if tokens is None or len(tokens) != sum(run_lens):
                raise ValueError(f"the runs need {sum(run_lens)} tokens")
            self.hasher.validate(tokens, slots, run_lens)
        graphs = self.graphs
        if graphs is not None and not graphs.covers(run_lens, tracer, block_tables):
            graphs = None
        ctx = ForwardContext.for_runs(
            slots, run_lens, start_pos, self.kv, "cpu" if graphs else self.device, block_tables,
            tokens, pad_to=graphs.padded_size(len(slots)) if graphs else None, tracer=tracer,
        )  # fmt: skip
        if graphs is not None:
            out, ran = graphs.replay(ctx, carry)
        else:
            out = self.forward(ctx, carry)
            ran = ctx.engram_ran
        self.engram_ran.extend(ran)
        return out

    def forward(self, ctx: ForwardContext, carry: Carry | None) -> torch.Tensor | Carry:
        """The step on device tensors only: what a CUDA graph captures. The first stage hashes
        once where the token ids are (DESIGN §3) and embeds."""
        if carry is None:
            t = ctx.tokens
            if ctx.decode:
                ids = self.hasher.decode(t, ctx.slot_ids, ctx.positions, ctx.num_real, check=False)
            else:
                lens = ctx.query_start.diff()
                ids = self.hasher.extend(t, ctx.slot_ids, lens, ctx.start_pos_t, check=False)
            x, pre = self.model.embed_tokens(t)
            carry = Carry(x, pre, ids, self.hasher.is_dead(t))
        ctx.hash_ids, ctx.dead = carry.hash_ids, carry.dead
        ctx.trace("stage_entry", self.model.layer_ids[0], carry.x)
        x, pre = self.model.forward_layers(carry.x, carry.pre, ctx)
        ctx.trace("stage_exit", self.model.layer_ids[-1], x)
        if self.model.head is not None:
            return self.model.logits(x, pre)
        return Carry(x, pre, carry.hash_ids, carry.dead)
