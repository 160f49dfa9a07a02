"""Is every pipeline stage still there? A stage that is stopped (SIGSTOP), wedged or gone stops
answering, and rank 0 would otherwise wait in a receive for the whole distributed timeout while
``/health`` says 200. Each stage bumps a counter in the process group's key-value store from a
daemon thread; rank 0 watches the counters and calls back once one has not moved for
``timeout`` seconds. Counters, not timestamps: the stages' clocks need not agree across nodes.

The beat runs on its own thread, so a stage busy computing (or compiling a kernel) keeps beating;
only a process that no longer runs, or whose interpreter is stuck, goes quiet.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store


def _key(rank: int) -> str:
    return f"engramrt/heartbeat/{rank}"


class Heartbeat:
    """This stage's beat, every ``interval`` seconds until ``stop``."""

    def __init__(self, interval: float = 1.0):
        self.store, self.key, self.interval = _get_default_store(), _key(dist.get_rank()), interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engramrt-heartbeat", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.store.add(self.key, 1)
            except Exception:  # noqa: BLE001 - the store (rank 0) is gone: nobody is watching
                return
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()


class StageWatch:
    """On rank 0: ``on_hung(message)`` once, when some other stage's beat has stood still for
    ``timeout`` seconds (measured on this clock)."""

    def __init__(self, timeout: float, on_hung: Callable[[str], None], interval: float = 0.5):
        self.store, self.timeout, self.on_hung = _get_default_store(), timeout, on_hung
        self.interval, self.world = interval, dist.get_world_size()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engramrt-stage-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        now = time.monotonic()
        seen = dict.fromkeys(range(1, self.world), (-1, now))  # rank -> (count, last moved)
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            for rank, (count, moved) in seen.items():
                try:
                    current = self.store.add(_key(rank), 0)
                except Exception:  # noqa: BLE001 - the store is going down with this process
                    return
                if current != count:
                    seen[rank] = (current, now)
                elif now - moved > self.timeout:
                    self.on_hung(
                        f"pipeline stage {rank} has not answered for {now - moved:.0f} s "
                        f"(--stage-timeout {self.timeout:g}): it is stopped, hung or gone"
                    )
                    return

    def stop(self) -> None:
        self._stop.set()
