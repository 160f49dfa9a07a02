"""Engines over one CPU ``StageRunner`` for the engine tests: each call gives the runner a fresh
KV cache of the asked size (so engines built one after another do not share blocks)."""

from __future__ import annotations

from engramrt.engine.engine import Engine, EngineConfig
from engramrt.parallel.pipeline import Pipeline
from engramrt.runner.stage import StageRunner


def build_engine(
    session: StageRunner,
    max_len: int,
    slots: int,
    max_num_seqs: int = 4,
    max_num_batched_tokens: int = 256,
    block_size: int = 4,
    num_blocks: int = 256,
    prefix_caching: bool = True,
    overlap: bool = False,
) -> Engine:
    assert max_num_seqs <= slots
    cfg = EngineConfig(max_len, max_num_seqs, max_num_batched_tokens, block_size, num_blocks,
                       prefix_caching, session.model.cfg.eos_token_id,
                       async_scheduling=overlap)  # fmt: skip
    session.allocate_kv(slots, max_len, block_size, num_blocks)
    return Engine(Pipeline(session), session.tokenizer, cfg)


def bos_encoder(session: StageRunner):
    """Text -> [BOS, *ids], the prompts these tests run."""
    bos = session.model.cfg.bos_token_id
    return lambda text: [bos, *session.tokenizer.encode(text).ids]
