"""``engramrt bench serve``: a ``vllm bench serve``-style load generator for /v1/completions.

Flags, the printed block and the saved JSON keys follow vLLM so that existing scripts and habits
carry over. The metric math lives in the pure :func:`compute_metrics` so it can be tested
without a server; the streaming client only records timestamps.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
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
_NO_CONTENT = "Never received a valid chunk to calculate TTFT. This response is marked as failed!"


# --------------------------------------------------------------------------- records + metrics


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


# --------------------------------------------------------------------------- arrivals + prompts


def arrival_offsets(num_requests: int, request_rate: float, seed: int) -> np.ndarray:
    """Send times (s after the start) of a Poisson process with ``request_rate`` req/s.

    The first request goes at 0 and the gaps are exponential with mean 1/rate; an infinite rate
    sends everything at once. Absolute offsets (not per-request sleeps) keep the schedule from
    drifting when the event loop is busy.
    """
    if num_requests <= 0:
        return np.zeros(0)
    if request_rate == float("inf"):
        return np.zeros(num_requests)
    if not request_rate > 0:
        raise ValueError(f"--request-rate must be positive, got {request_rate}")
    rng = np.random.default_rng([seed, 1])  # a stream separate from the prompts'
    gaps = rng.exponential(1.0 / request_rate, size=num_requests - 1)
    return np.concatenate([[0.0], np.cumsum(gaps)])


def sampleable_token_ids(tokenizer: Any) -> np.ndarray:
    """Vocabulary ids minus added/special tokens, which would change how the model sees a prompt."""
    vocab = tokenizer.get_vocab_size(with_added_tokens=True)
    special = np.fromiter(tokenizer.get_added_tokens_decoder().keys(), dtype=np.int64)
    ids = np.setdiff1d(np.arange(vocab, dtype=np.int64), special)
    if ids.size == 0:
        raise ValueError("the tokenizer has no non-special tokens to sample prompts from")
    return ids


def random_prompts(
    allowed_ids: np.ndarray, num_prompts: int, input_len: int, seed: int
) -> list[list[int]]:
    """Uniform random token-id prompts; sent as ids so every prompt has exactly ``input_len``."""
    rng = np.random.default_rng(seed)
    return rng.choice(allowed_ids, size=(num_prompts, input_len)).tolist()


# --------------------------------------------------------------------------- SSE client


class SSEDecoder:
    """Splits an SSE byte stream into ``data:`` payloads, whatever the network chunking.

    Each ``data:`` line is its own payload (OpenAI-style servers send one per event);
    blank lines, ``:`` keep-alive comments and other fields are skipped. Lines are split on
    bytes before decoding so a multi-byte character cut by the network stays intact.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[str]:
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        return [p for p in map(self._payload, lines) if p is not None]

    def flush(self) -> list[str]:
        """A last line that had no newline."""
        rest, self._buf = self._buf, b""
        p = self._payload(rest)
        return [] if p is None else [p]

    @staticmethod
    def _payload(raw: bytes) -> str | None:
        line = raw.decode("utf-8").rstrip("\r")
        if not line.startswith("data:"):
            return None
        value = line[5:]
        return value[1:] if value.startswith(" ") else value


def _error_message(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or json.dumps(err))
    return str(err)


class CompletionStream:
    """Turns one streamed /v1/completions response body into a :class:`RequestRecord`.

    Pure apart from the timestamps it is handed, so crafted byte streams can test it.
    """

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.decoder = SSEDecoder()
        self.done = False  # [DONE] seen, or the stream reported an error
        self._usage_tokens: int | None = None

    def feed(self, data: bytes, now: float) -> bool:
        """Consume bytes that arrived at ``now``; True once nothing more is expected."""
        for payload in self.decoder.feed(data):
            self._payload(payload, now)
            if self.done:
                break
        return self.done

    def _payload(self, payload: str, now: float) -> None:
        r = self.record
        if payload.strip() == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError:
            r.error = f"invalid JSON in stream: {payload[:200]!r}"
            self.done = True
            return
        if not isinstance(obj, dict):
            r.error = f"unexpected stream chunk: {payload[:200]!r}"
            self.done = True
            return
        if "error" in obj or obj.get("object") == "error":
            r.error = _error_message(obj.get("error", obj))
            self.done = True
            return
        choices = obj.get("choices") or []
        text = (choices[0].get("text") or "") if choices else ""
        if text:
            r.chunk_times.append(now)
            r.text += text
        usage = obj.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self._usage_tokens = int(usage["completion_tokens"])

    def finish(self, now: float) -> RequestRecord:
        """Settle success, error and the output token count once the body has ended."""
        r = self.record
        if not self.done:
            for payload in self.decoder.flush():
                self._payload(payload, now)
                if self.done:
                    break
        if not r.error and not self.done:
            r.error = "the stream ended without data: [DONE]"
        if not r.error and not r.chunk_times:
            r.error = _NO_CONTENT
        r.success = not r.error
        r.output_tokens = (
            self._usage_tokens if self._usage_tokens is not None else len(r.chunk_times)
        )
        return r


async def send_request(
    client: Any, url: str, payload: dict[str, Any], headers: dict[str, str], input_tokens: int
) -> RequestRecord:
    """One streamed completion; never raises, so one bad request cannot sink the run."""
    record = RequestRecord(input_tokens=input_tokens)
    stream = CompletionStream(record)
    record.send_time = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                record.error = f"HTTP {resp.status_code}: {body[:500]}"
                return record
            async for data in resp.aiter_bytes():
                if stream.feed(data, time.perf_counter()):
                    break
        stream.finish(time.perf_counter())
    except Exception as exc:  # any failure is recorded, not raised
        record.success = False
        record.error = f"{type(exc).__name__}: {exc}".rstrip(": ")
    return record


# --------------------------------------------------------------------------- the command


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _metric_names(text: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    bad = [n for n in names if n not in LATENCY_METRICS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"choose from {','.join(LATENCY_METRICS)}, got {text!r}")
    return names


def _percentiles(text: str) -> list[float]:
    try:
        values = [float(v) for v in text.split(",") if v.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"comma-separated numbers, got {text!r}") from exc
    if not values or any(not 0 <= v <= 100 for v in values):
        raise argparse.ArgumentTypeError(f"percentiles must lie in [0, 100], got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``vllm bench serve``'s flags (the subset that applies here), same names and defaults."""
    p.add_argument("--backend", choices=["openai", "vllm"], default="openai")
    p.add_argument("--base-url", help="server URL, e.g. http://127.0.0.1:8000 (beats --host)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--api-key", help="sent as Bearer (default: $OPENAI_API_KEY, else none)")
    p.add_argument("--dataset-name", choices=["random"], default="random")
    p.add_argument("--random-input-len", type=_positive_int, default=32)
    p.add_argument("--random-output-len", type=_positive_int, default=16)
    p.add_argument("--num-prompts", type=_positive_int, default=100)
    p.add_argument(
        "--request-rate",
        type=_positive_float,
        default=float("inf"),
        help="requests/s, Poisson arrivals (default inf: all at once)",
    )
    p.add_argument("--max-concurrency", type=_positive_int, help="cap on in-flight requests")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--percentile-metrics",
        type=_metric_names,
        default=["ttft", "tpot", "itl"],
        help="which of ttft,tpot,itl,e2el to print (default ttft,tpot,itl)",
    )
    p.add_argument(
        "--metric-percentiles",
        type=_percentiles,
        default=[99.0],
        help="comma-separated percentiles, e.g. 50,90,99 (default 99)",
    )
    p.add_argument("--save-result", action="store_true", help="write the results as JSON")
    p.add_argument("--result-dir", help="where --save-result writes (default: cwd)")
    p.add_argument("--result-filename", help="default: vLLM's {backend}-{rate}qps-...json")
    p.add_argument(
        "--tokenizer", help="directory with tokenizer.json (default: the bundled model's)"
    )
    p.add_argument("--disable-tqdm", action="store_true")


def _load_tokenizer(path: str | None) -> tuple[Any, str]:
    from tokenizers import Tokenizer

    if path is None:
        from engramrt.bundled import DEFAULT_MODEL_DIR

        path = str(DEFAULT_MODEL_DIR)
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"--tokenizer: no tokenizer.json at {path}")
    return Tokenizer.from_file(str(file)), path


async def _first_model(client: Any, base_url: str, headers: dict[str, str]) -> str:
    resp = await client.get(f"{base_url}/v1/models", headers=headers)
    if resp.status_code != 200:
        raise RuntimeError(f"GET /v1/models: HTTP {resp.status_code}: {resp.text[:500]}")
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError("GET /v1/models lists no models; pass --model")
    return str(data[0]["id"])


def _raise_fd_limit(wanted: int) -> None:
    """Every concurrent request holds a socket; lift the soft fd limit as far as allowed."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        if soft != resource.RLIM_INFINITY and soft < target:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ImportError, ValueError, OSError):
        pass


async def _bench(args: argparse.Namespace, prompts: list[list[int]]) -> tuple[dict, str] | None:
    import httpx

    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    url = f"{base_url}{args.endpoint}"
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=args.max_concurrency, max_keepalive_connections=None)
    # No read/pool timeout: a request may queue server-side for a long time under load.
    timeout = httpx.Timeout(None, connect=60.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout) as client:
        model = args.model
        if model is None:
            try:
                model = await _first_model(client, base_url, headers)
            except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as exc:
                print(
                    f"engramrt bench serve: cannot list models at {base_url}: {exc}",
                    file=sys.stderr,
                )
                return None

        def payload(ids: list[int]) -> dict[str, Any]:
            body: dict[str, Any] = {
                "model": model,
                "prompt": ids,
                "max_tokens": args.random_output_len,
                "temperature": 0.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if args.ignore_eos:
                body["ignore_eos"] = True
            return body

        # vLLM's initial single-prompt run: fail fast on a bad setup, and keep cold-start
        # costs (first connection, lazy initialisation) out of the measured run.
        print("Starting initial single prompt test run...")
        test = await send_request(client, url, payload(prompts[0]), headers, len(prompts[0]))
        if not test.success:
            print(f"engramrt bench serve: initial test run failed: {test.error}", file=sys.stderr)
            return None
        print("Initial test run completed. Starting main benchmark run...")
        print(f"Traffic request rate: {args.request_rate}")
        print(f"Maximum request concurrency: {args.max_concurrency}")

        pbar = None
        if not args.disable_tqdm:
            from tqdm import tqdm

            pbar = tqdm(total=len(prompts))
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

        async def one(ids: list[int]) -> RequestRecord:
            if sem is None:
                rec = await send_request(client, url, payload(ids), headers, len(ids))
            else:
                async with sem:
                    rec = await send_request(client, url, payload(ids), headers, len(ids))
            if pbar is not None:
                pbar.update(1)
            return rec

        offsets = arrival_offsets(len(prompts), args.request_rate, args.seed)
        start = time.perf_counter()
        tasks = []
        for ids, offset in zip(prompts, offsets, strict=True):
            delay = start + float(offset) - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(ids)))
        records = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if pbar is not None:
            pbar.close()
    return compute_metrics(records, duration, args.metric_percentiles), model


def run(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 when at least one request succeeded and none failed, else 1."""
    tokenizer, tokenizer_id = _load_tokenizer(args.tokenizer)
    prompts = random_prompts(
        sampleable_token_ids(tokenizer), args.num_prompts, args.random_input_len, args.seed
    )
    _raise_fd_limit(len(prompts) + 256)
    outcome = asyncio.run(_bench(args, prompts))
    if outcome is None:
        return 1
    metrics, model = outcome
    print(
        format_result(
            metrics,
            args.metric_percentiles,
            args.percentile_metrics,
            args.request_rate,
            args.max_concurrency,
        )
    )
    if args.save_result:
        now = datetime.now().strftime("%Y%m%d-%H%M%S")
        rate = args.request_rate if args.request_rate < float("inf") else "inf"
        result = {
            "date": now,
            "backend": args.backend,
            "model_id": model,
            "tokenizer_id": tokenizer_id,
            "num_prompts": args.num_prompts,
            "request_rate": rate,
            "max_concurrency": args.max_concurrency,
            **metrics,
        }
        conc = f"-concurrency{args.max_concurrency}" if args.max_concurrency else ""
        name = args.result_filename or (
            f"{args.backend}-{args.request_rate}qps{conc}-{Path(model).name}-{now}.json"
        )
        path = Path(args.result_dir or ".") / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result))
        print(f"Saved results to {path}")
    ok = metrics["completed"] > 0 and metrics["failed"] == 0
    return 0 if ok else 1
