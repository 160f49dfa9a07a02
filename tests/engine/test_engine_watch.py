"""The server's watch over the engine loop (``EngineClient.watch``): an engine that sends no
beat is stopped; one that beats but stays on one step past the bound without progress is hung;
one whose steps are merely slow (asleep in C, or spinning in Python with the GIL) is neither,
however far past the beat's timeout they run, and the bound grows with the longest step seen.
On the CPU a step still computing is progress however long it takes (the first step of a loaded
machine has no longest step to grow the bound); a GPU engine's host thread spins in its
synchronisations whether or not the device moves, so there time alone decides."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from engramrt.engine import core
from engramrt.engine.client import EngineClient, EngineDead
from engramrt.engine.engine import RequestOutput
from tests.support.stub_engines import Idle, Scripted, collect

DONE = RequestOutput("r", [1], "a", finished=True, finish_reason="length")


class Timed(Scripted):
    """Steps that take the seconds given, asleep (the GIL free, as in a torch op) or spinning
    in Python (the GIL held but for the interpreter's switch interval); the last one finishes
    the request."""

    def __init__(self, seconds: list[float], spin: bool):
        super().__init__([[]] * (len(seconds) - 1) + [[DONE]])
        self.seconds, self.spin = list(seconds), spin

    def step(self) -> list:
        end = time.monotonic() + self.seconds.pop(0)
        if not self.spin:
            time.sleep(end - time.monotonic())
        while time.monotonic() < end:
            pass
        return super().step()


class Deadlocked(Scripted):
    """A step that never returns (a lock taken twice, a receive nobody answers): the loop's
    thread is stuck while its process, and its beat, live on."""

    def __init__(self):
        super().__init__([[]])
        self.release = threading.Event()

    def step(self) -> list:
        self.release.wait()
        return []


def test_only_the_stalled_engine_is_declared_hung_beside_slow_ones(monkeypatch) -> None:
    """Four engines watched alike (no beat for 0.5 s: stopped; one step past 1.5 s and 4 times
    the longest so far: hung): two whose steps take 1 s and then 3 s, asleep and spinning with
    the GIL (which the watches, the beats and the other loops share), finish their requests; a
    deadlocked one fails its caller naming a hang within the bound and a little; an idle one
    lives on."""
    monkeypatch.setattr(core, "BEAT_S", 0.1)  # a watch of 0.5 s sees five beats a timeout
    stuck = Deadlocked()
    engines = [Timed([1.0, 3.0], spin=False), Timed([1.0, 3.0], spin=True), stuck, Idle()]
    clients = [EngineClient.in_thread(e) for e in engines]
    for c in clients:
        c.watch(0.5, 1.5)

    async def run() -> list:
        return await asyncio.gather(*(collect(c, "r") for c in clients[:3]))

    try:
        start = time.monotonic()
        (asleep, _), (spinning, _), (_, hung) = asyncio.run(run())
        assert asleep[-1].finished and spinning[-1].finished
        assert isinstance(hung, EngineDead) and "hung" in str(hung), hung
        assert time.monotonic() - start >= 4.0  # the slow ones ran their course
        assert [c.error for c in (clients[0], clients[1], clients[3])] == [None] * 3
    finally:
        stuck.release.set()
        for c in reversed(clients):  # each gives back the switch interval it found
            c.shutdown()


def test_a_stalled_engine_is_declared_hung_within_the_bound(monkeypatch) -> None:
    monkeypatch.setattr(core, "BEAT_S", 0.1)
    engine = Deadlocked()
    client = EngineClient.in_thread(engine)
    client.watch(0.5, 1.0)
    try:
        start = time.monotonic()
        _, error = asyncio.run(collect(client, "r"))
        took = time.monotonic() - start
        assert isinstance(error, EngineDead) and "--step-timeout 1" in str(error), error
        assert 1.0 <= took < 1.0 + 2.0
    finally:
        engine.release.set()
        client.shutdown()


class ComputesThenBlocks(Deadlocked):
    """A first step that computes (a torch product over and over: the CPU's work, the GIL
    free) for ``compute`` seconds, then blocks for good."""

    def __init__(self, compute: float):
        super().__init__()
        self.compute = compute

    def step(self) -> list:
        a, end = torch.ones(64, 64), time.monotonic() + self.compute
        while time.monotonic() < end:
            a = (a @ a).clamp_(max=1.0)
        return super().step()


@pytest.mark.skipif(core._thread_clock() is None, reason="no per-thread CPU clock here")
@pytest.mark.parametrize("on_cpu", [True, False])
def test_a_long_first_step_is_hung_only_once_it_stops_computing(monkeypatch, on_cpu) -> None:
    """A first step (no longest step yet: the bound is --step-timeout alone, 1 s) that computes
    for 3 s and then blocks: on the CPU it counts as progress, so the engine is declared hung a
    bound after the computing ends and not before; on a GPU (``on_cpu`` False) the host
    thread's CPU time says nothing, and the hang is declared at the bound."""
    monkeypatch.setattr(core, "BEAT_S", 0.1)
    engine = ComputesThenBlocks(3.0)
    client = EngineClient.in_thread(engine, on_cpu=on_cpu)
    client.watch(0.5, 1.0)
    try:
        start = time.monotonic()
        _, error = asyncio.run(collect(client, "r"))
        took = time.monotonic() - start
        assert isinstance(error, EngineDead) and "without progress" in str(error), error
        low = 3.0 + 1.0 if on_cpu else 1.0
        assert low <= took < low + 3.0, took
    finally:
        engine.release.set()
        client.shutdown()


def test_a_silent_engine_is_declared_stopped(monkeypatch) -> None:
    """No beat for the timeout (a stopped process sends none; here the loop's beat waits
    longer than the test) fails the caller naming it."""
    monkeypatch.setattr(core, "BEAT_S", 60.0)
    client = EngineClient.in_thread(Idle())
    client.watch(0.5, 60.0)
    try:
        deadline = time.monotonic() + 5
        while client.error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert isinstance(client.error, EngineDead) and "no heartbeat" in str(client.error)
    finally:
        client.shutdown()
