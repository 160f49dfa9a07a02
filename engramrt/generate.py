"""``engramrt generate``: prefill + decode of one prompt with a KV cache."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engramrt.model.trace import Tracer
from engramrt.sampling import sample
from engramrt.session import Session


@dataclass
class Generation:
    prompt_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS) or "length"
    seconds: float


def generate(
    session: Session,
    prompt: str,
    max_tokens: int = 32,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    tracer: Tracer | None = None,
) -> Generation:
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    cfg, tok = session.model.cfg, session.tokenizer
    prompt_ids = ([cfg.bos_token_id] if cfg.bos_token_id is not None else []) + tok.encode(
        prompt
    ).ids
    if len(prompt_ids) + max_tokens > session.kv.max_len:
        raise ValueError(
            f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
            f"maximum context length {session.kv.max_len}"
        )
    device = session.kv.k[session.model.layer_ids[0]].device
    gen = torch.Generator(device=device).manual_seed(seed)
    start = time.perf_counter()
    session.hasher.rebuild(0, [])
    logits = session.step(prompt_ids, [0], [len(prompt_ids)], [0], tracer)[-1:]
    out: list[int] = []
    finish = "length"
    while True:
        nxt = int(sample(logits, temperature, top_p, gen)[0])
        if nxt == cfg.eos_token_id:
            finish = "stop"
            break
        out.append(nxt)
        if len(out) == max_tokens:
            break
        logits = session.step([nxt], [0], [1], [len(prompt_ids) + len(out) - 1], tracer)
    seconds = time.perf_counter() - start
    return Generation(prompt_ids, out, tok.decode(out), finish, seconds)
