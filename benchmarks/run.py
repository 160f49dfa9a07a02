"""One runner for the named suites (``benchmarks/suites.py``); each writes
``ROOT/<date>/<suite>.json`` (the device, torch and Triton versions, the command, the date, every
row, and the headline rows BENCHMARKS.md's table shows) and prints a summary.

    python -m benchmarks.run --list
    python -m benchmarks.run --suite all --out ROOT          # the H200 run, under ten minutes
    python -m benchmarks.run --suite v41-decode[,dspark...]  # some suites
    python -m benchmarks.run --suite kernels --check         # tiny shapes, correctness only
    python -m benchmarks.run --suite v41-decode --device cpu --tiny   # a smoke run on a CPU

``all`` runs every suite but ``spec-verify``, each in a process of its own (a suite that fails or
hangs leaves the others theirs; its GPU memory goes back with it) within ``--budget`` seconds:
a suite is given its own limit or what is left of them, whichever is less, and none starts
with less than a minute. A suite saves
its JSON after every row, so one cut short keeps what it measured. ``python -m benchmarks.table``
then rewrites BENCHMARKS.md's table from the newest results.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

from benchmarks.common import DATE_ENV, RESULTS, Record, today

MIN_SUITE_S = 60  # a suite given less than this is not started


def parse_suites(text: str) -> list[str]:
    from benchmarks.suites import SUITES

    if text == "all":
        return [name for name, s in SUITES.items() if s.in_all]
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SUITES]
    if unknown or not names:
        raise SystemExit(f"unknown suite {unknown}; the suites: {', '.join(SUITES)}, all")
    return names


def run_one(name: str, args: argparse.Namespace, device: str) -> str:
    """The suite in this process: 'ok', 'failed' or why it did not run."""
    from benchmarks.suites import SUITES, Context

    suite = SUITES[name]
    missing = [m for m in suite.needs if importlib.util.find_spec(m) is None]
    if name == "serving" and missing:
        print(f"serving: {', '.join(missing)} not installed: bench throughput only", flush=True)
    elif missing:
        return f"skipped: {', '.join(missing)} not installed"
    if name != "kernels" and importlib.util.find_spec("msgspec") is None:
        return "skipped: msgspec (the engine's) not installed"
    ctx = Context(device, tiny=args.tiny, check=args.check, models=args.models, model=args.model)
    out = args.out or (None if args.check or args.tiny else RESULTS)  # smoke runs: no file
    options = {"tiny": args.tiny, "check": args.check, "model": args.model}
    rec = Record(name, out, device, {k: v for k, v in options.items() if v})
    print(f"== {name}: {suite.about}", flush=True)
    try:
        ok = suite.run(rec, ctx)
    except Exception:
        traceback.print_exc()
        rec["failure"] = traceback.format_exc()[-3000:]
        ok = False
    rec["ok"] = ok
    print(rec.summary(), flush=True)
    return "ok" if ok else "failed"


SKIPPED = 3  # a child's exit status when its suite could not run here


def child(name: str, args: argparse.Namespace, device: str, timeout: float) -> str:
    """The suite in a process of its own, stopped after ``timeout`` seconds."""
    cmd = [sys.executable, "-m", "benchmarks.run", "--suite", name, "--no-isolate"]
    cmd += ["--device", device, "--models", str(args.models)]
    cmd += ["--out", str(args.out)] if args.out else []
    cmd += ["--tiny"] * args.tiny + ["--check"] * args.check
    cmd += ["--model", str(args.model)] if args.model else []
    proc = subprocess.Popen(cmd, start_new_session=True)  # its group: the server it starts too
    try:
        rc = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        for sig, wait in ((signal.SIGTERM, 15), (signal.SIGKILL, 15)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(wait)
                break
        return f"stopped after {timeout:.0f} s (its JSON keeps the rows it saved)"
    return {0: "ok", SKIPPED: "skipped (its output says why)"}.get(rc, f"failed (exit {rc})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", default="all", help="a name, names joined by commas, or all")
    ap.add_argument(
        "--out", type=Path, help=f"results root (default {RESULTS}; with --tiny or --check none)"
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda if available")
    ap.add_argument("--tiny", action="store_true", help="the bundled models, tiny sizes")
    ap.add_argument("--check", action="store_true", help="kernels: correctness only, no file")
    ap.add_argument(
        "--models",
        type=Path,
        default=Path("/tmp/engramrt-models"),
        help="where the preset models are written, once (default %(default)s)",
    )
    ap.add_argument("--model", type=Path, help="this model directory instead of the preset")
    ap.add_argument("--budget", type=float, default=570, help="seconds for several suites")
    ap.add_argument(
        "--isolate",
        action=argparse.BooleanOptionalAction,
        help="several suites: each in a process of its own (default: on a GPU)",
    )
    ap.add_argument("--list", action="store_true", help="the suites")
    args = ap.parse_args(argv)
    from benchmarks.suites import SUITES

    if args.list:
        for s in SUITES.values():
            print(f"{s.name:<12} {'' if s.in_all else '(not in all) '}{s.about}")
        return 0
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    names = parse_suites(args.suite)
    isolate = args.isolate if args.isolate is not None else device == "cuda" and len(names) > 1
    start, status = time.monotonic(), {}
    os.environ.setdefault(DATE_ENV, today())  # one date folder for the whole run
    for name in names:
        left = args.budget - (time.monotonic() - start)
        if isolate and left < MIN_SUITE_S:
            status[name] = f"not started: {left:.0f} s of the budget left"
        elif isolate:
            status[name] = child(name, args, device, min(SUITES[name].timeout_s, left))
        else:
            status[name] = run_one(name, args, device)
    if len(names) > 1:
        print(f"\n{time.monotonic() - start:.0f} s")
        for name, st in status.items():
            print(f"  {name:<12} {st}")
    if all(st.startswith("skipped") for st in status.values()):
        return SKIPPED
    return 0 if all(st == "ok" or st.startswith("skipped") for st in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
