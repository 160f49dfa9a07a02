"""``engramrt bench serve``: a ``vllm bench serve``-style load generator for /v1/completions.

Flags, the printed block and the saved JSON keys follow vLLM so that existing scripts and habits
carry over. This module holds the workload (random prompts, Poisson arrivals) and the run;
:mod:`engramrt.commands.bench_client` streams each request and records timestamps, and
:mod:`engramrt.commands.bench_metrics` turns the records into the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from engramrt.commands.bench_client import send_request
from engramrt.commands.bench_metrics import (
    LATENCY_METRICS,
    RequestRecord,
    compute_metrics,
    format_result,
)

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
    from engramrt.engram.token_map import read_tokenizer

    if path is None:
        from engramrt.bundled import DEFAULT_MODEL_DIR

        path = str(DEFAULT_MODEL_DIR)
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"--tokenizer: no tokenizer.json at {path}")
    return read_tokenizer(file), path


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
