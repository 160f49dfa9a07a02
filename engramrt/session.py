"""A minimal single-process runner: model + Engram hasher + KV cache for a few request slots.

Every forward goes through ``step``: hash once where the tokens are (DESIGN §3), build the
forward context, run the model. Prefill, chunked prefill and decode differ only in the hash mode.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer

from engramrt.engram import load_hasher
from engramrt.engram.hashing import EngramHasher
from engramrt.model.checkpoint import load_model
from engramrt.model.context import ForwardContext, KVCache, Tracer
from engramrt.model.decoder import EngramMHCModel


@dataclass
class Session:
    model: EngramMHCModel
    hasher: EngramHasher
    kv: KVCache
    tokenizer: Tokenizer | None = None

    @classmethod
    def load(
        cls,
        model_dir: str | Path,
        num_slots: int = 1,
        max_len: int | None = None,
        device: str = "cpu",
        dtype: str | torch.dtype | None = None,
    ) -> Session:
        model = load_model(model_dir, dtype, device)
        hasher, tokenizer = load_hasher(model_dir, num_slots, device)
        return cls(model, hasher, cls.new_cache(model, num_slots, max_len), tokenizer)

    @staticmethod
    def new_cache(model: EngramMHCModel, num_slots: int, max_len: int | None = None) -> KVCache:
        cfg = model.cfg
        max_len = max_len or cfg.max_position_embeddings
        if max_len > cfg.max_position_embeddings:
            raise ValueError(
                f"{max_len} tokens exceed the model's max_position_embeddings "
                f"({cfg.max_position_embeddings})"
            )
        device = next(model.parameters()).device
        return KVCache(
            model.layer_ids, num_slots, max_len, cfg.num_kv_heads, cfg.head_dim, model.dtype, device
        )

    @torch.inference_mode()
    def step(
        self,
        tokens: list[int],
        slots: list[int],
        run_lens: list[int],
        start_pos: list[int],
        tracer: Tracer | None = None,
    ) -> torch.Tensor:
        """Logits ``[T, V]`` for a flat batch; runs of one token use the decode hash mode."""
        device = self.kv.k[self.model.layer_ids[0]].device
        t = torch.tensor(tokens, dtype=torch.int64, device=device)
        s = torch.tensor(slots, dtype=torch.int64, device=device)
        if all(n == 1 for n in run_lens):
            ids = self.hasher.decode(t, s, torch.tensor(start_pos, device=device))
        else:
            lens, pos = (torch.tensor(v, device=device) for v in (run_lens, start_pos))
            ids = self.hasher.extend(t, s, lens, pos)
        ctx = ForwardContext.for_runs(
            slots,
            run_lens,
            start_pos,
            self.kv,
            device,
            hash_ids=ids,
            dead=self.hasher.is_dead(t),
            tracer=tracer,
        )
        return self.model(t, ctx)
