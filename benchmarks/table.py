"""BENCHMARKS.md's table of current numbers, regenerated from the newest results: for each suite
the newest ``benchmarks/results/<date>/<suite>.json`` with headline rows (a dated folder before
``seed/``, which holds the numbers carried over from ``benchmarks/HISTORY.md`` until the suite
runs; smoke runs, ``--tiny``, never count), its headline rows in gpt-fast's form: what, the
number, the comparison measured in the same run, date, device, command, the file it came from.

    python -m benchmarks.table            # rewrite the block between the two markers
    python -m benchmarks.table --check    # exit 1 when the block is not what the results give
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DOC = ROOT / "BENCHMARKS.md"
BEGIN = "<!-- BEGIN current numbers: `python -m benchmarks.table` writes this table -->"
END = "<!-- END current numbers -->"
COLUMNS = ("What", "Number", "Same-run comparison", "Date", "Device", "Command", "Source")
ORDER = ("kernels", "gqa-decode", "v41-decode", "v41-prefill", "dspark", "spec-verify", "serving")
DATED = re.compile(r"\d{4}-\d{2}-\d{2}")


def fmt(value: float, digits: int | None = None) -> str:
    """Three significant figures or so, thousands separated."""
    if digits is None:
        a = abs(value)
        digits = 0 if a >= 100 else 1 if a >= 10 else 2 if a >= 1 else 3
    return f"{value:,.{digits}f}"


def newest(results: Path) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Each suite's newest result file with headline rows (dated folders, newest first, then
    ``seed/``)."""
    found: dict[str, tuple[tuple, Path, dict[str, Any]]] = {}
    for path in sorted(Path(results).glob("*/*.json")):
        data = json.loads(path.read_text())
        options = data.get("options") or {}
        if not data.get("headline") or options.get("tiny") or options.get("check"):
            continue
        folder = path.parent.name
        rank = (1, folder) if DATED.fullmatch(folder) else (0, folder)
        suite = data.get("suite", path.stem)
        if suite not in found or rank > found[suite][0]:
            found[suite] = (rank, path, data)
    return {suite: (path, data) for suite, (_, path, data) in found.items()}


def _unit(unit: str) -> str:
    return unit if unit == "x" else f" {unit}"


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def rows(results: Path) -> list[dict[str, str]]:
    """The table's rows, suite by suite in ``ORDER`` (others after, by name)."""
    found = newest(results)
    out = []
    for suite in sorted(found, key=lambda s: (ORDER.index(s) if s in ORDER else len(ORDER), s)):
        path, data = found[suite]
        try:
            source = path.relative_to(ROOT).as_posix()
        except ValueError:
            source = path.as_posix()
        for h in data["headline"]:
            command = h.get("command") or data.get("command", "")
            out.append(
                {
                    "What": h["what"],
                    "Number": fmt(h["value"], h.get("digits")) + _unit(h["unit"]),
                    "Same-run comparison": h["comparison"],
                    "Date": h.get("date") or data["date"][:10],
                    "Device": h.get("device") or data["env"]["device"],
                    "Command": f"`{command}`" if command else "",
                    "Source": h.get("source") or source,
                }
            )
    return out


def render(table: list[dict[str, str]]) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(_cell(r[c]) for c in COLUMNS) + " |" for r in table]
    return "\n".join(lines)


def parse(text: str) -> list[dict[str, str]]:
    """The rows of the block between the markers of ``text`` (``render``'s inverse)."""
    block = text[text.index(BEGIN) + len(BEGIN) : text.index(END)]
    lines = [line for line in block.strip().splitlines() if line.startswith("|")]
    out = []
    for line in lines[2:]:
        cells = re.split(r"(?<!\\)\|", line.strip())[1:-1]
        out.append({c: v.strip().replace("\\|", "|") for c, v in zip(COLUMNS, cells, strict=True)})
    return out


def rewrite(doc: str, table: str) -> str:
    if BEGIN not in doc or END not in doc:
        raise SystemExit(f"the document has no block between {BEGIN!r} and {END!r}")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument("--doc", type=Path, default=DOC)
    ap.add_argument("--check", action="store_true", help="only say whether the block is current")
    args = ap.parse_args(argv)
    table = rows(args.results)
    text = args.doc.read_text()
    new = rewrite(text, render(table))
    if args.check:
        if new != text:
            print(f"{args.doc}: not what {args.results} gives; run python -m benchmarks.table")
            return 1
        return 0
    args.doc.write_text(new)
    print(f"{args.doc}: {len(table)} rows from {len(newest(args.results))} suites")
    return 0


if __name__ == "__main__":
    sys.exit(main())
