"""Launch settings of the stored-format linear (``engramrt.kernels.stored_linear``) by weight
shape, from a sweep on the GPU: every setting timed at 1, 16 and 64 rows (graph replays after an
L2 flush), and the one kept whose worst ratio to each row count's best is least (the settings
may not depend on the row count: that is what keeps a row's bits the same in any batch).

    python -m benchmarks.linear_sweep [--out FILE.json] [--write] [--quick | --near] [--only a,b]

``--write`` saves the picks where the kernel reads them (``stored_linear_tuned.json``). Each
shape's time is printed against its byte floor (the weight bytes the rows reach, the
activations and outputs, over the copy rate measured in the same run).
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch

from benchmarks import cases
from benchmarks.common import copy_gbs, gpu_us

TOP_K = 6
ROWS = (1, 16, 64)


# (BN, G, warps, stages, splits): features a program, blocks an iteration (FP4: 2 or 4, a load
# holds two), warps, pipeline stages, K splits
OPTIONS = ((64, 128, 256), (1, 2, 4), (4, 8), (3, 4, 6), (1, 2, 4, 8, 16))


def configs(quick: bool, fp4: bool) -> list[tuple[int, int, int, int, int]]:
    out = [c for c in itertools.product(*OPTIONS) if _valid(c, fp4)]
    return out[::7] if quick else out


def _valid(c: tuple, fp4: bool) -> bool:
    bn, g, warps = c[:3]
    return not (bn == 64 and warps == 8) and (g > 1 or not fp4)


def near(current: tuple, fp4: bool) -> list[tuple[int, int, int, int, int]]:
    """``current`` and the settings that differ from it in one place (a cheap refinement)."""
    out = {tuple(current)}
    for i, options in enumerate(OPTIONS):
        out |= {(*current[:i], v, *current[i + 1 :]) for v in options}
    if fp4:  # and more bytes in flight a program together: wider tiles, longer loads, stages
        splits = current[4]
        out |= set(itertools.product((128, 256), (2, 4), (4,), (3, 4), (splits, 2 * splits)))
    return sorted(c for c in out if _valid(c, fp4))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--quick", action="store_true", help="every seventh setting")
    ap.add_argument("--near", action="store_true", help="the current settings' neighbours only")
    ap.add_argument("--write", action="store_true", help="save the picks for the kernel")
    ap.add_argument("--only", help="these shapes (names joined by commas), the others' picks kept")
    args = ap.parse_args(argv)
    dev = "cuda"
    gbs = copy_gbs(dev)
    report, tuned, started = [], {}, time.time()
    only = args.only.split(",") if args.only else None
    for name, fp4, n, k, experts, groups in cases.FLASH_LINEARS:
        if only is not None and name not in only:
            continue
        times: dict[tuple, list[float]] = {}
        floors = []
        for m in ROWS:
            run, bytes_, now = cases.stored_linear_sweep(fp4, n, k, experts, TOP_K, m, dev, groups)
            floors.append(bytes_ / gbs / 1e3)
            want = run(now).float()
            for c in near(now, fp4) if args.near else configs(args.quick, fp4):
                if c[4] > k // 32 // c[1]:
                    continue
                try:
                    got = run(c).float()
                    if not torch.equal(got, want) and (got - want).norm() > 1e-3 * want.norm():
                        raise AssertionError(f"{name} {c}: wrong result")
                    times.setdefault(c, []).append(gpu_us(lambda c=c: run(c))[0])
                except Exception as e:  # a setting the compiler refuses (shared memory)
                    print(f"{name} m={m} {c}: {type(e).__name__} {str(e)[:120]}", flush=True)
        full = {c: t for c, t in times.items() if len(t) == len(ROWS)}
        best_at = [min(t[i] for t in full.values()) for i in range(len(ROWS))]
        pick = min(full, key=lambda c: max(t / b for t, b in zip(full[c], best_at, strict=True)))
        tuned[(fp4, n, k)] = pick
        row = {
            "name": name,
            "fp4": fp4,
            "n": n,
            "k": k,
            "rows": ROWS,
            "pick": pick,
            "us": full[pick],
            "best_us": best_at,
            "before_us": full.get(now),
            "floor_us": floors,
            "x_floor": [t / f for t, f in zip(full[pick], floors, strict=True)],
            "every": [[list(c), t] for c, t in sorted(full.items())],  # each setting's times
        }
        report.append(row)
        if args.write:  # after each shape: a sweep cut short keeps what it found
            cases.save_stored_linear_settings(tuned)
        print(
            f"{name:12} {'FP4' if fp4 else 'FP8'} {n}x{k} pick {pick}: "
            + ", ".join(
                f"m={m} {t:.1f} us ({t / f:.2f}x floor)"
                for m, t, f in zip(ROWS, full[pick], floors, strict=True)
            )
            + f"; before {now}: {', '.join(f'{t:.1f}' for t in full.get(now, []))} us",
            flush=True,
        )
    print(f"copy {gbs:.0f} GB/s; sweep {time.time() - started:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"copy_gbs": gbs, "shapes": report}, f, indent=1)
    if args.write:
        print(f"settings written to {cases.save_stored_linear_settings(tuned)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
