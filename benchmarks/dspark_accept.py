"""DSpark on a trained model (the bundled one by default): acceptance on held-out text and decode
tokens/s with and without it, measured in one run.

    python benchmarks/dspark_accept.py [--model DIR] [--device cpu|cuda] [--k 3]
        [--batch-sizes 1,16] [--max-tokens 48] [--out results.json]

Prompts: the held-out items of the model's task files (as completions and as one-turn chats)
and the openings of held-out prose paragraphs (``engramrt.bundled.prose``, when its package is
installed). Each batch size runs the same prompts greedily through an engine without
speculation and one drafting with DSpark; it reports decode tokens/s of each (generated tokens
over the time after the first token of every request), tokens per verify step (1 + accepted
drafts) and the share of verify runs that accepted the draft at each position, and whether
the outputs agree (the CPU's must: greedy is exact; a GPU's verify GEMMs round differently
from decode ones, so V4.1 outputs may part there).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path

from engramrt.bundled import DEFAULT_MODEL_DIR
from engramrt.bundled.prose import austen
from engramrt.config import load_json
from engramrt.engine.build import EngineOptions, build_stage
from engramrt.engine.engine import Engine
from engramrt.engine.request import SamplingParams
from engramrt.models import model_config
from engramrt.parallel.launch import DistConfig
from engramrt.prompts import PromptEncoder


def held_out_prompts(model_dir: Path, enc: PromptEncoder, per_kind: int) -> list[list[int]]:
    prompts = []
    for task in sorted((model_dir / "tasks").glob("*.jsonl")):
        items = [json.loads(line) for line in task.read_text().splitlines()][:per_kind]
        prompts += [enc.text(i["prompt"]) for i in items]
        prompts += [enc.chat([{"role": "user", "content": i["prompt"]}]) for i in items]
    prose = [" ".join(p.split()[:12]) for p in austen()[1][:per_kind]]
    return prompts + [enc.text(p) for p in prose]


def run(engine: Engine, prompts: list[list[int]], max_tokens: int) -> tuple[list, float, int, int]:
    """Outputs, seconds from the step that gave every request its first token to the end, the
    tokens generated in that time and the engine steps that delivered them."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs: dict[str, list[int]] = {}
    start, counted, steps = None, 0, 0
    while engine.has_work():
        steps += start is not None
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if start is not None:
                counted += len(o.new_token_ids)
        if start is None and len(outs) == len(prompts):
            start = time.perf_counter()
    secs = 0.0 if start is None else time.perf_counter() - start
    return [outs[str(i)] for i in range(len(prompts))], secs, counted, steps


def write_profile(prof: cProfile.Profile, path: Path) -> None:
    """The costliest functions by their own time, then by their time with callees."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = io.StringIO()
    for key, n in (("tottime", 45), ("cumtime", 70)):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(n)
    path.write_text(text.getvalue())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--k", type=int, default=3, help="drafts a verify step")
    ap.add_argument("--batch-sizes", default="1,16")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--per-kind", type=int, default=16, help="held-out items of each kind")
    ap.add_argument("--out", type=Path)
    ap.add_argument(
        "--profile", type=Path, help="cProfile each arm's timed runs: DIR/{plain,dspark}-bsN.txt"
    )
    args = ap.parse_args()
    spec = json.dumps({"method": "dspark", "num_speculative_tokens": args.k})
    rows = []
    engines = {}
    layers = model_config(load_json(args.model)).num_layers
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    for name, cfg in (("plain", None), ("dspark", spec)):
        opts = EngineOptions(
            args.model,
            [layers],
            max_model_len=512,
            max_num_seqs=max(sizes),
            dist=DistConfig(device=args.device),
            dtype=args.dtype,
            speculative_config=cfg,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=1 << 30,  # two engines share the GPU
        )
        engines[name] = build_stage(opts)[1]
    enc = PromptEncoder.load(args.model, engines["plain"].tokenizer)
    prompts = held_out_prompts(args.model, enc, args.per_kind)
    run(engines["plain"], prompts[:2], 4)  # warm-up: first-use compilations
    run(engines["dspark"], prompts[:2], 4)
    for bs in sizes:
        row = {"batch": bs, "prompts": len(prompts), "max_tokens": args.max_tokens}
        outputs = {}
        for name, engine in engines.items():
            before = dict(engine.stats())
            secs = count = steps = 0.0
            outs = []
            prof = cProfile.Profile() if args.profile else None
            for lo in range(0, len(prompts), bs):  # batches of bs requests, one after another
                if prof is not None:
                    prof.enable()
                o, s, n, k = run(engine, prompts[lo : lo + bs], args.max_tokens)
                if prof is not None:
                    prof.disable()
                outs += o
                secs, count, steps = secs + s, count + n, steps + k
            outputs[name] = outs
            if prof is not None:
                write_profile(prof, args.profile / f"{name}-bs{bs}.txt")
            row[f"{name}_tok_s"] = count / secs if secs else None
            row[f"{name}_tokens_a_step"] = count / steps if steps else None
            row[f"{name}_ms_a_step"] = 1e3 * secs / steps if steps else None
            if name == "dspark":
                st = engine.stats()
                runs = st["spec_decode_num_drafts"] - before["spec_decode_num_drafts"]
                took = (
                    st["spec_decode_num_accepted_tokens"]
                    - before["spec_decode_num_accepted_tokens"]
                )
                key = "spec_decode_num_accepted_tokens_per_pos"
                per_pos = [a - b for a, b in zip(st[key], before[key], strict=True)]
                per = max(runs, 1)  # no verify run: too few tokens asked for
                row.update(
                    verify_runs=runs,
                    tokens_per_verify=1 + took / per,
                    accepted_per_pos=[round(a / per, 3) for a in per_pos],
                )
        if row["dspark_tok_s"] and row["plain_tok_s"]:
            row["speedup"] = row["dspark_tok_s"] / row["plain_tok_s"]
        row["same_outputs"] = sum(
            a == b for a, b in zip(outputs["plain"], outputs["dspark"], strict=True)
        )
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(
            json.dumps(
                {"model": str(args.model), "device": args.device, "k": args.k, "rows": rows},
                indent=1,
            )
        )


if __name__ == "__main__":
    main()
