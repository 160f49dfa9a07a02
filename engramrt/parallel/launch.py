"""Start the ranks: ``pp_size`` pipeline stages of ``tp_size`` tensor-parallel ranks each
(rank = stage * tp_size + tp_rank). Under torchrun this process is one rank (torch's
environment variables say which); otherwise it spawns one process per rank on this machine. A
rank that fails takes the others down with it instead of leaving them waiting. The worker is
called with its stage and the number of stages; ``tensor_parallel.current()`` says its TP place."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engramrt import tensor_parallel

Worker = Callable[..., None]  # worker(rank, world, *args)


@dataclass
class DistConfig:
    pp_size: int = 1
    tp_size: int = 1
    device: str = "cpu"
    backend: str | None = None  # default: nccl on cuda, gloo on cpu
    master_addr: str | None = None  # default: $MASTER_ADDR or 127.0.0.1
    master_port: int | None = None  # default: $MASTER_PORT or a free port
    timeout_s: float = 600.0

    @property
    def world(self) -> int:
        return self.pp_size * self.tp_size

    @property
    def resolved_backend(self) -> str:
        return self.backend or ("nccl" if self.device == "cuda" else "gloo")


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def stage_device(cfg: DistConfig) -> torch.device:
    if cfg.device == "cuda":
        local = int(os.environ.get("LOCAL_RANK", "0"))
        return torch.device("cuda", local % torch.cuda.device_count())
    return torch.device("cpu")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(cfg: DistConfig, worker: Worker, *args, forward_signals: bool = True) -> None:
    """Run ``worker(stage, stages, *args)`` on every rank. ``forward_signals``: a launcher of
    several ranks passes SIGTERM/SIGINT on to rank 0 (the driver decides how to stop); False
    where another process owns the stop (the server's, for the engine's process)."""
    if cfg.pp_size < 1 or cfg.tp_size < 1:
        raise ValueError("--pipeline-parallel-size and --tensor-parallel-size must be >= 1")
    if cfg.device == "cuda":
        gpus = torch.cuda.device_count()
        if gpus == 0:
            raise ValueError("--device cuda, but no CUDA device is available")
        if cfg.resolved_backend == "nccl" and not under_torchrun() and cfg.world > gpus:
            raise ValueError(
                f"{cfg.world} NCCL ranks (PP {cfg.pp_size} x TP {cfg.tp_size}) need {cfg.world} "
                f"GPUs, this machine has {gpus} (--distributed-backend gloo runs several ranks "
                "on one GPU)"
            )
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != cfg.world:
            raise ValueError(
                f"torchrun started {world} processes but --pipeline-parallel-size x "
                f"--tensor-parallel-size is {cfg.pp_size} x {cfg.tp_size} = {cfg.world}"
            )
        _run(int(os.environ["RANK"]), cfg, worker, args)
    elif cfg.world == 1:
        worker(0, 1, *args)
    else:
        addr = cfg.master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = cfg.master_port or int(os.environ.get("MASTER_PORT", 0)) or free_port()
        ctx = mp.start_processes(
            _spawned,
            args=(cfg, addr, port, worker, args),
            nprocs=cfg.world,
            start_method="spawn",
            join=False,
        )
        stop = _ForwardStop(ctx.processes[0].pid)
        previous = {
            sig: signal.signal(sig, stop)
            for sig in (signal.SIGTERM, signal.SIGINT)
            if forward_signals
        }
        try:
            while not ctx.join(timeout=1, grace_period=2):
                pass
        finally:  # stopped or failed: no stage outlives this process
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
            for p in ctx.processes:
                p.join(timeout=5)
                if p.is_alive():  # ignores SIGTERM (a serving stage) or is stopped
                    p.kill()
                    p.join(timeout=5)


class _ForwardStop:
    """SIGTERM or SIGINT to the launcher: rank 0 (the driver) decides how to stop, e.g. a
    server drains its requests and then releases the other stages; a second signal, a second
    or more later, stops every stage at once."""

    def __init__(self, driver_pid: int):
        self.driver_pid, self.first = driver_pid, None

    def __call__(self, signum, frame) -> None:
        now = time.monotonic()
        if self.first is None:
            self.first = now
            try:
                os.kill(self.driver_pid, signal.SIGTERM)
            except ProcessLookupError:  # the driver is gone already; its stages follow
                pass
        elif now - self.first > 1.0:
            raise SystemExit(128 + signum)


def _spawned(rank: int, cfg: DistConfig, addr: str, port: int, worker: Worker, args) -> None:
    os.environ.update(
        MASTER_ADDR=addr,
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(cfg.world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(cfg.world),
    )
    try:
        _run(rank, cfg, worker, args)
    except ValueError as exc:  # bad input: one line, not a traceback from every rank
        print(f"engramrt: error on rank {rank}: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)


def _run(rank: int, cfg: DistConfig, worker: Worker, args) -> None:
    if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets it; spawned ranks share the cores
        local = int(os.environ.get("LOCAL_WORLD_SIZE", cfg.world))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    if cfg.device == "cuda":
        torch.cuda.set_device(stage_device(cfg))
    dist.init_process_group(
        cfg.resolved_backend,
        rank=rank,
        world_size=cfg.world,
        timeout=timedelta(seconds=cfg.timeout_s),
    )
    try:
        tensor_parallel.join(rank, cfg.world, cfg.tp_size)
        worker(rank // cfg.tp_size, cfg.pp_size, *args)
        dist.barrier()  # no rank tears its connections down while another still uses them
    finally:
        tensor_parallel.reset()
        dist.destroy_process_group()
