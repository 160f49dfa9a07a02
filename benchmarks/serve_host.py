"""The HTTP server's own cost per streamed token, without a GPU: the real server (uvicorn,
FastAPI, the engine loop on a thread of the server's process, as under torchrun; ``engramrt
serve`` otherwise gives the loop a process of its own) around an engine whose model is a stub
that sleeps for a fixed "GPU step" (releasing the GIL, as waiting on a GPU does) and samples a
fixed token. ``engramrt bench serve`` streams at a given concurrency from another process.
Reported: the client's median TPOT against the engine's median decode step measured inside the
server (stub sleep + the engine's host work + whatever the event loop took from it through the
GIL) and against the same engine stepping alone (no server).

    python benchmarks/serve_host.py [--concurrency 64] [--gpu-ms 3] [--prompts 256]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import tempfile
import threading
import time

import uvicorn

from benchmarks.host_step import TOKEN
from engramrt.bundled import DEFAULT_MODEL_DIR
from engramrt.commands.child import engramrt_command
from engramrt.engine.client import EngineClient
from engramrt.engine.engine import Engine, EngineConfig
from engramrt.engine.request import SamplingParams
from engramrt.engram import load_tokenizer
from engramrt.prompts import PromptEncoder
from engramrt.runner.batch import StepBatch, StepResult
from engramrt.server.app import Server, ServerConfig, create_app


class SleepingModel:
    """Sleeps ``gpu_ms`` per step; records when decode steps (every run one token) end."""

    def __init__(self, gpu_ms: float):
        self.gpu_s, self.decode_ends = gpu_ms / 1e3, []

    def step(self, batch: StepBatch) -> StepResult:
        time.sleep(self.gpu_s)
        if all(n == 1 for n in batch.run_lens):
            self.decode_ends.append((time.perf_counter(), len(batch.run_lens)))
        return StepResult([TOKEN] * len(batch.slots))

    def step_ms(self, rows: int) -> float:
        """Median interval between consecutive decode steps of ``rows`` rows."""
        ends = self.decode_ends
        gaps = [b[0] - a[0] for a, b in zip(ends, ends[1:], strict=False) if a[1] == b[1] == rows]
        return 1e3 * statistics.median(gaps) if gaps else float("nan")


def engine(gpu_ms: float, seqs: int, in_len: int, out_len: int) -> tuple[Engine, SleepingModel]:
    tok = load_tokenizer(DEFAULT_MODEL_DIR)
    max_len = in_len + out_len + 8
    cfg = EngineConfig(
        max_model_len=max_len,
        max_num_seqs=seqs,
        max_num_batched_tokens=2048,
        block_size=16,
        num_blocks=seqs * -(-max_len // 16) + 64,
        enable_prefix_caching=False,
        eos_token_id=1,
    )
    model = SleepingModel(gpu_ms)
    return Engine(model, tok, cfg), model


def alone(gpu_ms: float, rows: int, in_len: int, out_len: int) -> float:
    eng, model = engine(gpu_ms, rows, in_len, out_len)
    rng = random.Random(0)
    for i in range(rows):
        prompt = [rng.randrange(6, 500) for _ in range(in_len)]
        eng.add_request(str(i), prompt, SamplingParams(max_tokens=out_len, ignore_eos=True))
    while eng.has_work():
        eng.step()
    return model.step_ms(rows)


def served(args: argparse.Namespace) -> dict:
    eng, model = engine(args.gpu_ms, args.concurrency, args.input_len, args.output_len)
    prompts = PromptEncoder.load(DEFAULT_MODEL_DIR, eng.tokenizer)
    client = EngineClient.in_thread(eng, eng.tokenizer)
    server = Server(client, prompts, ServerConfig(["stub"], eng.cfg.max_model_len))
    config = uvicorn.Config(create_app(server), port=args.port, log_level="warning")
    http = uvicorn.Server(config)
    thread = threading.Thread(target=http.run, daemon=True)
    thread.start()
    while not http.started:
        time.sleep(0.05)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            *engramrt_command("bench", "serve"),
            "--port",
            str(args.port),
            "--num-prompts",
            str(args.prompts),
            "--random-input-len",
            str(args.input_len),
            "--random-output-len",
            str(args.output_len),
            "--ignore-eos",
            "--max-concurrency",
            str(args.concurrency),
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            tmp,
            "--result-filename",
            "r.json",
        ]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=os.environ)
        with open(os.path.join(tmp, "r.json")) as f:
            res = json.load(f)
    http.should_exit = True
    thread.join(timeout=10)
    server.engine.shutdown()
    return {
        "client_median_tpot_ms": res["median_tpot_ms"],
        "server_step_ms": model.step_ms(args.concurrency),
        "output_tok_s": res["output_throughput"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--gpu-ms", type=float, default=3.0)
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--port", type=int, default=8471)
    args = ap.parse_args()
    res = served(args)
    res["engine_alone_step_ms"] = alone(
        args.gpu_ms, args.concurrency, args.input_len, args.output_len
    )
    res["stub_gpu_ms"] = args.gpu_ms
    print(json.dumps({k: round(v, 3) for k, v in res.items()}))


if __name__ == "__main__":
    main()
