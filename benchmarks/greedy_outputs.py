"""Fixed greedy prompts against a running server, and a comparison of two such runs: the
tokens and logprobs that two deployments (say PP = 2 over NCCL and PP = 1) give must agree.

    python benchmarks/greedy_outputs.py get --port 8000 --out pp2.json
    python benchmarks/greedy_outputs.py compare pp1.json pp2.json

The prompts are sent all at once (one continuous batch) and then one by one (batch of one), so
both the batched and the lone decode path are compared. Tokens must be identical; logprobs are
reported, since in bf16 the batches that concurrent requests happen to form change the rounding.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx

PROMPTS = [
    "The Engram hashes every token of this prompt.",
    "A pipeline stage may begin on an Engram layer.",
    "Hi",
    "Sinkhorn normalisation makes each mixing matrix doubly stochastic,",
    "def fib(n):\n    return",
    "1, 2, 3, 5, 8, 13,",
    "Paris is the capital of",
    "\u4f60\u597d\uff0c\u4e16\u754c",
]


def complete(base: str, prompt: str, max_tokens: int) -> dict:
    body = {
        "model": "",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "logprobs": 1,
        "ignore_eos": True,
    }
    models = httpx.get(f"{base}/v1/models", timeout=30).json()["data"]
    body["model"] = models[0]["id"]
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
    r.raise_for_status()
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    return {"text": choice["text"], "tokens": lp["tokens"], "logprobs": lp["token_logprobs"]}


def get(args: argparse.Namespace) -> None:
    base = f"http://{args.host}:{args.port}"
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        batched = list(pool.map(lambda p: complete(base, p, args.max_tokens), PROMPTS))
    alone = [complete(base, p, args.max_tokens) for p in PROMPTS]
    with open(args.out, "w") as f:
        json.dump({"prompts": PROMPTS, "batched": batched, "alone": alone}, f, indent=1)


def compare(args: argparse.Namespace) -> int:
    runs = [json.load(open(path)) for path in (args.a, args.b)]
    bad = 0
    for mode in ("batched", "alone"):
        for i, (x, y) in enumerate(zip(runs[0][mode], runs[1][mode], strict=True)):
            same = x["tokens"] == y["tokens"]
            gaps = [abs(p - q) for p, q in zip(x["logprobs"], y["logprobs"], strict=False)]
            dlp = math.nan if any(map(math.isnan, gaps)) else max(gaps, default=0.0)
            bad += not same or math.isnan(dlp) or (args.atol is not None and dlp > args.atol)
            print(
                f"{mode:<8} prompt {i}: tokens {'identical' if same else 'DIFFER'}, "
                f"max |dlogprob| {dlp:.3g}"
            )
    print(f"{bad} of {2 * len(runs[0]['prompts'])} outputs differ" if bad else "all identical")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("get")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("a")
    c.add_argument("b")
    c.add_argument("--atol", type=float, help="also fail above this |dlogprob|")
    args = ap.parse_args()
    if args.cmd == "get":
        get(args)
        return 0
    return compare(args)


if __name__ == "__main__":
    sys.exit(main())
