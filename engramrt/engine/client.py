"""The server's side of the engine: an asyncio interface over the connection to the engine loop
(``engramrt.engine.core``), which runs in a process of its own (``spawn``) or on a thread
(``in_thread``).

Requests are validated here, at the boundary (``new_request``: the engine's ``RequestLimits``,
sent once when it is ready), and sent as they come by a sender thread; outputs come back on a
reader thread and go to one asyncio queue per request. If the engine dies (a step raised, a
stage stopped answering, its process went away) or someone outside declares it dead (``fail``),
every waiting request gets the error and ``error`` is set (``/health`` then reports 503 and the
server exits 1).
``close`` and ``drain`` are the graceful stop: no new requests, the running ones finish or, at
the deadline, end with finish reason ``abort``; ``shutdown`` then stops the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import multiprocessing as mp
import os
import queue
import secrets
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from multiprocessing.connection import Connection, Listener, Pipe

from engramrt.engine.core import (
    ENCODER,
    FROM_ENGINE,
    Abort,
    Add,
    Beat,
    Died,
    Outputs,
    Ready,
    Rejected,
    Stats,
    Steps,
    Stop,
    ToEngine,
    engine_main,
    run_core,
)
from engramrt.engine.detokenize import RequestText
from engramrt.engine.engine import RequestOutput
from engramrt.engine.grammar import Grammars
from engramrt.engine.request import Request, RequestLimits, SamplingParams

# The reader thread shares the GIL with the event loop, which streams each token of every
# request. A thread that wants the GIL back (the reader, a step's outputs ready) waits up to
# Python's switch interval (5 ms by default) while the loop runs Python: longer than a decode
# step. ENGRAMRT_SWITCH_INTERVAL (seconds) overrides it, for comparisons.
SWITCH_INTERVAL = 0.0005

# A step may run this many times the engine's longest step so far before the engine counts as
# hung (when that is longer than --step-timeout). Every step's work is bounded (the token budget
# and --max-num-seqs), so on one machine a legitimate step outlasts the longest seen mostly by
# the load that has come beside it since.
SLOW_STEP_FACTOR = 4.0


class EngineDead(RuntimeError):
    pass


class EngineRefused(EngineDead):
    """The engine's process exited while starting because its input is unusable (a config or a
    checkpoint): it printed the one-line reason and exited 2 (``engine_main``)."""


class EngineClosed(RuntimeError):
    """The server is shutting down and takes no new requests."""


class RequestFailed(ValueError):
    """The engine ended a request with an error of the request's own (a grammar it could not
    follow): the client's 400, or an error event in a stream."""


class ModelFailed(RuntimeError):
    """The engine ended a request because the model failed on it (logits holding NaN or
    infinity): the server's 500, or an error event in a stream. The engine serves on."""


class EngineClient:
    def __init__(self, conn: Connection, worker: threading.Thread | mp.Process, tokenizer=None):
        """``conn``: connected to a loop that has said ``Ready``. ``tokenizer``: for the text
        of the outputs (decoded here, with stop strings) and for compiling grammars at the
        boundary (their errors are 400s here, not failures in the engine); None: ids only."""
        interval = os.environ.get("ENGRAMRT_SWITCH_INTERVAL", str(SWITCH_INTERVAL))
        try:
            interval = float(interval)
        except ValueError:
            msg = f"ENGRAMRT_SWITCH_INTERVAL must be seconds, got {interval!r}"
            raise ValueError(msg) from None
        self.conn, self.worker = conn, worker
        try:
            ready = FROM_ENGINE.decode(conn.recv_bytes())
        except (EOFError, OSError):
            ready = Died("it went away before it was ready")
        if not isinstance(ready, Ready):
            conn.close()
            raise EngineDead(f"the engine failed to start: {getattr(ready, 'error', ready)}")
        self.limits: RequestLimits = ready.limits
        self.description = ready.description
        self._stats: Stats = ready.stats
        self.grammars, self.tokenizer = None, tokenizer
        if tokenizer is not None:
            self.grammars = Grammars(
                tokenizer, self.limits.tokenizer_size, self.limits.eos_token_id
            )
        self._old_interval = sys.getswitchinterval()  # given back by ``shutdown``
        sys.setswitchinterval(interval)
        self.error: BaseException | None = None
        self.closed = self._stopping = False
        # what ``_send`` hands the sender thread, in order; None: no more
        self._outbox: queue.SimpleQueue[ToEngine | None] = queue.SimpleQueue()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # the engine's last beat and when it came (``watch``)
        self._beat, self._beat_at = Beat(0.0, 0.0, 0.0), time.monotonic()
        self._reader = threading.Thread(target=self._read, name="engramrt-outputs", daemon=True)
        self._reader.start()
        self._sender = threading.Thread(target=self._write, name="engramrt-sends", daemon=True)
        self._sender.start()

    # --- starting the loop -----------------------------------------------------------------

    @classmethod
    def in_thread(
        cls, engine: Steps, tokenizer=None, description: str = "", on_cpu: bool = True
    ) -> EngineClient:
        """The loop on a thread of this process, over a pipe (``run_core``'s ``on_cpu``)."""
        mine, theirs = Pipe()
        worker = threading.Thread(
            target=_serve_then_close,
            args=(engine, theirs, description, on_cpu),
            name="engramrt-engine",
            daemon=True,
        )
        worker.start()
        return cls(mine, worker, tokenizer)

    @classmethod
    def spawn(cls, opts, tokenizer=None) -> EngineClient:
        """The engine in a process of its own (``engine_main``), which connects back here."""
        authkey = secrets.token_bytes(32)
        # a Unix socket: local only, and no Nagle delay (over TCP a small message sent right
        # after another waited for the delayed ACK, 40 ms, which showed as first-token latency)
        with Listener(family="AF_UNIX", authkey=authkey) as listener:
            proc = mp.get_context("spawn").Process(
                target=engine_main, args=(opts, listener.address, authkey), name="engramrt-engine"
            )
            proc.start()
            try:
                conn = _accept(listener, proc)
                return cls(conn, proc, tokenizer)
            except BaseException:  # nothing of a failed start is left running
                proc.kill()
                proc.join(timeout=10)
                raise

    # --- requests ------------------------------------------------------------------------

    def new_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams):
        """The one validation of a request, here at the boundary (a ValueError is a 400): the
        engine's limits, and a grammar compiled once to see that it can be."""
        self.limits.check(prompt_ids, params)
        if params.grammar is not None and self.grammars is not None:
            self.grammars.matcher(params.grammar)
        return Request(request_id, prompt_ids, params)

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Outputs until the request finishes; leaving early (a disconnect) aborts it."""
        if self.error is not None:
            raise EngineDead(f"the engine has stopped: {self.error}")
        if self.closed:
            raise EngineClosed("the server is shutting down")
        rid = request.id
        q: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = (asyncio.get_running_loop(), q)
        if self.error is not None:  # died between the check above and registering the queue
            self._queues.pop(rid, None)
            raise EngineDead(f"the engine has stopped: {self.error}")
        self._send(Add(rid, request.prompt_ids, request.params))
        text = None
        if self.tokenizer is not None:
            text = RequestText(self.tokenizer, request.prompt_ids, request.params.stop)
        finished, after, engine_done = False, None, False
        try:
            while True:
                item = after if after is not None else await q.get()
                after = None
                if isinstance(item, ValueError):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDead(f"the engine failed: {item}") from item
                engine_done = item.finished
                if item.error is not None:
                    raise (ModelFailed if item.model_failed else RequestFailed)(item.error)
                item = item if text is None else text.apply(item)
                # a caller behind the engine (a busy event loop) takes every output waiting as
                # one: its per-output cost (a stream chunk) then shrinks as the load grows
                while not item.finished and not q.empty():
                    after = q.get_nowait()
                    if not isinstance(after, RequestOutput):
                        break
                    engine_done = after.finished
                    if after.error is not None:
                        break  # delivered alone: its error follows what came before
                    nxt = after if text is None else text.apply(after)
                    item, after = item.then(nxt), None
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not engine_done:  # a disconnect, or a stop string the engine ran past
                self._send(Abort(rid))

    @property
    def num_running(self) -> int:
        """Requests whose caller is still waiting for outputs."""
        return len(self._queues)

    def stats(self) -> Stats:
        """The engine's gauges and counters as of its last message."""
        return self._stats

    # --- stopping ------------------------------------------------------------------------

    def close(self) -> None:
        self.closed = True

    async def drain(self, timeout: float, force: threading.Event | None = None) -> int:
        """After ``close``: wait up to ``timeout`` seconds (or until ``force`` is set) for the
        running requests to finish, then end the rest with finish reason ``abort``; how many
        were aborted."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._queues and self.error is None and loop.time() < deadline:
            if force is not None and force.is_set():
                break
            await asyncio.sleep(0.05)
        left = list(self._queues)
        for rid in left:
            self._send(Abort(rid, notify=True))
        grace = loop.time() + 5.0  # their last outputs are on the way
        while self._queues and self.error is None and loop.time() < grace:
            await asyncio.sleep(0.01)
        return len(left)

    def fail(self, reason: str) -> None:
        """Declare the engine dead from outside."""
        self._die(EngineDead(reason))

    def watch(self, timeout: float, step_timeout: float) -> None:
        """Declare the engine dead (``fail``) once it has sent no beat for ``timeout`` seconds
        (its process stopped, wedged or gone without a word: the beat comes from a thread of its
        own, which a long step does not hold up), or once one step has gone without progress
        (``Beat``) for longer than both ``step_timeout`` and ``SLOW_STEP_FACTOR`` times its
        longest step so far (its loop deadlocked: a slow step is no hang, and on the CPU a step
        still computing is none however long it takes). Running requests then fail with a 503
        instead of hanging, and ``/health`` says so."""

        def run() -> None:
            while self.error is None and not self._stopping:
                time.sleep(min(0.25, timeout / 4, step_timeout / 4))
                beat, silent = self._beat, time.monotonic() - self._beat_at
                bound = max(step_timeout, SLOW_STEP_FACTOR * beat.longest)
                if silent > timeout:
                    self.fail(
                        f"the engine stopped answering: no heartbeat for {timeout:g} s "
                        "(--stage-timeout); its process is stopped or wedged"
                    )
                elif beat.stalled > bound:
                    self.fail(
                        f"the engine is hung: one step has gone {beat.stalled:.0f} s without "
                        f"progress ({beat.working:.0f} s on it), past --step-timeout "
                        f"{step_timeout:g} s and {SLOW_STEP_FACTOR:g} times its longest step so "
                        f"far ({beat.longest:.1f} s)"
                    )

        threading.Thread(target=run, name="engramrt-engine-watch", daemon=True).start()

    def shutdown(self, timeout: float = 15.0) -> None:
        """Stop the loop and wait for it; the engine's process is killed if it does not end in
        time. A dead engine's process is given the same time: its launcher takes the stages
        down first (a stopped stage takes a kill after a grace period), so none is orphaned.
        A loop on a thread that is stuck waiting for a stage is left behind (a daemon), and so
        are the sender thread if it is stuck sending to that loop and the reader with the
        connection open."""
        self._stopping = True  # the end of the connection that follows is no death
        self._send(Stop())
        self._outbox.put(None)
        dead = self.error is not None
        threaded = isinstance(self.worker, threading.Thread)
        self.worker.join(timeout=2.0 if threaded and dead else min(timeout, 5) if dead else timeout)
        if isinstance(self.worker, mp.process.BaseProcess):
            # the engine's process leads a process group with its ranks (``engine_main``):
            # whatever of it is left, stopped processes too, goes at once
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.worker.pid, signal.SIGKILL)
            self.worker.join(timeout=5)
        # the far end is closed by now (a loop stuck on a thread aside): no send still waits
        self._sender.join(timeout=2.0)
        # and the reader has seen it end. One still in a read (a stuck loop's) keeps the
        # connection open: closed under it, its descriptor's number would go to the next
        # connection made, whose bytes that read would then take (a test saw a client's first
        # message cut short so)
        self._reader.join(timeout=2.0)
        if not self._reader.is_alive():
            self.conn.close()
        sys.setswitchinterval(self._old_interval)

    # --- the connection ------------------------------------------------------------------

    def _send(self, message: ToEngine) -> None:
        """Never blocks: the event loop calls it, and a send blocks while the engine is on a
        long step and a burst of requests has filled the connection (``/health`` would stall
        with it). The sender thread (``_write``) waits instead."""
        self._outbox.put(message)

    def _write(self) -> None:
        """Send what ``_send`` queued, in order. Once the engine is dead only ``Stop`` still
        goes (a loop that outlived its death, a hang released, ends on it): the callers of the
        rest have the error already."""
        while (message := self._outbox.get()) is not None:
            if self.error is not None and not isinstance(message, Stop):
                continue
            try:
                self.conn.send_bytes(ENCODER.encode(message))
            except OSError:  # the engine is gone; the reader reports it
                pass

    def _read(self) -> None:
        while True:
            try:
                message = FROM_ENGINE.decode(self.conn.recv_bytes())
            except (EOFError, OSError):
                if not self._stopping:
                    self._die(EngineDead("the engine's process exited"))
                return
            if isinstance(message, Outputs):
                self._stats = message.stats
                self._deliver_all([(out.request_id, out) for out in message.outputs])
            elif isinstance(message, Rejected):
                self._deliver_all([(message.request_id, ValueError(message.error))])
            elif isinstance(message, Died):
                self._die(EngineDead(message.error))
                return
            elif isinstance(message, Beat):
                self._beat, self._beat_at = message, time.monotonic()

    def _deliver_all(self, items: list[tuple[str, object]]) -> None:
        """One wake-up of each event loop for a whole step's outputs (a wake-up per output
        costs a syscall and a loop iteration each, per token of every running request)."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for rid, item in items:
            target = self._queues.get(rid)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, puts in by_loop.items():
            loop.call_soon_threadsafe(_put_all, puts)

    def _die(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            self._deliver_all([(rid, exc) for rid in list(self._queues)])


def _serve_then_close(engine: Steps, conn: Connection, description: str, on_cpu: bool) -> None:
    try:
        run_core(engine, conn, description, on_cpu)
    finally:
        conn.close()  # the client's reader sees the end


def _accept(listener: Listener, proc: mp.Process) -> Connection:
    """The engine's connection once it has loaded; an error if its process ends first."""
    got: list = []
    waiter = threading.Thread(target=lambda: got.append(listener.accept()), daemon=True)
    waiter.start()
    while waiter.is_alive():
        waiter.join(0.5)
        if waiter.is_alive() and not proc.is_alive():
            if proc.exitcode == 2:
                raise EngineRefused("the engine refused its input (its log above says why)")
            raise EngineDead(
                f"the engine's process exited with status {proc.exitcode} while "
                "starting (its log above says why)"
            )
    if not got:
        raise EngineDead("the engine's process could not connect")
    return got[0]


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in puts:
        q.put_nowait(item)
