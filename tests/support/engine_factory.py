"""Engines over one preloaded ``StageRunner`` for the engine tests, wired by the assembly point
(``engramrt.engine.build.engine_for``): each call gives the runner a fresh KV cache of the asked
size (so engines built one after another do not share blocks)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from engramrt.engine.build import EngineOptions, engine_for
from engramrt.engine.detokenize import RequestText
from engramrt.engine.engine import Engine
from engramrt.engine.request import SamplingParams
from engramrt.engine.speculative import SpecConfig
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
    speculative: SpecConfig | None = None,
    allocate: bool = True,
) -> Engine:
    """``allocate=False`` keeps the runner's cache (one with captured graphs)."""
    assert max_num_seqs <= slots
    if allocate:  # room for the drafts past the accepted position (V4.1's rings and tails)
        slack = 0 if speculative is None else speculative.num_speculative_tokens
        session.allocate_kv(slots, max_len, block_size, num_blocks, slack=slack)
    opts = EngineOptions(
        Path(),
        [len(session.model.layer_ids)],
        max_len,
        max_num_seqs,
        max_num_batched_tokens,
        session.kv.block_size,
        enable_prefix_caching=prefix_caching,
        async_scheduling=overlap,
        speculative_config=None if speculative is None else speculative.to_json(),
    )
    engine = engine_for(Pipeline(session), opts, session.model.cfg, max_len)
    return with_text(engine)


def with_text(engine: Engine) -> Engine:
    """Keep each added request's ``RequestText`` in ``engine.texts`` (the engine sends ids; the
    tests read text the way the server's process makes it)."""
    engine.texts = {}
    add = engine.add

    def add_with_text(req) -> None:
        add(req)
        engine.texts[req.id] = RequestText(engine.tokenizer, req.prompt_ids, req.params.stop)

    engine.add = add_with_text
    return engine


def bos_encoder(session: StageRunner):
    """Text -> [BOS, *ids], the prompts these tests run."""
    bos = session.model.cfg.bos_token_id
    return lambda text: [bos, *session.tokenizer.encode(text).ids]


def run_to_end(
    engine: Engine,
    prompts: list[list[int]],
    params: SamplingParams | list[SamplingParams],
    after_step: Callable[[Engine], None] | None = None,
) -> list[list[int]]:
    """Each prompt's output ids, the engine stepped until it has no work (``after_step`` called
    after every step)."""
    if isinstance(params, SamplingParams):
        params = [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(str(i), p, sp)
    out: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    while engine.has_work():
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        if after_step is not None:
            after_step(engine)
    return [out[str(i)] for i in range(len(prompts))]
