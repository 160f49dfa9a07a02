"""The engine loop on a background thread, and an asyncio interface for the server.

Requests and aborts are queued and applied by the loop between steps, so the event loop never
waits for a step; outputs come back through one asyncio queue per request. If the loop dies, or
someone outside declares it dead (``fail``: a pipeline stage stopped answering), every waiting
request gets the error and ``error`` is set (``/health`` then reports 503 and the server exits).
``close`` and ``drain`` are the graceful stop: no new requests, the running ones finish or, at
the deadline, end with finish reason ``abort``.
"""

from __future__ import annotations

import asyncio
import os
import queue
import sys
import threading
from collections.abc import AsyncIterator

from engramrt.engine.engine import Engine, RequestOutput
from engramrt.engine.request import Request

# The engine thread shares the GIL with the event loop, which streams each token of every
# request. A thread that wants the GIL back (the engine, its step's tokens ready) waits up to
# Python's switch interval (5 ms by default) while the loop runs Python: longer than a decode
# step. (On an H200 at concurrency 64 the two settings differed by less than run-to-run noise;
# BENCHMARKS.md.) ENGRAMRT_SWITCH_INTERVAL (seconds) overrides it, for comparisons.
SWITCH_INTERVAL = 0.0005


class EngineDead(RuntimeError):
    pass


class EngineClosed(RuntimeError):
    """The server is shutting down and takes no new requests."""


class AsyncEngine:
    def __init__(self, engine: Engine):
        interval = os.environ.get("ENGRAMRT_SWITCH_INTERVAL", str(SWITCH_INTERVAL))
        try:
            interval = float(interval)
        except ValueError:
            msg = f"ENGRAMRT_SWITCH_INTERVAL must be seconds, got {interval!r}"
            raise ValueError(msg) from None
        self._old_interval = sys.getswitchinterval()  # given back by ``shutdown``
        sys.setswitchinterval(interval)
        self.engine = engine
        self.error: BaseException | None = None
        self.closed = False
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread = threading.Thread(target=self._run, name="engramrt-engine", daemon=True)
        self._thread.start()

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        """Outputs until the request (built, and so validated, by ``Engine.new_request``)
        finishes; leaving early (a disconnect) aborts it."""
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
        self._inbox.put(("add", request))
        self._wake.set()
        finished, after = False, None
        try:
            while True:
                item = after if after is not None else await q.get()
                after = None
                if isinstance(item, ValueError):
                    raise item
                if isinstance(item, BaseException):
                    raise EngineDead(f"the engine failed: {item}") from item
                # a caller behind the engine (a busy event loop) takes every output waiting as
                # one: its per-output cost (a stream chunk) then shrinks as the load grows
                while not item.finished and not q.empty():
                    after = q.get_nowait()
                    if not isinstance(after, RequestOutput):
                        break
                    item, after = item.then(after), None
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(rid, None)
            if not finished:
                self._inbox.put(("abort", rid))
                self._wake.set()

    @property
    def num_running(self) -> int:
        """Requests whose caller is still waiting for outputs."""
        return len(self._queues)

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
            self._inbox.put(("end", rid))
        self._wake.set()
        grace = loop.time() + 5.0  # their last outputs are on the way
        while self._queues and self.error is None and loop.time() < grace:
            await asyncio.sleep(0.01)
        return len(left)

    def fail(self, reason: str) -> None:
        """Declare the engine dead from outside (its loop may be stuck waiting for a stage)."""
        self._die(EngineDead(reason))

    def shutdown(self) -> None:
        self._stop.set()
        self._wake.set()
        if self.error is None:  # a dead loop may be stuck waiting for a stage: don't wait
            self._thread.join(timeout=10)
        sys.setswitchinterval(self._old_interval)

    def _deliver(self, rid: str, item) -> None:
        self._deliver_all([(rid, item)])

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

    def _apply_inbox(self) -> None:
        while True:
            try:
                op, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if op == "abort":
                self.engine.abort(arg)
                continue
            if op == "end":  # aborted by a shutdown: the caller still gets a last output
                self.engine.abort(arg)
                self._deliver(arg, RequestOutput(arg, [], "", finished=True,
                                                 finish_reason="abort"))  # fmt: skip
                continue
            try:
                self.engine.add(arg)
            except ValueError as exc:  # a request id already in use
                self._deliver(arg.id, exc)

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply_inbox()
                if not self.engine.has_work():
                    self._wake.wait(0.1)
                    self._wake.clear()
                    continue
                self._deliver_all([(out.request_id, out) for out in self.engine.step()])
        except BaseException as exc:  # noqa: BLE001 - reported to every waiting request
            self._die(exc)
            raise

    def _die(self, exc: BaseException) -> None:
        if self.error is None:
            self.error = exc
            for rid in list(self._queues):
                self._deliver(rid, exc)


def _put_all(puts: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in puts:
        q.put_nowait(item)
