"""``engramrt serve``: the OpenAI-compatible server in this process, the engine in a process of
its own (which launches the pipeline and tensor-parallel ranks); under torchrun, rank 0 serves
HTTP with the engine loop on a thread."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from engramrt.bundled import resolve_model_dir
from engramrt.commands.flags import (
    add_device_flags,
    add_dist_flags,
    add_engram_memory_flags,
    add_memory_flags,
    add_scheduling_flags,
    options_from_args,
    resolve_device,
)
from engramrt.engine.build import EngineOptions, build_stage, check, log
from engramrt.engine.client import EngineClient, EngineDead, EngineRefused
from engramrt.engine.core import describe, serve_stage
from engramrt.parallel.launch import launch, under_torchrun
from engramrt.parallel.liveness import StageWatch
from engramrt.prompts import PromptEncoder


@dataclass
class ServeOptions(EngineOptions):
    """The engine's options and the HTTP server's."""

    served_model_name: list[str] = field(default_factory=lambda: ["engramrt-tiny"])
    host: str = "127.0.0.1"
    port: int = 8000
    disable_uvicorn_access_log: bool = False
    enable_log_requests: bool = False
    max_request_bytes: int = 32 * 2**20
    shutdown_timeout: float = 20.0
    stage_timeout: float = 10.0
    step_timeout: float = 60.0
    api_key: str | None = None
    generation_defaults: dict[str, Any] = field(default_factory=dict)  # by request field


def check_serve(opts: ServeOptions) -> None:
    check(opts)
    if not 0 <= opts.port <= 65535:
        raise ValueError(f"--port must lie in [0, 65535], got {opts.port}")
    if opts.max_request_bytes < 1:
        raise ValueError("--max-request-bytes must be >= 1")
    if opts.shutdown_timeout < 0 or opts.stage_timeout <= 0 or opts.step_timeout <= 0:
        raise ValueError("--shutdown-timeout must be >= 0; --stage-timeout and --step-timeout > 0")


def run_serve(opts: ServeOptions) -> None:
    """The engine in a process of its own (which launches the stages), HTTP in this one. Under
    torchrun every rank is started for us: rank 0 serves HTTP with the engine loop on a thread
    of its own (the same loop and messages)."""
    check_serve(opts)
    if under_torchrun():
        launch(opts.dist, _torchrun_worker, opts)
        return
    prompts = PromptEncoder.load(opts.model_dir)
    try:
        client = EngineClient.spawn(opts, prompts.tokenizer)
    except EngineRefused:  # its one line said why, as a command's bad input does: exit 2
        raise SystemExit(2) from None
    except EngineDead as exc:
        log(str(exc))
        raise SystemExit(1) from None
    code = _serve_http(opts, client, prompts)
    if code:
        raise SystemExit(code)


def _torchrun_worker(rank: int, world: int, opts: ServeOptions) -> None:
    pipe, engine = build_stage(opts, rank, world)
    if engine is None:
        serve_stage(pipe, opts)
        return
    on_cpu = pipe.runner.device.type == "cpu"
    client = EngineClient.in_thread(engine, engine.tokenizer, describe(pipe, engine, opts), on_cpu)
    watch = StageWatch(opts.stage_timeout, client.fail) if world > 1 else None
    try:
        code = _serve_http(opts, client, PromptEncoder.load(opts.model_dir, engine.tokenizer))
    finally:
        if watch is not None:
            watch.stop()
    if code == 0:
        pipe.stop()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # a hung stage would hold the stop message and teardown barrier for ever


def _serve_http(opts: ServeOptions, client: EngineClient, prompts: PromptEncoder) -> int:
    """Serve until a signal (exit status 0) or the engine's death (1); the engine is stopped
    on every way out (a failed start too: the port is taken, say). A stopped or hung engine
    fails its requests (``EngineClient.watch``)."""
    import uvicorn

    from engramrt.server.app import Server, ServerConfig, create_app
    from engramrt.server.lifecycle import EngineServer

    client.watch(opts.stage_timeout, opts.step_timeout)
    try:
        server = Server(
            client,
            prompts,
            ServerConfig(
                opts.served_model_name,
                client.limits.max_model_len,
                opts.api_key,
                opts.max_request_bytes,
                opts.enable_log_requests,
                opts.generation_defaults,
            ),
        )
        if opts.generation_defaults:
            log(f"request defaults (--override-generation-config): {opts.generation_defaults}")

        def ready(port: int) -> str:
            return (
                f"serving {opts.served_model_name[0]} ({opts.model_dir}) at "
                f"http://{opts.host}:{port}/v1 | {client.description}"
            )

        config = uvicorn.Config(
            create_app(server),
            host=opts.host,
            port=opts.port,
            log_level="warning" if opts.disable_uvicorn_access_log else "info",
            access_log=not opts.disable_uvicorn_access_log,
            timeout_graceful_shutdown=5,
        )
        http = EngineServer(config, server, ready, opts.shutdown_timeout)
        http.run()
    finally:
        client.shutdown()
    return http.exit_code


# --------------------------------------------------------------------------- the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    """vLLM's flag names, so that ``vllm serve`` command lines carry over."""
    p.add_argument("model_tag", nargs="?", help="model directory (default: the bundled model)")
    p.add_argument("--model", help="same as the positional MODEL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", help="names in /v1/models and responses")
    p.add_argument("--max-model-len", type=int, help="default: the model's maximum")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="also the chunk size")
    p.add_argument("--block-size", type=int, default=16, help="KV block size in tokens")
    p.add_argument("--num-gpu-blocks-override", type=int, help="KV blocks (default: by memory)")
    add_memory_flags(p)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    add_scheduling_flags(p)
    p.add_argument("--api-key", help="require this bearer key on /v1/* ($VLLM_API_KEY works)")
    p.add_argument(
        "--disable-uvicorn-access-log", action="store_true", help="no line per HTTP request"
    )
    p.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="a line per API request: its id, choices, prompt tokens and main parameters",
    )
    p.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="vLLM's older flag, kept so its command lines carry over: requests are not logged "
        "unless --enable-log-requests",
    )
    p.add_argument(
        "--max-request-bytes",
        type=int,
        default=32 * 2**20,
        help="larger request bodies are a 413 (default 32 MiB)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=20.0,
        help="on SIGTERM/SIGINT, seconds the running requests may take to finish before they "
        "are aborted (0: abort at once)",
    )
    p.add_argument(
        "--override-generation-config",
        metavar="JSON",
        help='defaults for what a request leaves out, vLLM\'s keys: {"max_new_tokens": 512} '
        "caps a request without max_tokens (else a chat runs to the end of the context); "
        "temperature, top_p, top_k, min_p, repetition_penalty",
    )
    add_device_flags(p)
    add_engram_memory_flags(p)
    p.add_argument("--seed", type=int, default=0, help="for requests that bring no seed")
    p.add_argument(
        "--engram",
        choices=["on", "off"],
        default="on",
        help="off: skip every Engram layer on purpose (an ablation for evaluations; the "
        "fail-closed check then expects none to run)",
    )
    add_dist_flags(p)
    p.add_argument(
        "--stage-timeout",
        type=float,
        default=10.0,
        help="seconds of silence after which the engine counts as stopped or gone: no heartbeat "
        "from its process (sent by a thread of its own, so a long step does not hold it up), or "
        "with -pp or -tp > 1 from one of its stages; its requests fail with 503 and the server "
        "exits 1",
    )
    p.add_argument(
        "--step-timeout",
        type=float,
        default=60.0,
        help="seconds one engine step may go without progress, while its heartbeat goes on, "
        "before the engine counts as hung (503s, exit 1); the bound grows to 4 times the longest "
        "step so far, and on the CPU a step still computing makes progress, so a slow machine is "
        "not taken for a hung one (default 60, as vLLM's iteration timeout)",
    )


def run(args: argparse.Namespace) -> int:
    device = resolve_device(args.device)
    model_dir = resolve_model_dir(args.model_tag or args.model)
    name = args.served_model_name or [
        "engramrt-tiny" if (args.model_tag or args.model) is None else str(model_dir)
    ]
    opts = options_from_args(
        args,
        model_dir,
        device=device,
        cls=ServeOptions,
        served_model_name=name,
        host=args.host,
        port=args.port,
        disable_uvicorn_access_log=args.disable_uvicorn_access_log,
        enable_log_requests=args.enable_log_requests,
        max_request_bytes=args.max_request_bytes,
        shutdown_timeout=args.shutdown_timeout,
        stage_timeout=args.stage_timeout,
        step_timeout=args.step_timeout,
        api_key=args.api_key
        or os.environ.get("ENGRAMRT_API_KEY")
        or os.environ.get("VLLM_API_KEY"),
        engram=args.engram == "on",
        generation_defaults=generation_defaults(args.override_generation_config),
    )
    run_serve(opts)
    return 0


def generation_defaults(text: str | None) -> dict[str, Any]:
    """``--override-generation-config``: request defaults by field (vLLM's keys); malformed
    JSON, an unknown key or a value a request could not hold is an error."""
    from engramrt.server.protocol import generation_defaults as by_field

    if text is None:
        return {}
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--override-generation-config is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--override-generation-config takes a JSON object, got {text}")
    try:
        return by_field(config)
    except ValueError as exc:
        raise ValueError(f"--override-generation-config: {exc}") from None
