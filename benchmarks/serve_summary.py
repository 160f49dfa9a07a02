"""One line per ``engramrt bench serve`` result file: throughput, TTFT, TPOT and the inter-token
latency distribution (what a median hides: the share of time spent in gaps above 10 ms).

    python benchmarks/serve_summary.py OUT/a/serve-c64.json [...]
"""

from __future__ import annotations

import argparse
import json

import numpy as np


def summary(path: str) -> dict:
    with open(path) as f:
        r = json.load(f)
    itl = np.array([x for req in r["itls"] for x in req]) * 1e3
    row = {"file": path, "output_tok_s": round(r["output_throughput"], 1)}
    for k in ("median_ttft_ms", "p99_ttft_ms", "median_tpot_ms", "p99_tpot_ms"):
        row[k] = round(r[k], 2)
    if itl.size:
        row["itl_p10_p50_p90_p99_ms"] = [
            round(float(np.percentile(itl, q)), 2) for q in (10, 50, 90, 99)
        ]
        row["time_in_gaps_over_10ms"] = round(float(itl[itl > 10].sum() / itl.sum()), 3)
    return row


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", help="bench serve --save-result files")
    for p in ap.parse_args().results:
        print(json.dumps(summary(p)))
