"""Kernel microbenchmarks in one harness (flashinfer's pattern): every case of
``benchmarks.cases.KERNEL_CASES``, one a Triton kernel of ``engramrt/kernels/``, on its named
shapes: the kernel against the package's torch path on the same inputs (bitwise or within the
case's relative error), its GPU time, and that time against its floor (the bytes its work must
move over the copy rate measured in the same run, its FLOPs over the bf16 matmul rate measured
likewise) and against the other ways to the same result the case names.

    python -m benchmarks.kernels [--case NAME ...] [--out ROOT]   # a GPU: check and time
    python -m benchmarks.kernels --check                          # tiny shapes, correctness only

``--check`` runs each case's tiny shapes without timing: on a CPU in Triton's interpreter (CI).
Timing: the call captured in a CUDA graph and replayed after an L2 flush (the median of 20
replays), so the host's launch cost is not in it; a torch path that cannot be captured is timed
launched eagerly after the flush (``torch_how``). The same as ``python -m benchmarks.run --suite
kernels``.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks import cases
from benchmarks.common import RESULTS, Record, ceilings, gpu_us
from benchmarks.table import fmt


def tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    return [t for item in x if item is not None for t in tensors(item)]


_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(_INTS[t.element_size()]) if t.dtype.is_floating_point else t


def disagreement(got: Any, want: Any, exact: bool) -> float:
    """0 when ``got`` is ``want`` bit for bit (``exact``), else the largest relative L2 error
    ``|got - want| / |want|`` over the output tensors, over the entries finite in the
    reference; inf when a shape, dtype or non-finite entry differs."""
    worst = 0.0
    a, b = tensors(got), tensors(want)
    if len(a) != len(b):
        return float("inf")
    for g, w in zip(a, b, strict=True):
        if g.shape != w.shape or (exact and g.dtype != w.dtype):
            return float("inf")
        g, w = g.detach().cpu(), w.detach().cpu()
        if exact:
            worst = max(worst, 0.0 if torch.equal(_bits(g), _bits(w)) else float("inf"))
            continue
        g, w = g.double(), w.double()
        finite = torch.isfinite(w)
        if not torch.equal(torch.isfinite(g), finite) or not torch.equal(g[~finite], w[~finite]):
            return float("inf")
        norm = w[finite].norm().item()
        err = (g[finite] - w[finite]).norm().item()
        worst = max(worst, err / norm if norm else err)
    return worst


def check(built: cases.Built) -> tuple[bool, float]:
    got = built.kernel()
    with cases.torch_path():
        want = built.reference()
    err = disagreement(got, want, built.exact)
    return err <= (0.0 if built.exact else built.tol), err


def measure(built: cases.Built, ceil: dict[str, float]) -> dict[str, Any]:
    """GPU times of the kernel, the torch path and the baselines; the kernel against its
    floor."""
    us, how = gpu_us(built.kernel)
    with cases.torch_path():
        ref_us, ref_how = gpu_us(built.reference, built.ref_graph)
    row: dict[str, Any] = {"us": us, "how": how, "torch_us": ref_us, "torch_how": ref_how}
    row["baselines"] = {}
    for name, fn in built.baselines.items():
        try:
            row["baselines"][name] = gpu_us(fn)[0]
        except Exception as exc:  # a library's kernel that refuses the shape: said, not timed
            row.setdefault("baseline_failures", {})[name] = f"{type(exc).__name__}: {exc}"[:300]
    byte_us = built.bytes / (ceil["copy_gbs"] * 1e3)
    flop_us = built.flops / (ceil["matmul_tflops"] * 1e6)
    row.update(
        bytes=built.bytes,
        flops=built.flops,
        floor_us=max(byte_us, flop_us),
        bound="bytes" if byte_us >= flop_us else "flops",
        x_floor=us / max(byte_us, flop_us) if max(byte_us, flop_us) else None,
        gbs=built.bytes / (us * 1e3),
        tflops=built.flops / (us * 1e6),
    )
    row["of_copy"] = row["gbs"] / ceil["copy_gbs"]
    row["of_matmul"] = row["tflops"] / ceil["matmul_tflops"]
    return row


def comparison(row: dict[str, Any], ceil: dict[str, float]) -> str:
    """The headline's same-run comparison: the floor, the torch path, the baselines."""
    if row["bound"] == "flops":
        text = (
            f"{fmt(row['tflops'])} TFLOP/s = {row['of_matmul']:.0%} of the bf16 matmul rate "
            f"({fmt(ceil['matmul_tflops'])} TFLOP/s)"
        )
    else:
        text = (
            f"{row['x_floor']:.1f}x its byte floor of {fmt(row['floor_us'])} us "
            f"({fmt(row['gbs'])} GB/s = {row['of_copy']:.0%} of copy, "
            f"{fmt(ceil['copy_gbs'])} GB/s)"
        )
    parts = [text, f"torch path {fmt(row['torch_us'])} us"]
    parts += [f"{name} {fmt(us)} us" for name, us in row["baselines"].items()]
    return "; ".join(parts)


def run(rec: Record, device: str, check_only: bool = False, names: list[str] | None = None) -> bool:
    """Every case (``names``: those only) into ``rec``; False when a kernel disagrees with its
    torch path or fails."""
    ok = True
    todo = [c for c in cases.KERNEL_CASES if names is None or c.name in names]
    if names and len(todo) != len(names):
        known = ", ".join(c.name for c in cases.KERNEL_CASES)
        raise SystemExit(f"unknown case in {names}; the cases: {known}")
    ceil: dict[str, float] = {}
    if not check_only:
        ceil = ceilings(device)
        rec["ceilings"] = ceil
        print(
            f"{rec['env']['device']}: copy {fmt(ceil['copy_gbs'])} GB/s, bf16 matmul "
            f"{fmt(ceil['matmul_tflops'])} TFLOP/s",
            flush=True,
        )
    for case in todo:
        for shape in case.tiny if check_only else case.shapes:
            row: dict[str, Any] = {"case": case.name, "shape": shape.label, "kernel": case.source}
            try:
                built = case.build(shape.params, device)
                row["agrees"], row["error"] = check(built)
                if not check_only:
                    row.update(measure(built, ceil))
            except Exception as exc:  # a launch that does not compile, a shape out of memory
                row["agrees"], row["failure"] = False, f"{type(exc).__name__}: {exc}"[:500]
                traceback.print_exc()
            built = None
            if device == "cuda":
                torch.cuda.empty_cache()
            ok &= row["agrees"]
            rec.row(**row)
            print(line(row), flush=True)
            if shape.headline and "us" in row:
                rec.headline(
                    f"`{case.name}`, {shape.label}", row["us"], "us", comparison(row, ceil)
                )
    return ok


def line(row: dict[str, Any]) -> str:
    head = f"{row['case']:<24} {row['shape']:<44}"
    if "failure" in row:
        return f"{head} FAILED {row['failure'][:80]}"
    agree = "ok" if row["agrees"] else f"DISAGREES ({row['error']:.2e})"
    if "us" not in row:
        return f"{head} {agree} (error {row['error']:.1e})"
    floor = f"{row['x_floor']:6.1f}x floor ({row['bound']})" if row["x_floor"] else ""
    return f"{head} {fmt(row['us']):>9} us  torch {fmt(row['torch_us']):>9} us  {floor}  {agree}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="tiny shapes, correctness only")
    ap.add_argument("--case", action="append", help="only this case (repeatable)")
    ap.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available")
    ap.add_argument(
        "--out",
        type=Path,
        help=f"results root: ROOT/<date>/kernels.json (default {RESULTS}; with --check none)",
    )
    ap.add_argument("--list", action="store_true", help="the cases and their shapes")
    args = ap.parse_args(argv)
    if args.list:
        for c in cases.KERNEL_CASES:
            print(f"{c.name:<24} {c.about}")
            for s in c.shapes:
                print(f"    {s.label}{'  (headline)' if s.headline else ''}")
        return 0
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device != "cuda" and not args.check:
        raise SystemExit("timing needs a GPU; on a CPU run --check (Triton's interpreter)")
    out = args.out or (None if args.check else RESULTS)
    rec = Record("kernels", out, device, {"check": args.check, "cases": args.case})
    ok = run(rec, device, args.check, args.case)
    print(rec.summary())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
