"""The launches of one decode step, by layer and part, with their call sites (fusion planning).

    python benchmarks/make_models.py --preset v41-small --out /tmp/v41s  # or v41-wide on a GPU
    python -m benchmarks.step_kernels --model /tmp/v41s --device cpu --batch 1 4  # ~1 min
    python -m benchmarks.step_kernels --model /tmp/v41w --device cuda --batch 1 4  # on a GPU

Prefills ``--prompt`` random tokens a slot (torch path), then runs eager decode steps through
``StageRunner.run`` on the CUDA path's kernels (no CUDA graph) and records in the last one each
aten op that launches a kernel (views, allocations, metadata left out; composites by their
parts) and each Triton launch: its layer and part (``PARTS``: the innermost such function on the
stack) and call site (the innermost engramrt line; a kernel wrapper's names its caller). CPU:
``use_triton`` says yes (in this tool only) and Triton's interpreter runs the kernels; counts
are ops (on CUDA a sort or cumsum is 2 kernels, many copies a memcpy; host copies unseen).
CUDA: each op's launches (kernels, memcpys, memsets) and GPU time from ``torch.profiler``.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import linecache
import os
import sys
from collections import Counter

import torch
from torch.autograd import DeviceType
from torch.utils._python_dispatch import TorchDispatchMode

# no kernel: allocation, metadata, host-side (``OpOverload.is_view``: views)
_NO_KERNEL = """empty empty_like empty_strided new_empty new_empty_strided set_ resize_
_unsafe_view lift_fresh _local_scalar_dense _pin_memory is_pinned"""
# function (qualified name) = part: the innermost one on the stack names an op's part
_PARTS = """ForwardContext.engram_inputs=engram.ids EngramTable.lookup=engram.gather
Engram.forward=engram.wkv engram_gate=engram.gate mhc_pre=mhc.pre+norm mhc_post=mhc.post
RMSNorm.forward=norm StepRuns.of=attn.meta StepRuns.rotation=attn.meta
StepRuns.ring_rows=attn.meta StepRuns.tail_rows=attn.meta StepRuns.closing_rows=attn.meta
V41Attention.project=attn.q V41Attention.low_ranks=attn.q V41Attention.queries=attn.q
V41Attention.latents=attn.kv V41Attention._window_latents=attn.kv
V41Attention._compress=attn.compress
V41Attention._index=attn.index V41Attention.forward=attn.rows V41Attention.attend=attn.sparse
V41Attention.output=attn.out V41MoE.route=moe.route ExpertPairs.__init__=moe.sort
V41MoE._grouped=moe.experts ExpertPairs.combine=moe.combine Expert.forward=moe.shared
V41MoE.forward=moe.combine SlotTable.token_ids=tokens StageRunner._hash=hash
EngramMHCModel.embed_tokens=embed ForwardContext.for_runs=context StageRunner.forward=head.rows
collapse_norm=head.norm head_logits=head.proj Sampler.launch=sampler
SlotTable.keep_samples=keep_sample"""
PARTS, NO_KERNEL = dict(pair.split("=") for pair in _PARTS.split()), set(_NO_KERNEL.split())
# V41Attention.forward's own statements by a word of their line (the last: the rest)
ATTN_LINES = (("project", "attn.q"), ("ring", "attn.kv"), ("", "attn.rows"))
_composite = torch._C._dispatch_has_kernel_for_dispatch_key
ORDER = list(dict.fromkeys([*PARTS.values(), "other", "unattributed"]))


def where(root: str) -> tuple[int | None, str, str]:
    """(layer, part, call site) of the code running now, from the python stack."""
    layer = part = site = None
    f = sys._getframe(1)
    while f is not None:
        name, q = f.f_code.co_filename, f.f_code.co_qualname
        if name.startswith(root):
            here = f"{name[len(root) + 1 :]}:{f.f_lineno}"
            if site is None:
                site = here
            elif site.startswith("kernels/") and "<-" not in site and "kernels/" not in here:
                site += f" <- {here}"
            if part is None and q == "V41Attention.forward":
                line = linecache.getline(name, f.f_lineno)
                part = next(p for w, p in ATTN_LINES if w in line)
            part = part or PARTS.get(q)
            if layer is None and q == "Block.forward":
                layer = f.f_locals["self"].layer_id
        f = f.f_back
    return layer, part or "other", site or "?"


class Census(TorchDispatchMode):
    """Records each launching op and Triton launch of what runs inside it, ``recorded``
    [(layer, part, site, op)] (with ``profile`` each in a ``census#<index>`` profiler range),
    and host syncs by site; ``tally`` counts their launches by (layer, part) (layer None: the
    step's own), by (site, op) and by op, GPU us by part; copies and strays by name (CUDA)."""

    def __init__(self, root: str, profile: bool):
        super().__init__()
        self.root, self.profile, self.busy, self.depth = root, profile, 0, 0
        self.recorded: list[tuple[int | None, str, str, str]] = []
        self.parts, self.sites, self.ops, self.us = Counter(), Counter(), Counter(), Counter()
        self.syncs, self.copies, self.stray = Counter(), Counter(), Counter()

    total = property(lambda self: sum(self.parts.values()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name, kwargs = func.overloadpacket.__name__, kwargs or {}
        if not self.busy and _composite(func.name(), "CompositeImplicitAutograd"):
            with self:  # inference mode hands composites (linear, einsum) over whole: their parts
                out = func.decompose(*args, **kwargs)
            if out is not NotImplemented:
                return out
        if self.busy or func.is_view or name in NO_KERNEL:
            if name == "_local_scalar_dense" and not self.busy:
                self.syncs[where(self.root)[2]] += 1
            return func(*args, **kwargs)
        return self.call(name, func, *args, **kwargs)

    def __enter__(self):  # Triton launches too (``JITFunction.run``, or the interpreter's), once
        from triton.runtime import interpreter, jit  # (decomposing a composite re-enters)

        self.depth += 1
        if self.depth == 1:
            self.real = {c: c.run for c in (jit.JITFunction, interpreter.InterpretedFunction)}
            for c, run in self.real.items():
                c.run = lambda fn, *args, _run=run, **kw: self.launch(_run, fn, *args, **kw)
        return super().__enter__()

    def __exit__(self, *exc):
        self.depth -= 1
        for c, run in self.real.items() if not self.depth else ():
            c.run = run
        return super().__exit__(*exc)

    def launch(self, run, fn, *args, grid, warmup, **kw):
        if warmup or self.busy:
            return run(fn, *args, grid=grid, warmup=warmup, **kw)
        name = f"triton:{fn.fn.__name__}"
        return self.call(name, run, fn, *args, grid=grid, warmup=warmup, **kw)

    def call(self, name, fn, *args, **kwargs):
        self.recorded.append((*where(self.root), name))
        self.busy += 1  # what the call itself dispatches (the interpreter's copies) is its own
        try:
            scope = torch.profiler.record_function(f"census#{len(self.recorded) - 1}")
            with scope if self.profile else contextlib.nullcontext():
                return fn(*args, **kwargs)
        finally:
            self.busy -= 1

    def tally(self, prof=None) -> None:
        """Count what was recorded: one launch an op, or (``prof``) what the profile saw."""
        names = [r[3] for r in self.recorded]
        n, us = [1] * len(names), [0.0] * len(names)
        if prof is not None:
            n, us, self.copies, self.stray = kernels_per_op(prof, names)
            self.parts[None, "unattributed"] += self.stray.total()
        for (layer, part, site, op), k, t in zip(self.recorded, n, us, strict=True):
            self.parts[layer, part] += k
            self.us[part] += t
            self.sites[site, op] += k
            self.ops[op] += k
        self.parts = +self.parts  # no empty parts


def kernels_per_op(prof, names: list[str]) -> tuple[list[int], list[float], Counter, Counter]:
    """The launches (kernels, memcpys, memsets) each of the ops ``names`` made and their GPU us,
    the copies by name, the launches no op made: a launch is the op's whose range its CUDA API
    call (of its correlation id) ran in; a Triton kernel, the next Triton launch of its name."""
    events = sorted(prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
    cpu = [e for e in events if e.device_type() == DeviceType.CPU]
    api = {e.correlation_id(): e.start_ns() for e in cpu if e.name().startswith("cu")}
    ranges = [e for e in cpu if e.name().startswith("census#")]
    spans = sorted((e.start_ns(), e.end_ns(), int(e.name()[7:])) for e in ranges)
    starts, triton = [s[0] for s in spans], {}
    for i, name in enumerate(names):
        if name.startswith("triton:"):
            triton.setdefault(name[7:], []).append(i)
    per_op, us, copies, stray = [0] * len(names), [0.0] * len(names), Counter(), Counter()
    for e in events:  # kernels, memcpys and memsets (not the ranges' own GPU spans)
        if e.device_type() != DeviceType.CUDA or e.name().startswith("census#"):
            continue
        if e.name().startswith(("Memcpy", "Memset")):
            copies[e.name().split(" (")[0]] += 1
        if triton.get(e.name()):
            i = triton[e.name()].pop(0)
        else:
            at = api.get(e.correlation_id(), -1)
            j = bisect.bisect_right(starts, at) - 1
            i = spans[j][2] if j >= 0 and at <= spans[j][1] else None
        if i is None:
            stray[e.name()[:60]] += 1
            continue
        per_op[i], us[i] = per_op[i] + 1, us[i] + e.duration_ns() / 1000
    return per_op, us, copies, stray


def report(bs: int, c: Census, top: int) -> None:
    triton = sum(n for op, n in c.ops.items() if op.startswith("triton:"))
    what = f"{triton} Triton, {c.total - triton} aten; {len(c.recorded)} ops recorded"
    print(f"\nbs {bs}: {c.total} launches a step ({what})")
    cols = [*sorted({la for la, _ in c.parts if la is not None}), None]
    parts = sorted({p for _, p in c.parts}, key=lambda p: ORDER.index(p) if p in ORDER else 99)
    table = {p: [c.parts.get((la, p), 0) for la in cols] for p in parts}
    table["total"] = [sum(col) for col in zip(*table.values(), strict=True)]
    us = {**c.us, "total": c.us.total()} if c.us.total() else {}
    head = "".join(f"{f'L{la}':>6}" for la in cols[:-1]) + "  step    all"
    print(f"{'part':<15}{head}" + ("  GPU us" if us else ""))
    for p, row in table.items():
        cells = "".join(f"{n or '.':>6}" for n in row) + f"{sum(row):>7}"
        print(f"{p:<15}{cells}" + (f"{us[p]:>8.0f}" if us else ""))
    print(f"top {top} call sites (launches, op, site):")
    for (site, op), n in c.sites.most_common(top):
        print(f"{n:>6}  {op:<34} {site}")
    print("by op: " + ", ".join(f"{op} {n}" for op, n in c.ops.most_common(25)))
    for what in ("syncs", "copies", "stray"):
        if getattr(c, what):
            print(f"{what}: " + ", ".join(f"{k} x{n}" for k, n in getattr(c, what).most_common(8)))


def census(model, device, batches, prompt=40, warmup=None, sampling=(0.0, 1.0)) -> dict:
    """{batch size: the ``Census`` of a decode step} (after ``warmup`` decode steps, default 2 on
    CUDA, 0 on a CPU); ``sampling``: (temperature, top_p), 0: greedy."""
    from benchmarks import cases

    runner = cases.census_stage(model, device, max(batches), prompt, *sampling)
    positions, out = [prompt] * max(batches), {}
    for bs in batches:
        with cases.kernel_path():
            for _ in range(2 * (device == "cuda") if warmup is None else warmup):
                cases.census_decode(runner, positions, bs)
            acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
            prof = torch.profiler.profile(activities=acts) if device == "cuda" else None
            census = Census(str(cases.PACKAGE_DIR), prof is not None)
            with prof if prof is not None else contextlib.nullcontext(), census:
                cases.census_decode(runner, positions, bs)
                if prof is not None:
                    torch.cuda.synchronize()
            census.tally(prof)
            out[bs] = census
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="a V4.1 checkpoint (default: the bundled one)")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    p.add_argument("--prompt", type=int, default=40, help="tokens prefilled in each slot")
    p.add_argument("--warmup", type=int, default=None, help="decode steps before (cuda: 2, cpu: 0)")
    p.add_argument("--sampling", type=float, nargs=2, default=[0, 1], help="temperature top-p")
    p.add_argument("--top", type=int, default=30, help="call sites listed")
    a = p.parse_args()
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module loads
    from benchmarks import cases

    got = census(a.model or cases.BUNDLED_MODEL, a.device, a.batch, a.prompt, a.warmup, a.sampling)
    for bs, c in got.items():
        report(bs, c, a.top)


if __name__ == "__main__":
    main()
