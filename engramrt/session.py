"""One process's share of the model: its layers, their KV cache and, on the first stage, the
Engram hasher. ``step`` runs one forward over a flat batch.

The first stage hashes once where the token ids are (DESIGN §3) and embeds; every other stage
starts from what the previous one handed over (``Carry``) and refuses to run without it
(DESIGN §2). Which stage a process is changes where the stream comes from and where it goes,
never what a layer does (DESIGN §1).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch
from tokenizers import Tokenizer

from engramrt.engram import load_hasher, load_tokenizer
from engramrt.engram.hashing import EngramHasher
from engramrt.model.checkpoint import load_model
from engramrt.model.context import ForwardContext, KVCache
from engramrt.model.decoder import EngramMHCModel
from engramrt.model.trace import Tracer


@dataclass
class Carry:
    """What crosses a stage boundary: the hc stream, the lagged pre-mix (fp32), the hash ids
    computed on the first stage, and the image-token mask."""

    x: torch.Tensor  # [T, hc, D]
    pre: torch.Tensor  # [T, hc] fp32
    hash_ids: torch.Tensor  # [T, L, (N-1)*H] int64
    dead: torch.Tensor  # [T] bool


@dataclass
class Session:
    model: EngramMHCModel
    hasher: EngramHasher | None
    kv: KVCache
    tokenizer: Tokenizer | None = None
    engram_ran: list[int] = field(default_factory=list)  # every Engram layer run, in order

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

    def embed(
        self, tokens: list[int], slots: list[int], run_lens: list[int], start_pos: list[int]
    ) -> Carry:
        """First stage only: hash ids (decode mode when every run is one token) and the stream."""
        if self.hasher is None:
            raise RuntimeError("only the first stage holds the embedding and the Engram hasher")
        dev = self.device
        t = torch.tensor(tokens, dtype=torch.int64, device=dev)
        s = torch.tensor(slots, dtype=torch.int64, device=dev)
        if all(n == 1 for n in run_lens):
            ids = self.hasher.decode(t, s, torch.tensor(start_pos, device=dev))
        else:
            lens, pos = (torch.tensor(v, device=dev) for v in (run_lens, start_pos))
            ids = self.hasher.extend(t, s, lens, pos)
        x, pre = self.model.embed_tokens(t)
        return Carry(x, pre, ids, self.hasher.is_dead(t))

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
        ``block_tables`` each slot uses its own fixed blocks."""
        if carry is None:
            if self.model.embed is None:
                first = self.model.layer_ids[0]
                raise RuntimeError(
                    f"the stage starting at layer {first} needs the stream, lagged pre-mix and "
                    "hash ids of the previous stage and received none"
                )
            carry = self.embed(tokens, slots, run_lens, start_pos)
        ctx = ForwardContext.for_runs(
            slots,
            run_lens,
            start_pos,
            self.kv,
            self.device,
            block_tables,
            hash_ids=carry.hash_ids,
            dead=carry.dead,
            tracer=tracer,
        )
        ctx.trace("stage_entry", self.model.layer_ids[0], carry.x)
        x, pre = self.model.forward_layers(carry.x, carry.pre, ctx)
        self.engram_ran.extend(ctx.engram_ran)
        ctx.trace("stage_exit", self.model.layer_ids[-1], x)
        if self.model.head is not None:
            return self.model.logits(x, pre)
        return Carry(x, pre, carry.hash_ids, carry.dead)
