"""The engine loop on the far side of one connection (vLLM v1's engine core, at engramrt's size).

The server's process does HTTP, tokenisation and the OpenAI wire format; the engine's process
schedules, drives the pipeline's stages and applies their tokens, with an interpreter of its
own (no GIL shared with the event loop). They talk over one ``multiprocessing`` connection in
messages of msgspec's msgpack, by field name: the standard library's connection frames bytes
over a socket and has ``poll``, which is all one client and one engine need (vLLM's ZeroMQ
sockets buy many peers and I/O threads, which one engine does not use), and msgspec is the
codec the stages already speak (``runner/batch.py``).

``run_core`` is the loop. The server's process starts it in a process of its own
(``engine_main``: the stages are launched from there), or on a thread of its own for a caller
in one process (``EngineClient.in_thread``: tests, a benchmark, ranks started by torchrun):
the same loop and messages either way.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Client, Connection
from typing import Protocol

import msgspec

from engramrt.engine.engine import RequestOutput, Stats
from engramrt.engine.request import Request, RequestLimits, SamplingParams
from engramrt.kernels.compiles import compilations

# --- the messages --------------------------------------------------------------------------


class Add(msgspec.Struct, tag=True):
    """A request the server validated (``RequestLimits.check``); the engine builds it again
    (its grammar's matcher lives with the engine)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


class Abort(msgspec.Struct, tag=True):
    request_id: str
    notify: bool = False  # a shutdown's abort: the caller still gets a last output


class Stop(msgspec.Struct, tag=True):
    pass


class Ready(msgspec.Struct, tag=True):
    limits: RequestLimits
    description: str  # the engine's side of the server's start line
    stats: Stats


class Outputs(msgspec.Struct, tag=True):
    outputs: list[RequestOutput]
    stats: Stats


class Rejected(msgspec.Struct, tag=True):
    request_id: str
    error: str


class Died(msgspec.Struct, tag=True):
    error: str


class Beat(msgspec.Struct, tag=True):
    """Sent every ``BEAT_S`` from a thread of the loop's process, whatever the loop is doing: a
    process that is stopped (SIGSTOP), wedged or gone sends none. ``working`` (seconds the loop
    has spent on its current step; 0 while it waits for requests), ``stalled`` (how much of that
    it made no progress) and ``longest`` (its longest step so far) tell the server a loop that no
    longer finishes steps (a deadlock) from one that is merely slow (``EngineClient.watch``).

    Progress is the loop thread's CPU time where the step's work is the CPU's: a step computing
    on a loaded machine gets some, a loop blocked on a lock or a receive none. On a GPU the host
    thread spins in a synchronisation whether or not the device moves, so there ``stalled`` is
    ``working``."""

    working: float
    stalled: float
    longest: float


ToEngine = Add | Abort | Stop
FromEngine = Ready | Outputs | Rejected | Died | Beat
BEAT_S = 0.5
CPU_MOVED_S = 1e-3  # a thread that got less CPU than this between two beats did not run
ENCODER = msgspec.msgpack.Encoder()
TO_ENGINE = msgspec.msgpack.Decoder(ToEngine)
FROM_ENGINE = msgspec.msgpack.Decoder(FromEngine)


class Steps(Protocol):
    """What the loop drives: an ``Engine`` (or a stub in tests)."""

    limits: RequestLimits

    def new_request(self, request_id: str, prompt_ids: list[int], params) -> Request: ...
    def add(self, req: Request) -> None: ...
    def abort(self, request_id: str) -> None: ...
    def has_work(self) -> bool: ...
    def step(self) -> list[RequestOutput]: ...
    def stats(self) -> Stats: ...


# --- the loop ------------------------------------------------------------------------------


def run_core(engine: Steps, conn: Connection, description: str = "", on_cpu: bool = True) -> None:
    """Serve ``conn`` until the client says stop or goes away. A step of the loop applies every
    message waiting (all of them: validating and queueing a request costs microseconds, and a
    server whose sends filled the connection then waits for one step at most), runs one engine
    step when there is work and sends the outputs; with nothing to run the loop sleeps in
    ``poll``. An exception is sent to the client (``Died``) before it propagates. A thread beats
    (``Beat``) with the loop's progress until the loop ends; ``on_cpu``: the engine computes on
    the CPU, so the loop thread's CPU time is its progress."""
    send = _sender(conn)
    progress = Progress(_thread_clock() if on_cpu else None)
    done = threading.Event()
    threading.Thread(
        target=_beat, args=(send, progress, done), name="engramrt-engine-beat", daemon=True
    ).start()
    try:
        send(Ready(engine.limits, description, _stats(engine)))
        while True:
            if not engine.has_work():
                conn.poll(None)  # nothing to run: sleep until a message comes
            progress.since = time.monotonic()
            outputs: list[RequestOutput] = []
            while conn.poll(0):
                message = TO_ENGINE.decode(conn.recv_bytes())
                if isinstance(message, Stop):
                    return
                outputs += _apply(engine, message, send)
            if engine.has_work():
                outputs += engine.step()
            send(Outputs(outputs, _stats(engine)))
            progress.finished()
    except (EOFError, BrokenPipeError, ConnectionResetError):
        return  # the client is gone: nobody to serve
    except BaseException as exc:
        try:
            send(Died(f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
        raise
    finally:
        done.set()


@dataclass
class Progress:
    """The loop's progress, written by the loop and read by its beat (a float each: no lock)."""

    clock: int | None = None  # the loop thread's CPU clock (``Beat``), where it counts
    since: float | None = None  # when the current step began; None: waiting for requests
    longest: float = 0.0  # seconds
    cpu: float = 0.0  # the clock's reading when it last moved, and when that was seen
    ran_at: float = 0.0

    def finished(self) -> None:
        since, self.since = self.since, None
        if since is not None:
            self.longest = max(self.longest, time.monotonic() - since)

    def beat(self) -> Beat:
        since, now = self.since, time.monotonic()
        if since is None:
            return Beat(0.0, 0.0, self.longest)
        if self.clock is not None:
            cpu = time.clock_gettime(self.clock)
            if cpu - self.cpu > CPU_MOVED_S:
                self.cpu, self.ran_at = cpu, now
        return Beat(now - since, now - max(since, self.ran_at), self.longest)


def _thread_clock() -> int | None:
    """The calling thread's CPU clock, where the platform has one (Linux; not macOS)."""
    try:
        return time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        return None


def _beat(send, progress: Progress, done: threading.Event) -> None:
    while not done.wait(BEAT_S):
        try:
            send(progress.beat())
        except OSError:  # the client is gone
            return


def _apply(engine: Steps, message: Add | Abort, send) -> list[RequestOutput]:
    if isinstance(message, Abort):
        engine.abort(message.request_id)
        if message.notify:
            return [RequestOutput(message.request_id, [], "", finished=True, finish_reason="abort")]
        return []
    try:
        engine.add(engine.new_request(message.request_id, message.prompt_ids, message.params))
    except ValueError as exc:  # an id in use, or a request the server should have refused
        send(Rejected(message.request_id, str(exc)))
    return []


def _stats(engine: Steps) -> Stats:
    return {**engine.stats(), "triton_compilations": compilations()}


def _sender(conn: Connection) -> Callable[[msgspec.Struct], None]:
    """One message at a time from the loop and its beat."""
    lock = threading.Lock()

    def send(message: msgspec.Struct) -> None:
        data = ENCODER.encode(message)
        with lock:
            conn.send_bytes(data)

    return send


# --- the engine's process ------------------------------------------------------------------


def engine_main(opts, address, authkey: bytes) -> None:
    """The engine's process: it launches the stages (one rank, or a process per rank) and on
    the driving rank builds the engine, connects to the server and runs the loop. Signals are
    the server's to act on: it drains, then says stop."""
    from torch.multiprocessing.spawn import ProcessExitedException

    from engramrt.parallel.launch import launch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    os.setpgid(0, 0)  # a group of its own with its ranks: the server can end them all at once
    try:
        launch(opts.dist, _rank_main, opts, address, authkey, forward_signals=False)
    except ValueError as exc:  # bad input found while loading: one line, not a traceback
        print(f"engramrt: {exc}", file=sys.stderr, flush=True)
        sys.exit(2)
    except ProcessExitedException as exc:  # a rank killed, or one that printed its own error
        print(f"engramrt: the engine's {exc}", file=sys.stderr, flush=True)
        sys.exit(2 if exc.exit_code == 2 else 1)


def _rank_main(rank: int, world: int, opts, address, authkey: bytes) -> None:
    from engramrt.engine.build import build_stage
    from engramrt.parallel.liveness import StageWatch

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    pipe, engine = build_stage(opts, rank, world)
    if engine is None:
        serve_stage(pipe, opts)
        return
    conn = Client(address, authkey=authkey)
    send = _sender(conn)

    def hung(reason: str) -> None:
        # a stage that stopped answering holds this loop in a receive for ever: tell the
        # server and leave (the launcher then takes the other stages down)
        try:
            send(Died(reason))
        finally:
            os._exit(1)

    watch = StageWatch(opts.stage_timeout, hung) if opts.dist.world > 1 else None
    try:
        run_core(engine, conn, describe(pipe, engine, opts), pipe.runner.device.type == "cpu")
    finally:
        if watch is not None:
            watch.stop()
        pipe.stop()
        conn.close()


def serve_stage(pipe, opts) -> None:
    """A stage that does not drive: the driver owns the server's life (it drains, then stops
    the stages), so signals that reach the whole process group do not take this stage away
    mid-drain; it beats for the driver's watch."""
    from engramrt.parallel.liveness import Heartbeat

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    first = sum(opts.partition[: pipe.rank])
    last = first + opts.partition[pipe.rank] - 1
    tp = f", TP rank {pipe.tp.rank} of {pipe.tp.size}" if pipe.tp.size > 1 else ""
    print(
        f"engramrt: stage {pipe.rank} of {pipe.world}{tp} (layers {first}-{last}) ready, "
        f"pid {os.getpid()}",
        flush=True,
    )
    beat = Heartbeat()
    try:
        pipe.serve()
    finally:
        beat.stop()


def describe(pipe, engine, opts) -> str:
    """The engine's side of the server's start line."""
    runner = pipe.runner
    return (
        f"{runner.device}, {runner.model.dtype}, {len(opts.partition)} stage(s) "
        f"{opts.partition} x TP {opts.dist.tp_size}, {engine.cfg.num_blocks} KV blocks of "
        f"{opts.block_size} tokens, max_model_len {engine.cfg.max_model_len}; engine pid "
        f"{os.getpid()}"
    )
