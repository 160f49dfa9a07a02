"""Host work of one engine step, with the model replaced by a stub: what the scheduler, the block
manager, request bookkeeping, sampling rows and detokenisation cost per decode step, alone.

256 requests are admitted with prompts of the given context length and prefilled (untimed); then
decode steps are timed. The stub "samples" a fixed non-EOS token, so every request keeps
decoding. Prefix caching on and off, at 512 and 2048 tokens of context. Beside the engine's own
work it reports the first stage's host work before any kernel runs (the slot table's deltas and
``ForwardContext.for_runs``), timed apart. The stub stands for one stage of one rank, as the
default serves: overlap scheduling, the stage keeping its samples in its token rows
(``--sync``: a pipeline whose later stage samples, which sends each sampled token back).

    python benchmarks/host_step.py [--requests 256] [--contexts 512,2048] [--steps 64] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from engramrt.bundled import DEFAULT_MODEL_DIR
from engramrt.engine.engine import Engine, EngineConfig
from engramrt.engine.request import SamplingParams
from engramrt.engram import load_tokenizer
from engramrt.model.context import ForwardContext, PagedCache
from engramrt.runner.batch import DeviceResult, StepBatch, StepResult
from engramrt.runner.slots import SlotTable

TOKEN = 300  # what the stub samples: an ordinary token of the bundled tokenizer


class StubPipeline:
    """Stands where the pipeline stands; runs no model. With ``kv`` it also builds the step's
    ``ForwardContext`` on the host, as the first stage's runner does before any kernel runs."""

    def __init__(self, kv: PagedCache | None = None, overlap: bool = False):
        self.kv, self.build_ms, self.can_overlap = kv, 0.0, overlap
        self.slots = SlotTable(torch.device("cpu"), None, samples=False, first=True)
        if kv is not None:
            self.slots.size_for(kv)

    def launch(self, batch: StepBatch) -> DeviceResult:
        """One stage of one rank: its samples go into the token rows."""
        result = self.step(batch)
        if self.kv is not None and self.can_overlap and batch.drafts is None:
            self.slots.keep_samples(batch, torch.tensor(result.tokens))
        return DeviceResult.ready(result)

    def step(self, batch: StepBatch) -> StepResult:
        if self.kv is not None:
            t0 = time.perf_counter()
            self.slots.admit(batch.admitted, 0)
            self.slots.advance(batch)
            ForwardContext.for_runs(
                batch.slots, batch.run_lens, batch.start_pos, self.kv, self.slots.blocks, "cpu"
            )
            self.build_ms = (time.perf_counter() - t0) * 1e3
        return StepResult([TOKEN] * len(batch.slots))


def measure(
    requests: int, context: int, steps: int, prefix_caching: bool, overlap: bool = True
) -> tuple[float, float]:
    """Milliseconds per decode step of the engine, and of building the step's tensors on the
    host (medians: a garbage-collector pass over the prompts' lists lands on a random step)."""
    tok = load_tokenizer(DEFAULT_MODEL_DIR)
    block = 16
    max_len = context + 1024  # the prefill phase decodes the early requests for a while
    cfg = EngineConfig(
        max_model_len=max_len,
        max_num_seqs=requests,
        max_num_batched_tokens=16384,
        block_size=block,
        num_blocks=requests * -(-max_len // block),
        enable_prefix_caching=prefix_caching,
        eos_token_id=1,
        async_scheduling=overlap,
    )
    kv = PagedCache(cfg.num_blocks, block, max_len, requests)
    stub = StubPipeline(kv, overlap)
    engine = Engine(stub, tok, cfg)
    rng = random.Random(0)
    vocab = tok.get_vocab_size()
    for i in range(requests):
        prompt = [rng.randrange(6, vocab) for _ in range(context)]
        params = SamplingParams(max_tokens=max_len - context, temperature=0, ignore_eos=True)
        engine.add_request(str(i), prompt, params)
    started: set[str] = set()
    while len(started) < requests:  # prefill, untimed
        started.update(out.request_id for out in engine.step())
    times, builds = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        outs = engine.step()
        builds.append(stub.build_ms)
        times.append((time.perf_counter() - t0) * 1e3 - stub.build_ms)
        assert len(outs) == requests, "every request decodes every step"
    return statistics.median(times), statistics.median(builds)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--contexts", default="512,2048")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--json", action="store_true", help="print one JSON document instead")
    p.add_argument("--sync", action="store_true", help="no overlap; sampled tokens sent back")
    args = p.parse_args()
    torch.set_num_threads(1)  # small host tensors: intra-op threads only add spin and noise
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        for caching in (True, False):
            ms, build = measure(args.requests, ctx, args.steps, caching, not args.sync)
            rows.append(
                {
                    "requests": args.requests,
                    "context": ctx,
                    "prefix_caching": caching,
                    "ms_per_step": round(ms, 3),
                    "step_tensors_ms": round(build, 3),
                }
            )
    if args.json:
        print(json.dumps(rows))
        return
    print("| requests | context | prefix caching | engine ms / decode step | step tensors ms |")
    print("|---:|---:|---|---:|---:|")
    for r in rows:
        on = "on" if r["prefix_caching"] else "off"
        print(
            f"| {r['requests']} | {r['context']} | {on} | {r['ms_per_step']:.2f} "
            f"| {r['step_tensors_ms']:.2f} |"
        )


if __name__ == "__main__":
    main()
