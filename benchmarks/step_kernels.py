"""The CUDA kernels of a decode step's parts, run eagerly once under the profiler: each is a node
of the captured graph, and at bs 1 a node costs the GPU ~1 us whatever it does
(``benchmarks/graph_launch.py``), so a small model's step time is its node count. Three parts
of the bundled model's step at bs 1: a plain step's forward (one token), a verify step's (a run
of K + 1 tokens with its drafts) and DSpark's draft pass; for each, the kernels by the module
that launched them (each block's children; "(block)" is the block's own work around them, its
mHC mixes; "(model)" the rest) and by kernel name, and what the verify forward adds to a plain
one.

    python benchmarks/step_kernels.py [--model DIR] [--k 5] [--out kernels.json]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from engramrt.models.deepseek_v41 import dspark
from engramrt.runner.batch import StepBatch
from engramrt.runner.stage import StageRunner


def blocks(model) -> list[tuple[str, torch.nn.Module]]:
    """Every block, the DSpark stages' included (named as in checkpoints)."""
    return [(f"layers.{i}", b) for i, b in model.layers.items()] + [
        (f"mtp.{i}", b) for i, b in enumerate(model.mtp or [])
    ]


@contextmanager
def module_ranges(mods: list[tuple[str, torch.nn.Module]]):
    """Each module's forward inside a profiler range of its name, while the block runs."""
    stack: list = []
    hooks = []
    for name, m in mods:
        hooks.append(
            m.register_forward_pre_hook(
                lambda *_, _n=name: stack.append(record_function(_n).__enter__())
            )
        )
        hooks.append(m.register_forward_hook(lambda *_: stack.pop().__exit__(None, None, None)))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


def kernels_by_module(model, fn, sync) -> tuple[dict[str, int], dict[str, int]]:
    """(kernels by innermost module, by kernel name) of one eager call of ``fn``."""
    whole = blocks(model)
    mods = whole + [(f"{b}.{n}", m) for b, block in whole for n, m in block.named_children()]
    sync()
    with module_ranges(mods):
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with record_function("(model)"):
                fn()
            sync()
    names = {n for n, _ in mods} | {"(model)"}
    block_names = {n for n, _ in whole}

    def own(e) -> int:  # kernels under e, less those under nested module ranges
        n = len(e.kernels)
        for c in e.cpu_children:
            n += 0 if c.name in names else own(c)
        return n

    by_module: Counter = Counter()
    by_name: Counter = Counter()
    for e in prof.events():
        if e.name in names:
            by_module[f"{e.name} (block)" if e.name in block_names else e.name] += own(e)
        for k in e.kernels:
            by_name[k.name[:80]] += 1
    return dict(by_module), dict(by_name)


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="engramrt/bundled/tiny_v41")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    block = 16
    per = -(-(args.prompt + 2 * args.k + 8) // block)
    runner = StageRunner.load(
        args.model,
        num_slots=1,
        max_len=per * block,
        device=args.device,
        dtype=None,
        dspark=True,
        num_blocks=0,
    )
    runner.allocate_kv(1, per * block, block, per, slack=args.k)
    runner.speculate(args.k)
    tokens = [3 + i % 900 for i in range(args.prompt)]
    runner.compute(StepBatch(tokens, [0], [args.prompt], [0], new_blocks=[list(range(per))]))
    p = args.prompt
    parts = {
        "plain forward": lambda: runner.compute(StepBatch([5], [0], [1], [p])),
        "verify forward": lambda: runner.compute(
            StepBatch([5] * (args.k + 1), [0], [args.k + 1], [p + 1], drafts=[args.k])
        ),
        "draft pass": lambda: dspark.draft(
            runner.model,
            runner.kv,
            *(torch.tensor([t], device=args.device) for t in (p, 0, 7)),
            confidence=False,
        ),
    }
    sync = torch.cuda.synchronize if args.device == "cuda" else lambda: None
    report = {}
    for name, fn in parts.items():
        fn()  # first use: compilations, constants
        by_module, by_name = kernels_by_module(runner.model, fn, sync)
        report[name] = {
            "kernels": sum(by_name.values()),
            "by_module": by_module,
            "by_name": by_name,
        }
        print(f"{name}: {report[name]['kernels']} kernels")
        for m, n in sorted(by_module.items(), key=lambda t: -t[1]):
            print(f"    {n:5d}  {m}")
    plain, verify = (Counter(report[n]["by_name"]) for n in ("plain forward", "verify forward"))
    more, fewer = verify - plain, plain - verify
    report["verify - plain"] = {"more": dict(more), "fewer": dict(fewer)}
    print(f"verify forward - plain: +{sum(more.values())} -{sum(fewer.values())}")
    for k, n in more.most_common():
        print(f"    +{n:3d}  {k}")
    for k, n in fewer.most_common():
        print(f"    -{n:3d}  {k}")
    print("draft pass, by kernel name:")
    for k, n in Counter(report["draft pass"]["by_name"]).most_common():
        print(f"    {n:4d}  {k}")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
