"""The asyncio side of the engine loop: a caller that falls behind the engine receives every
output waiting for it as one (so a busy event loop sends one stream chunk, not one per token),
with the tokens, text and logprobs of the parts in order; an error after them still comes after
them."""

from __future__ import annotations

import asyncio
import random
from types import SimpleNamespace

import pytest

from engramrt.engine.async_engine import AsyncEngine, EngineDead
from engramrt.engine.engine import RequestOutput
from engramrt.engine.request import Logprob


class Idle:
    """An engine with nothing to step: outputs come only from the test."""

    def has_work(self) -> bool:
        return False

    def add(self, req) -> None:
        pass

    def abort(self, rid: str) -> None:
        pass


def outputs(rng: random.Random, n: int, finish: bool) -> list[RequestOutput]:
    outs = []
    for i in range(n):
        ids = [rng.randrange(1000) for _ in range(rng.randint(0, 2))]
        lps = [Logprob(-rng.random(), [t], [-rng.random()]) for t in ids]
        last = finish and i == n - 1
        outs.append(RequestOutput("r", ids, "".join(chr(97 + t % 26) for t in ids), lps,
                                  [None] if i == 0 else None, last, "stop" if last else None,
                                  3, i + 1))  # fmt: skip
    return outs


async def _consume(engine: AsyncEngine, batches: list[list]) -> tuple[list, BaseException | None]:
    """Deliver each batch at once (as one engine step does) once the caller waits, and take
    one output after each (an empty batch: only what is already waiting)."""
    got, gen = [], engine.generate(SimpleNamespace(id="r"))
    pending = asyncio.ensure_future(gen.__anext__())
    error = None
    for batch in batches:
        while "r" not in engine._queues:
            await asyncio.sleep(0)
        engine._deliver_all([("r", item) for item in batch])
        try:
            got.append(await pending)
        except EngineDead as exc:
            error = exc
            break
        pending = asyncio.ensure_future(gen.__anext__())
    else:
        pending.cancel()
    await gen.aclose()
    return got, error


@pytest.mark.parametrize("seed", range(4))
def test_a_caller_behind_the_engine_gets_waiting_outputs_as_one(seed: int) -> None:
    rng = random.Random(seed)
    engine = AsyncEngine(Idle())
    try:
        outs = outputs(rng, 7, finish=True)
        cut = sorted(rng.sample(range(1, 7), 2))
        batches = [outs[: cut[0]], outs[cut[0] : cut[1]], outs[cut[1] :]]
        got, error = asyncio.run(_consume(engine, batches))
    finally:
        engine.shutdown()
    assert error is None and len(got) == 3  # the first of each batch waited for the rest
    for batch, out in zip(batches, got, strict=True):
        assert out.new_token_ids == [t for o in batch for t in o.new_token_ids]
        assert out.new_text == "".join(o.new_text for o in batch)
        assert out.new_logprobs == [lp for o in batch for lp in o.new_logprobs]
        assert out.num_output_tokens == batch[-1].num_output_tokens
    assert got[0].prompt_logprobs == [None] and got[-1].finished
    assert got[-1].finish_reason == "stop"


def test_an_error_after_waiting_outputs_comes_after_them() -> None:
    engine = AsyncEngine(Idle())
    try:
        outs = outputs(random.Random(9), 3, finish=False)
        got, error = asyncio.run(_consume(engine, [[*outs, RuntimeError("boom")], []]))
    finally:
        engine.shutdown()
    assert [o.new_token_ids for o in got] == [[t for o in outs for t in o.new_token_ids]]
    assert isinstance(error, EngineDead) and "boom" in str(error)


def test_shutdown_gives_back_the_switch_interval() -> None:
    import sys

    before = sys.getswitchinterval()
    engine = AsyncEngine(Idle())
    assert sys.getswitchinterval() != before or before == 0.0005
    engine.shutdown()
    assert sys.getswitchinterval() == before
