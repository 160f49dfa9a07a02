"""``engramrt eval``: accuracy on a task file, against a server or a server started here.

A task file is JSONL. ``{"prompt": ..., "answer": ...}`` is scored by greedy exact match (the
completion, stripped, equals the answer, stripped); ``{"prompt": ..., "choices": [...],
"answer": index or text}`` by loglikelihood, as lm-eval's multiple choice: the choice whose
tokens the model finds likeliest after the prompt (prompt + choice echoed with logprobs; the
choice's tokens are those whose text offset lies past the prompt). Requests go out
concurrently, so the engine batches them.

Without ``--base-url`` each arm starts ``engramrt serve`` on a free port with the arm's flags
(``--engram off`` skips every Engram layer; ``-pp 2 --pp-layer-partition 1,1`` pipelines) and
stops it afterwards. ``--ab NAME=FLAGS ...`` runs several arms and prints one table: accuracy,
its difference from the first arm, and how many items each arm answers as the first does.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from tqdm import tqdm

from engramrt.commands.child import engramrt_command


@dataclass
class Item:
    prompt: str
    answer: str | int
    choices: list[str] | None = None
    stop: list[str] | None = None  # exact match: where the answer ends (default: a newline)


@dataclass
class Scored:
    picked: str  # the completion, or the chosen choice
    correct: bool


def load_tasks(path: str | Path, limit: int | None = None) -> list[Item]:
    items = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            item = Item(str(obj["prompt"]), obj["answer"], obj.get("choices"), obj.get("stop"))
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"{path}:{n}: not a task ({exc})") from None
        if item.choices is not None and not (
            (isinstance(item.answer, int) and 0 <= item.answer < len(item.choices))
            or item.answer in item.choices
        ):
            raise ValueError(f"{path}:{n}: answer {item.answer!r} is not one of the choices")
        items.append(item)
    return items[:limit]


def choice_loglikelihood(prompt: str, logprobs: dict, text: str) -> float:
    """Sum of the logprobs of the echoed tokens that hold any of the choice's text: a token
    that starts inside the prompt (" Paris" after "is") belongs to the choice it ends in."""
    offsets = logprobs["text_offset"]
    ends = [*offsets[1:], len(text)]
    pairs = zip(ends, logprobs["token_logprobs"], strict=True)
    return sum(lp for end, lp in pairs if end > len(prompt) and lp is not None)


class Client:
    def __init__(self, base_url: str, max_tokens: int, concurrency: int):
        self.http = httpx.AsyncClient(base_url=base_url.rstrip("/"), timeout=600)
        self.max_tokens, self.gate = max_tokens, asyncio.Semaphore(concurrency)

    async def _complete(self, **body) -> dict:
        async with self.gate:
            try:
                r = await self.http.post("/v1/completions", json={"temperature": 0, **body})
            except httpx.TransportError as exc:
                raise RuntimeError(
                    f"cannot reach the server at {self.http.base_url}: {exc or type(exc).__name__}"
                ) from None
        if r.status_code != 200:
            raise RuntimeError(f"the server answered {r.status_code}: {r.text[:300]}")
        return r.json()["choices"][0]

    async def score(self, item: Item) -> Scored:
        if item.choices is None:
            stop = item.stop if item.stop is not None else ["\n"]
            out = await self._complete(prompt=item.prompt, max_tokens=self.max_tokens, stop=stop)
            text = out["text"]
            return Scored(text, text.strip() == str(item.answer).strip())
        outs = await asyncio.gather(
            *(
                self._complete(prompt=item.prompt + c, max_tokens=0, echo=True, logprobs=0)
                for c in item.choices
            )
        )
        lls = [choice_loglikelihood(item.prompt, o["logprobs"], o["text"]) for o in outs]
        best = max(range(len(lls)), key=lls.__getitem__)
        want = item.answer if isinstance(item.answer, int) else item.choices.index(item.answer)
        return Scored(item.choices[best], best == want)


async def evaluate(
    base_url: str, items: list[Item], max_tokens: int, concurrency: int, label: str = ""
) -> list[Scored]:
    client = Client(base_url, max_tokens, concurrency)
    bar = tqdm(total=len(items), desc=label or "eval", disable=not sys.stderr.isatty())

    async def one(item: Item) -> Scored:
        s = await client.score(item)
        bar.update()
        return s

    try:
        return list(await asyncio.gather(*(one(i) for i in items)))
    finally:
        bar.close()
        await client.http.aclose()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """``engramrt serve`` in a child process for one arm."""

    def __init__(
        self,
        model: str | None,
        flags: list[str],
        wait_s: float = 900,
        env: dict[str, str] | None = None,
    ):
        self.port = _free_port()
        cmd = engramrt_command(
            "serve",
            *([model] if model else []),
            "--port",
            str(self.port),
            "--disable-uvicorn-access-log",
            *flags,
        )
        self.log = tempfile.TemporaryFile("w+")  # a pipe could fill up and stall the server
        self.proc = subprocess.Popen(
            cmd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.log.seek(0)
                tail = self.log.read()[-2000:].strip()
                self.log.close()
                raise RuntimeError(f"engramrt serve {shlex.join(flags)} exited: {tail}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.close()
        raise RuntimeError(f"engramrt serve {shlex.join(flags)} did not start in {wait_s:.0f} s")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def _is_env(token: str) -> bool:
    """An arm's ``NAME=VALUE`` words set its server's environment, as in a shell command line."""
    name, eq, _ = token.partition("=")
    return bool(eq) and name.isidentifier() and not token.startswith("-")


def run_arm(args: argparse.Namespace, items: list[Item], name: str, flags: list[str]) -> dict:
    if args.base_url:
        scored = asyncio.run(
            evaluate(args.base_url, items, args.max_tokens, args.concurrency, name)
        )
    else:
        env = dict(f.split("=", 1) for f in flags if _is_env(f))
        server = LocalServer(args.model, [f for f in flags if not _is_env(f)], env=env)
        try:
            scored = asyncio.run(
                evaluate(server.url, items, args.max_tokens, args.concurrency, name)
            )
        finally:
            server.close()
    correct = sum(s.correct for s in scored)
    return {
        "arm": name,
        "flags": flags,
        "items": len(items),
        "correct": correct,
        "accuracy": correct / max(len(items), 1),
        "results": [asdict(s) for s in scored],
    }


def table(arms: list[dict]) -> str:
    first = arms[0]
    rows = [
        "| arm | accuracy | correct | Δ | same answers as the first arm |",
        "|---|---:|---:|---:|---:|",
    ]
    for a in arms:
        agree = sum(
            x["picked"] == y["picked"] for x, y in zip(a["results"], first["results"], strict=True)
        )
        delta = a["accuracy"] - first["accuracy"]
        rows.append(
            f"| {a['arm']} | {a['accuracy']:.1%} | {a['correct']}/{a['items']} | "
            f"{delta:+.1%} | {agree}/{a['items']} |"
        )
    return "\n".join(rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("tasks", help="a JSONL task file")
    p.add_argument(
        "--model", help="model directory for the server started here (default: the bundled model)"
    )
    p.add_argument("--base-url", help="an engramrt (or any OpenAI-compatible) server instead")
    p.add_argument("--max-tokens", type=int, default=32, help="for exact-match items")
    p.add_argument("--concurrency", type=int, default=32, help="requests in flight")
    p.add_argument("--limit", type=int, help="the first N items only")
    p.add_argument(
        "--engram",
        choices=["on", "off"],
        default="on",
        help="off: every Engram layer skipped (the server's ablation)",
    )
    p.add_argument("-pp", "--pipeline-parallel-size", type=int, default=1)
    p.add_argument("--pp-layer-partition", help="layers per stage, e.g. 14,26")
    p.add_argument("--serve-args", default="", help="more flags for the server started here")
    p.add_argument(
        "--ab",
        nargs="+",
        metavar="NAME=FLAGS",
        help="several arms, each a server with these flags (replaces --engram, -pp, "
        "--pp-layer-partition), e.g. on= off='--engram off'; NAME=VALUE words set "
        "the server's environment",
    )
    p.add_argument("--json", action="store_true", help="print JSON, item results included")


def _arms(args: argparse.Namespace) -> list[tuple[str, list[str]]]:
    extra = shlex.split(args.serve_args)
    server_side = (
        args.engram != "on" or args.pipeline_parallel_size != 1 or args.pp_layer_partition or extra
    )
    if args.base_url and server_side:
        raise ValueError(
            "--engram, -pp, --pp-layer-partition and --serve-args configure the "
            "server started here; with --base-url the server is already running"
        )
    if args.ab and args.base_url:
        raise ValueError("--ab starts a server per arm; it cannot take --base-url")
    if args.base_url:  # a server someone else runs: what it serves is not known here
        return [(f"remote {args.base_url}", [])]
    if args.ab:
        arms = []
        for spec in args.ab:
            name, _, flags = spec.partition("=")
            arms.append((name, shlex.split(flags) + extra))
        return arms
    flags = ["--engram", args.engram, "-pp", str(args.pipeline_parallel_size), *extra]
    if args.pp_layer_partition:
        flags += ["--pp-layer-partition", args.pp_layer_partition]
    return [("engram " + args.engram, flags)]


def run(args: argparse.Namespace) -> int:
    try:
        items = load_tasks(args.tasks, args.limit)
        arms = [run_arm(args, items, name, flags) for name, flags in _arms(args)]
    except (ValueError, RuntimeError) as exc:
        print(f"engramrt eval: {exc}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(arms))
    else:
        print(table(arms))
    return 0
