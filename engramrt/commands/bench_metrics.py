"""The numbers ``engramrt bench serve`` reports, from per-request records: pure functions, so
the definitions (what TTFT, TPOT, ITL count) can be tested without a server.

Keys, labels and the printed block follow ``vllm bench serve`` so that existing scripts and
habits carry over.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

LATENCY_METRICS = ("ttft", "tpot", "itl", "e2el")
# (name printed in the rows, section header), exactly as vLLM prints them.
_METRIC_LABELS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


@dataclass
class RequestRecord:
    """What one request produced; times are ``time.perf_counter()`` seconds."""

    input_tokens: int
    send_time: float = 0.0
    # Arrival time of every chunk that carried non-empty text, in order.
    chunk_times: list[float] = field(default_factory=list)
    output_tokens: int = 0
    success: bool = False
    error: str = ""
    text: str = ""


def percentile_key(p: float) -> str:
    """vLLM's spelling of a percentile in keys and labels: 99 -> '99', 99.9 -> '99.9'."""
    return str(int(p)) if int(p) == p else str(p)


def peak_output_throughput(token_times: Sequence[float], window: float = 1.0) -> float:
    """Most tokens completed within any ``window``-second span, per second.

    A sliding window over the sorted times, so the peak does not depend on where fixed
    buckets happen to start.
    """
    times = np.sort(np.asarray(token_times, dtype=np.float64))
    best, lo = 0, 0
    for hi in range(len(times)):
        while times[hi] - times[lo] >= window:
            lo += 1
        best = max(best, hi - lo + 1)
    return best / window


def _stats(name: str, values: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    """Mean/median/std/percentiles in ms; an empty sample reads as 0 like vLLM's ``x or 0``."""
    arr = np.asarray(values if values else [0.0], dtype=np.float64) * 1000.0
    out = {
        f"mean_{name}_ms": float(np.mean(arr)),
        f"median_{name}_ms": float(np.median(arr)),
        f"std_{name}_ms": float(np.std(arr)),
    }
    for p in percentiles:
        out[f"p{percentile_key(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def compute_metrics(
    records: Sequence[RequestRecord], duration: float, percentiles: Sequence[float]
) -> dict[str, Any]:
    """vLLM's serving metrics from per-request records, keyed like its saved JSON.

    Only successful requests contribute tokens and latencies (vLLM counts failed ones as 0
    output tokens). TTFT = send -> first content chunk; E2EL = send -> last content chunk;
    TPOT = (E2EL - TTFT) / (output_tokens - 1) for requests with more than one output token;
    ITL = every gap between consecutive content chunks. Each content chunk counts as one
    token for the peak throughput, as in vLLM.
    """
    if duration <= 0:
        raise ValueError(f"benchmark duration must be positive, got {duration}")
    ttfts: list[float] = []
    tpots: list[float] = []
    itls: list[float] = []
    e2els: list[float] = []
    token_times: list[float] = []
    output_lens: list[int] = []
    per_request_ttft: list[float] = []
    per_request_itls: list[list[float]] = []
    completed = total_input = 0
    for r in records:
        if not r.success:
            output_lens.append(0)
            per_request_ttft.append(0.0)
            per_request_itls.append([])
            continue
        if not r.chunk_times:
            raise ValueError("a successful request must have at least one content chunk")
        ttft = r.chunk_times[0] - r.send_time
        e2el = r.chunk_times[-1] - r.send_time
        gaps = np.diff(r.chunk_times).tolist()
        if r.output_tokens > 1:
            tpots.append((e2el - ttft) / (r.output_tokens - 1))
        ttfts.append(ttft)
        e2els.append(e2el)
        itls.extend(gaps)
        token_times.extend(r.chunk_times)
        output_lens.append(r.output_tokens)
        per_request_ttft.append(ttft)
        per_request_itls.append(gaps)
        completed += 1
        total_input += r.input_tokens
    total_output = sum(output_lens)
    result: dict[str, Any] = {
        "duration": duration,
        "completed": completed,
        "failed": len(records) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": completed / duration,
        "output_throughput": total_output / duration,
        "max_output_tokens_per_s": peak_output_throughput(token_times),
        "total_token_throughput": (total_input + total_output) / duration,
    }
    for name, values in zip(LATENCY_METRICS, (ttfts, tpots, itls, e2els), strict=True):
        result.update(_stats(name, values, percentiles))
    result.update(
        input_lens=[r.input_tokens for r in records],
        output_lens=output_lens,
        ttfts=per_request_ttft,
        itls=per_request_itls,
        generated_texts=[r.text for r in records],
        errors=[r.error for r in records],
    )
    return result


def format_result(
    m: dict[str, Any],
    percentiles: Sequence[float],
    selected: Sequence[str],
    request_rate: float = float("inf"),
    max_concurrency: int | None = None,
) -> str:
    """The block ``vllm bench serve`` prints, so eyes and greps trained on vLLM still work."""
    lines = [f"{' Serving Benchmark Result ':=^50}"]

    def row(label: str, value: float, fmt: str = "<10.2f") -> None:
        lines.append(f"{label:<40} {value:{fmt}}")

    row("Successful requests:", m["completed"], "<10")
    row("Failed requests:", m["failed"], "<10")
    if max_concurrency is not None:
        row("Maximum request concurrency:", max_concurrency, "<10")
    if request_rate != float("inf"):
        row("Request rate configured (RPS):", request_rate)
    row("Benchmark duration (s):", m["duration"])
    row("Total input tokens:", m["total_input_tokens"], "<10")
    row("Total generated tokens:", m["total_output_tokens"], "<10")
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    for name in LATENCY_METRICS:
        if name not in selected:
            continue
        label, header = _METRIC_LABELS[name]
        lines.append(f"{header:-^50}")
        row(f"Mean {label} (ms):", m[f"mean_{name}_ms"])
        row(f"Median {label} (ms):", m[f"median_{name}_ms"])
        for p in percentiles:
            key = percentile_key(p)
            row(f"P{key} {label} (ms):", m[f"p{key}_{name}_ms"])
    lines.append("=" * 50)
    return "\n".join(lines)
