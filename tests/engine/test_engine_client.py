"""The server's side of the engine loop (``EngineClient``) and the loop itself over its
connection (``engine.core``): a caller that falls behind the engine receives every output
waiting for it as one (so a busy event loop sends one stream chunk, not one per token), with the
tokens, text and logprobs of the parts in order; an error after them still comes after them;
the messages round-trip by field name; a request the engine refuses, an engine that raises and
an engine that goes away all reach the waiting caller; sends never wait on a busy engine, keep
their order, and once the engine is dead only ``Stop`` still goes."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import pytest

from engramrt.engine.client import EngineClient, EngineDead
from engramrt.engine.core import Add
from engramrt.engine.engine import RequestOutput
from engramrt.engine.request import Logprob, Request, SamplingParams
from tests.support.stub_engines import Held, Idle, Scripted, collect


def outputs(rng: random.Random, n: int, finish: bool) -> list[RequestOutput]:
    outs = []
    for i in range(n):
        ids = [rng.randrange(1000) for _ in range(rng.randint(0, 2))]
        lps = [Logprob(-rng.random(), [t], [-rng.random()]) for t in ids]
        last = finish and i == n - 1
        outs.append(
            RequestOutput(
                "r",
                ids,
                "".join(chr(97 + t % 26) for t in ids),
                lps,
                [None] if i == 0 else None,
                last,
                "stop" if last else None,
                3,
                i + 1,
            )
        )
    return outs


async def _consume(engine: EngineClient, batches: list[list]) -> tuple[list, BaseException | None]:
    """Deliver each batch at once (as one engine step does) once the caller waits, and take
    one output after each (an empty batch: only what is already waiting)."""
    got, gen = [], engine.generate(Request("r", [1, 2], SamplingParams()))
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
    engine = EngineClient.in_thread(Idle())
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
    engine = EngineClient.in_thread(Idle())
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
    engine = EngineClient.in_thread(Idle())
    assert sys.getswitchinterval() != before or before == 0.0005
    engine.shutdown()
    assert sys.getswitchinterval() == before


def test_outputs_cross_the_connection_by_field_name() -> None:
    lp = Logprob(-0.5, [7, 8], [-0.5, -1.25])
    first = RequestOutput("r", [7], "seven", [lp], [None, lp], False, None, 3, 1)
    last = RequestOutput("r", [9], " nine", [], None, True, "length", 3, 2)
    engine = Scripted([[first], [last]])
    client = EngineClient.in_thread(engine)
    try:
        got, error = asyncio.run(collect(client, "r"))
        assert error is None
        assert [o.new_token_ids for o in got] in ([[7], [9]], [[7, 9]])
        merged = got[0] if len(got) == 1 else got[0].then(got[1])
        assert merged == first.then(last)
        # the request crossed whole: its prompt and parameters as sent
        (req,) = engine.added
        assert req.prompt_ids == [3, 4, 5] and req.params == SamplingParams(max_tokens=2)
        assert client.num_running == 0
    finally:
        client.shutdown()


def test_a_refused_request_is_a_value_error_and_the_engine_lives_on() -> None:
    engine = Scripted([[RequestOutput("r", [1], "a", finished=True, finish_reason="stop")]])
    client = EngineClient.in_thread(engine)
    try:
        _, error = asyncio.run(collect(client, "taken"))
        assert isinstance(error, ValueError) and "already in use" in str(error)
        got, error = asyncio.run(collect(client, "r"))
        assert error is None and got[-1].finished and client.error is None
    finally:
        client.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_engine_that_raises_fails_the_waiting_caller_and_reports_itself_dead() -> None:
    client = EngineClient.in_thread(Scripted([RuntimeError("step exploded")]))
    try:
        _, error = asyncio.run(collect(client, "r"))
        assert isinstance(error, EngineDead) and "step exploded" in str(error)
        assert client.error is not None
        _, late = asyncio.run(collect(client, "late"))
        assert isinstance(late, EngineDead) and "stopped" in str(late)
    finally:
        client.shutdown()


def test_the_boundary_checks_the_engines_limits() -> None:
    client = EngineClient.in_thread(Idle())
    try:
        with pytest.raises(ValueError, match="maximum context length is 64"):
            client.new_request("x", [1] * 60, SamplingParams(max_tokens=5))
        with pytest.raises(ValueError, match="outside the vocabulary"):
            client.new_request("x", [100], SamplingParams(max_tokens=1))
        req = client.new_request("x", [1] * 59, SamplingParams(max_tokens=5))
        assert req.prompt_ids == [1] * 59
    finally:
        client.shutdown()


@pytest.mark.parametrize("seed", range(6))
def test_request_text_ends_at_the_first_stop_string_whatever_the_output_split(seed: int) -> None:
    """The server's text of a request (``RequestText``) against a brute-force oracle: the text
    is the full decode up to the first stop string, the ids end at the first prefix whose
    decode holds it, and outputs after that end are dropped, however the tokens were split
    into outputs (one step's, or several merged)."""
    from engramrt.bundled import GQA_MODEL_DIR
    from engramrt.engine.detokenize import RequestText
    from engramrt.engram import load_tokenizer

    tok = load_tokenizer(GQA_MODEL_DIR)
    rng = random.Random(seed)
    prompt = [rng.randrange(6, 1000) for _ in range(5)]
    ids = [rng.randrange(6, 1000) for _ in range(40)]

    def decode(n: int) -> str:
        return tok.decode(ids[:n], skip_special_tokens=True)

    full = decode(len(ids))
    at = rng.randrange(len(full) // 3, len(full) - 3)
    stop = full[at : at + rng.randint(1, 3)]
    first = full.find(stop)
    cut = next(n for n in range(1, len(ids) + 1) if stop in decode(n))
    text, outs, i = RequestText(tok, prompt, [stop]), [], 0
    while i < len(ids):
        k = rng.randint(1, 4)
        chunk = ids[i : i + k]
        i += len(chunk)
        out = RequestOutput(
            "r",
            chunk,
            "",
            [],
            None,
            i == len(ids),
            "length" if i == len(ids) else None,
            len(prompt),
            i,
        )
        got = text.apply(out)
        if got is not None:
            outs.append(got)
    assert "".join(o.new_text for o in outs) == full[:first]
    assert [t for o in outs for t in o.new_token_ids] == ids[:cut]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    assert outs[-1].num_output_tokens == cut and all(not o.finished for o in outs[:-1])


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_an_engine_that_cannot_start_is_an_error_naming_why() -> None:
    class Unready(Idle):
        @property
        def limits(self):
            raise RuntimeError("no KV cache could be allocated")

    with pytest.raises(EngineDead, match="no KV cache could be allocated"):
        EngineClient.in_thread(Unready())
    for thread in threading.enumerate():  # its error is raised in this test, not a later one
        if thread.name == "engramrt-engine":
            thread.join(5)


def _overfill(client: EngineClient, engine: Held) -> float:
    """Hold the engine in a step, then send it 100 requests of 2,000 ids (about 600 kB: more
    than the connection holds); how long the sends took. Sends that wait for the step (the old
    code) end it after 5 s."""
    client._send(Add("first", [1], SamplingParams(max_tokens=1)))
    assert engine.stepping.wait(10)
    guard = threading.Timer(5.0, engine.release.set)
    guard.start()
    prompt, start = [300] * 2000, time.monotonic()
    for i in range(100):
        client._send(Add(f"r{i}", prompt, SamplingParams(max_tokens=1)))
    guard.cancel()
    return time.monotonic() - start


def test_sends_never_wait_on_a_busy_engine_and_arrive_in_order() -> None:
    """The event loop sends (``_send``): while the engine is on a long step, reading nothing,
    sends that overfill the connection return at once; after the step the engine gets every
    one, in order; shutdown ends the sender thread."""
    engine = Held()
    client = EngineClient.in_thread(engine)
    try:
        assert _overfill(client, engine) < 1.0
        engine.release.set()
        deadline = time.monotonic() + 10
        while len(engine.added) < 101 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [r.id for r in engine.added] == ["first"] + [f"r{i}" for i in range(100)]
    finally:
        engine.release.set()
        client.shutdown()
    assert not client._sender.is_alive()


def test_a_reader_left_waiting_keeps_its_connection() -> None:
    """Shutting down a client whose loop is stuck in a step leaves its reader in a read with
    the connection open: closed under that read, the descriptor's number would go to the next
    connection made, whose bytes the read would take (a client's first message came cut
    short so); once the loop ends, a shutdown ends the reader and closes."""
    engine = Held()
    stuck = EngineClient.in_thread(engine)
    try:
        stuck._send(Add("first", [1], SamplingParams(max_tokens=1)))
        assert engine.stepping.wait(10)
        stuck.shutdown(timeout=0.2)
        assert stuck._reader.is_alive() and not stuck.conn.closed
    finally:
        engine.release.set()
    ended = EngineClient.in_thread(Held())
    ended.shutdown()
    assert not ended._reader.is_alive() and ended.conn.closed


def test_once_the_engine_is_dead_only_stop_is_sent() -> None:
    """Sends still waiting when the engine is declared dead are dropped (their callers have the
    error), but ``Stop`` still ends a loop that outlived its death (a hang released)."""
    engine = Held()
    client = EngineClient.in_thread(engine)
    try:
        _overfill(client, engine)
        client.fail("declared dead")
        engine.release.set()
    finally:
        engine.release.set()
        client.shutdown()
    assert not client.worker.is_alive() and not client._sender.is_alive()
    got = [r.id for r in engine.added]
    assert len(got) < 101  # what the connection held, not what waited behind it
    assert got == ["first"] + [f"r{i}" for i in range(len(got) - 1)]
