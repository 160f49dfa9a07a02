"""The HTTP server's life, one behaviour whatever the number of pipeline stages:

- it says it is serving once its port is bound, naming the port bound (``--port 0``: the one
  the system chose); a failed bind exits unannounced;
- on SIGTERM or SIGINT it closes its listening socket (new connections are refused, as by
  vLLM's server), answers 503 to new requests on connections already open, lets the running
  ones finish for up to ``--shutdown-timeout`` seconds, ends the rest with finish reason
  ``abort`` and exits 0;
- when the engine dies (a step raised, or a pipeline stage stopped answering) the running
  requests get the error and the server exits 1, so that a supervisor restarts it (as vLLM
  does), instead of answering 503 for ever.

Each step is a line in the log.
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable

import uvicorn

from engramrt.engine.build import log
from engramrt.server.serving import Server


class EngineServer(uvicorn.Server):
    def __init__(
        self, config: uvicorn.Config, server: Server, ready: Callable[[int], str], drain_s: float
    ):
        """``ready``: the start line, given the port bound."""
        super().__init__(config)
        self.server, self.ready, self.drain_s = server, ready, drain_s
        self._signalled_at: float | None = None
        self._force = threading.Event()  # a second signal: cut the drain short

    @property
    def exit_code(self) -> int:
        return 1 if self.server.engine.error is not None else 0

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            log(self.ready(self.servers[0].sockets[0].getsockname()[1]))

    def handle_exit(self, sig: int, frame) -> None:
        """The first signal starts the graceful stop. The same signal often arrives twice at
        once (to the process group, and forwarded by the stage launcher): a repeat within a
        second is that; a later one cuts the drain short. Signals are not re-raised after the
        stop (uvicorn's default), so a drained server exits 0."""
        now = time.monotonic()
        if self._signalled_at is None:
            self._signalled_at = now
            self.should_exit = True
            log(f"{signal.Signals(sig).name}: shutting down")
        elif now - self._signalled_at > 1.0 and not self._force.is_set():
            self._force.set()
            log(f"{signal.Signals(sig).name} again: aborting the running requests now")

    async def on_tick(self, counter: int) -> bool:
        error = self.server.engine.error
        if error is not None and not self.should_exit:
            log(
                f"the engine failed: {error}; exiting with status 1 so that a supervisor "
                "can restart the server"
            )
            self.should_exit = True
        return await super().on_tick(counter)

    async def shutdown(self, sockets=None) -> None:
        for listener in self.servers:
            listener.close()  # no new connections; open ones get a 503 from here on
        engine = self.server.engine
        engine.close()
        if engine.error is None:
            running = engine.num_running
            log(
                f"no new requests; draining {running} running request(s) for up to "
                f"{self.drain_s:g} s (--shutdown-timeout)"
            )
            aborted = await engine.drain(self.drain_s, self._force)
            log(f"drained: {running - aborted} finished, {aborted} aborted")
        await super().shutdown(sockets)
