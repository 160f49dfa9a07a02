"""Engines the engine loop can drive without a model (``engine.core.Steps``), for the tests of
the loop and its client: one that never has work, one whose steps give (or raise) what the test
scripts, one whose first step is long, and ``collect``, a caller that runs one request to its
end as the server does."""

from __future__ import annotations

import threading

from engramrt.engine.client import EngineClient
from engramrt.engine.engine import RequestOutput
from engramrt.engine.request import Request, RequestLimits, SamplingParams

LIMITS = RequestLimits(100, None, 64, 16, 4, None)


class Idle:
    """An engine with nothing to step: outputs come only from the test."""

    limits = LIMITS

    def new_request(self, rid: str, prompt_ids: list[int], params) -> Request:
        return Request(rid, prompt_ids, params)

    def has_work(self) -> bool:
        return False

    def add(self, req) -> None:
        pass

    def abort(self, rid: str) -> None:
        pass

    def stats(self) -> dict[str, float]:
        return {}

    def step(self) -> list:
        return []


class Scripted(Idle):
    """An engine whose steps give the outputs (or raise the errors) the test scripts."""

    def __init__(self, script: list):
        self.script, self.added = list(script), []

    def add(self, req) -> None:
        if req.id == "taken":
            raise ValueError("request id 'taken' is already in use")
        self.added.append(req)

    def has_work(self) -> bool:
        return bool(self.script) and bool(self.added)

    def step(self) -> list:
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item


class Held(Idle):
    """An engine whose first step lasts until ``release`` is set (a long prefill: the loop reads
    no message meanwhile); each step finishes the requests added before it with one token.
    ``tokenizer``: for a server in front of it."""

    def __init__(self, limits: RequestLimits = LIMITS, tokenizer=None):
        self.limits, self.tokenizer = limits, tokenizer
        self.added: list[Request] = []
        self.stepping, self.release = threading.Event(), threading.Event()

    def add(self, req) -> None:
        self.added.append(req)

    def has_work(self) -> bool:
        return any(r.finish_reason is None for r in self.added)

    def step(self) -> list:
        if not self.stepping.is_set():
            self.stepping.set()
            self.release.wait()
        done = [r for r in self.added if r.finish_reason is None]
        for r in done:
            r.finish_reason = "length"
        return [RequestOutput(r.id, [1], "", finished=True, finish_reason="length") for r in done]


async def collect(client: EngineClient, rid: str) -> tuple[list, BaseException | None]:
    """Request ``rid``'s outputs to its end, and the error that ended it instead, if any."""
    got = []
    try:
        async for out in client.generate(Request(rid, [3, 4, 5], SamplingParams(max_tokens=2))):
            got.append(out)
    except Exception as exc:  # noqa: BLE001 - the test looks at it
        return got, exc
    return got, None
