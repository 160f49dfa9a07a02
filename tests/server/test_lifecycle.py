"""The server's life with one and with two pipeline stages: a signal drains the running requests
up to --shutdown-timeout, aborts the rest with finish reason "abort" and exits 0; a stage that
stops answering fails the running requests within seconds and the server exits 1, as it does
when the engine dies for any other reason, and when a step stalls; a slow step is served, and
/health answers while a burst of requests waits on a long one."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.commands.serve import ServeOptions, _serve_http
from engramrt.engine.build import build_stage
from engramrt.engine.client import EngineClient
from engramrt.engine.engine import Engine
from engramrt.engine.request import RequestLimits
from engramrt.parallel.launch import free_port
from engramrt.prompts import PromptEncoder
from tests.support.server_fixture import start_server, stop_server
from tests.support.stub_engines import Held


class Stream(threading.Thread):
    """One streamed completion on its own thread: its chunks, and an event once it has begun."""

    def __init__(self, base: str, max_tokens: int):
        super().__init__(daemon=True)
        self.base, self.max_tokens = base, max_tokens
        self.chunks: list[dict] = []
        self.done_marker = False
        self.begun = threading.Event()
        self.start()

    def run(self) -> None:
        body = {
            "prompt": "Hello",
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "stream": True,
            "temperature": 0,
        }
        try:
            with httpx.stream("POST", f"{self.base}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        self.done_marker = True
                    elif line.startswith("data: "):
                        self.chunks.append(json.loads(line[6:]))
                        self.begun.set()
        finally:
            self.begun.set()

    def finish_reason(self) -> str | None:
        return self.chunks[-1]["choices"][0]["finish_reason"] if self.chunks else None

    def tokens(self) -> int:
        return sum(len(c["choices"][0]["text"]) > 0 for c in self.chunks if c.get("choices"))


def _log(proc) -> str:
    return Path(proc.log_path).read_text(errors="replace")


@pytest.mark.parametrize("pp", [1, 2])
def test_signal_drains_then_aborts_and_exits_0(pp: int) -> None:
    """SIGTERM to the server's main process (the launcher, with two stages): no new requests
    (a new connection is refused; 503 on an open one, /health 503), a short request finishes,
    a long one ends with finish reason "abort" at the deadline and a clean end of stream, exit
    status 0."""
    base, proc = start_server("-pp", str(pp), "--shutdown-timeout", "6", "--max-model-len", "2048")
    try:
        with httpx.Client(base_url=base, timeout=30) as client:
            assert client.get("/health").status_code == 200  # a keep-alive connection
            long = Stream(base, 2000)
            assert long.begun.wait(30)
            short = Stream(base, 8)
            assert short.begun.wait(30)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            assert client.get("/health").status_code == 503
            r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 503 and "shutting down" in r.json()["error"]["message"]
            with pytest.raises(httpx.ConnectError):  # as docs/serving.md says
                httpx.get(f"{base}/health", timeout=5)
        short.join(30)
        long.join(30)
        assert short.finish_reason() == "length" and short.done_marker
        assert long.finish_reason() == "abort" and long.done_marker
        assert not any("error" in c for c in long.chunks)
        assert proc.wait(timeout=30) == 0
        assert time.monotonic() - signalled < 6 + 15
        log = _log(proc)
        assert "SIGTERM: shutting down" in log and "1 aborted" in log
    finally:
        stop_server(proc)


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return True
    return state == "Z"


def _group_log(proc) -> str:
    """The server's log once every process of its group has ended: the resource tracker (a
    child of the server) writes its report after the server has exited."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    return _log(proc)


@pytest.mark.parametrize("pp", [1, 2])
def test_a_killed_engine_leaks_no_semaphore(pp: int) -> None:
    """SIGKILL of the engine's process (stage 0): the server exits 1 and its log has no
    resource-tracker warning about objects the killed process could not release."""
    base, proc = start_server("-pp", str(pp))
    try:
        engine = int(re.search(r"engine pid (\d+)", _log(proc)).group(1))
        os.kill(engine, signal.SIGKILL)
        assert proc.wait(timeout=30) == 1
        log = _group_log(proc)
        assert "the engine failed" in log and "leaked" not in log, log[-2000:]
    finally:
        stop_server(proc)


@pytest.mark.parametrize("fault", [signal.SIGSTOP, signal.SIGKILL])
def test_lost_stage_fails_requests_and_exits_1(fault: signal.Signals) -> None:
    """A stage stopped (no error anywhere, its sockets stay open) or killed mid-stream: the
    stream ends with an error event naming it within seconds, not after the distributed
    timeout (a killed one: in words, the transport's own message in the log, and no
    traceback); the server exits 1 and leaves no stage process behind."""
    base, proc = start_server("-pp", "2", "--stage-timeout", "2")
    stage = None
    try:
        stage = int(re.search(r"stage 1 of 2 .* pid (\d+)", _log(proc)).group(1))
        stream = Stream(base, 2000)
        assert stream.begun.wait(30)
        os.kill(stage, fault)
        stream.join(30)
        assert not stream.is_alive(), "the stream still hangs"
        errors = [c["error"]["message"] for c in stream.chunks if "error" in c]
        assert errors and "stage 1" in errors[0], stream.chunks[-1]
        # the status the unstreamed answer would have: the engine is gone
        assert all(c["error"]["code"] == 503 for c in stream.chunks if "error" in c)
        assert proc.wait(timeout=30) == 1
        if fault == signal.SIGKILL:
            assert "pipeline stage 1 is gone" in errors[0] and "gloo" not in errors[0], errors
            log = _group_log(proc)
            assert "engramrt: stage 0: pipeline stage 1: " in log and "Traceback" not in log, log
        deadline = time.monotonic() + 10
        while not _gone(stage) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(stage)
    finally:
        if stage is not None and not _gone(stage):
            os.kill(stage, signal.SIGKILL)
        stop_server(proc)


def test_a_stopped_engine_is_detected() -> None:
    """SIGSTOP of the engine's process (stage 0, which drives the others): the server's
    process hears no heartbeat, ends the running stream with a 503 error event within
    seconds, says 503 on /health, exits 1 and leaves no engine or stage process behind. Two
    stages: the heartbeat is the one-stage server's, and the stage process must go too."""
    base, proc = start_server("-pp", "2", "--stage-timeout", "2")
    engine = stage = None
    try:
        log = _log(proc)
        engine = int(re.search(r"engine pid (\d+)", log).group(1))
        stage = int(re.search(r"stage 1 of 2 .* pid (\d+)", log).group(1))
        stream = Stream(base, 2000)
        assert stream.begun.wait(30)
        os.kill(engine, signal.SIGSTOP)
        stopped = time.monotonic()
        stream.join(30)
        assert not stream.is_alive(), "the stream still hangs"
        errors = [c["error"] for c in stream.chunks if "error" in c]
        assert errors and errors[0]["code"] == 503 and "heartbeat" in errors[0]["message"]
        assert time.monotonic() - stopped < 2 + 8
        assert proc.wait(timeout=30) == 1
        assert "no heartbeat" in _log(proc)
        for pid in (engine, stage):
            deadline = time.monotonic() + 10
            while not _gone(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert _gone(pid), pid
    finally:
        for pid in (engine, stage):
            if pid is not None and not _gone(pid):
                os.kill(pid, signal.SIGKILL)
        stop_server(proc)


@dataclass
class Served:
    """A server started by ``_serve_in_thread``: its URL, thread, engine client and, once the
    thread has ended, its exit status."""

    base: str
    thread: threading.Thread
    client: EngineClient
    code: int | None = None


def _serve_in_thread(engine, opts: ServeOptions) -> Served:
    """``engine`` served over HTTP as ``serve`` does (its loop on a thread, as under torchrun),
    once /health answers."""
    client = EngineClient.in_thread(engine, engine.tokenizer)
    prompts = PromptEncoder.load(opts.model_dir, engine.tokenizer)

    def run() -> None:
        served.code = _serve_http(opts, client, prompts)

    served = Served(f"http://127.0.0.1:{opts.port}", threading.Thread(target=run), client)
    served.thread.start()
    deadline = time.monotonic() + 30
    while True:
        try:
            if httpx.get(f"{served.base}/health").status_code == 200:
                return served
        except httpx.HTTPError:
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.1)


def _engine(**flags) -> tuple[ServeOptions, Engine]:
    opts = ServeOptions(
        GQA_MODEL_DIR,
        [4],
        max_model_len=256,
        dtype="float32",
        served_model_name=["m"],
        port=free_port(),
        disable_uvicorn_access_log=True,
        **flags,
    )
    return opts, build_stage(opts)[1]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_engine_death_exits_1() -> None:
    """A step that raises (here injected) fails the request with a 503 naming the cause, turns
    /health to 503 and makes the server return exit status 1, instead of serving 503s for
    ever; the same path a lost stage takes."""
    opts, engine = _engine()

    def broken(batch):
        raise RuntimeError("injected step failure")

    engine.pipeline.step = engine.pipeline.launch = broken  # launch: overlap scheduling
    served = _serve_in_thread(engine, opts)
    body = {"prompt": "Hi", "max_tokens": 2}
    r = httpx.post(f"{served.base}/v1/completions", json=body, timeout=30)
    assert r.status_code == 503 and "injected step failure" in r.json()["error"]["message"]
    served.thread.join(30)
    assert not served.thread.is_alive() and served.code == 1


def test_slow_steps_are_served_and_a_stalled_one_is_a_503(monkeypatch) -> None:
    """Issue 51: a busy machine's slow steps are no hang. Served as ``serve`` serves, with
    --stage-timeout 0.5 and --step-timeout 2: a request whose steps take 1 s each (asleep, then
    spinning in Python with the GIL that the HTTP server, the beat and the watch share) gets
    its 200; once a step blocks for good (its beat going on) the next request gets a 503
    naming the hang within the bound (4 times the longest step, 1 s) and the server exits 1."""
    from engramrt.engine import core

    monkeypatch.setattr(core, "BEAT_S", 0.1)  # a --stage-timeout of 0.5 s sees five beats
    opts, engine = _engine(stage_timeout=0.5, step_timeout=2.0)
    slow, stall = ["sleep", "spin"], threading.Event()
    release, step = threading.Event(), engine.step

    def held_up() -> list:
        end = time.monotonic() + 1.0
        how = slow.pop(0) if slow else "stall" if stall.is_set() else None
        if how == "sleep":
            time.sleep(1.0)
        while how == "spin" and time.monotonic() < end:
            pass
        if how == "stall":
            release.wait()
        return step()

    engine.step = held_up
    served = _serve_in_thread(engine, opts)
    try:
        body = {"prompt": "Hi", "max_tokens": 2, "ignore_eos": True}
        r = httpx.post(f"{served.base}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
        assert not slow  # both slow steps ran
        stall.set()
        stalled = time.monotonic()
        r = httpx.post(f"{served.base}/v1/completions", json=body, timeout=30)
        message = r.json()["error"]["message"]
        assert r.status_code == 503 and "hung" in message and "--step-timeout 2" in message
        assert 4.0 <= time.monotonic() - stalled < 4.0 + 3.0
        release.set()  # the loop ends, as a stopped engine's process does, before shutdown ends
        served.thread.join(30)
        assert not served.thread.is_alive() and served.code == 1
    finally:
        release.set()


def test_health_answers_while_a_burst_waits_on_a_long_step() -> None:
    """A burst of requests during a long step fills the connection to the engine, which reads
    no message until the step ends: the event loop must not wait on that connection. Served as
    ``serve`` serves, a stub engine holds its first step while 100 requests of 2,000 prompt
    ids arrive (about 600 kB of messages, some three times what the connection holds); /health
    answers within 2 s all along (a loop that waited would time out at 3 s) and each request
    is admitted (the ones the connection has no room for wait on the sender thread); once the
    step ends every request gets its 200, and the server's shutdown ends the sender thread."""
    tokenizer = PromptEncoder.load(GQA_MODEL_DIR).tokenizer
    limits = RequestLimits(tokenizer.get_vocab_size(), None, 4096, 512, 16, None)
    engine = Held(limits, tokenizer)
    opts = ServeOptions(
        GQA_MODEL_DIR,
        [4],
        served_model_name=["m"],
        port=free_port(),
        disable_uvicorn_access_log=True,
    )
    served = _serve_in_thread(engine, opts)
    burst = 100
    body = {"prompt": [256 + i % 768 for i in range(2000)], "max_tokens": 1}  # 3 bytes an id

    async def main() -> tuple[list[float], bool, bool, list[int]]:
        pool = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(base_url=served.base, timeout=30, limits=pool) as ac:
            first = asyncio.ensure_future(ac.post("/v1/completions", json=body))
            assert await asyncio.to_thread(engine.stepping.wait, 10)
            posts = [ac.post("/v1/completions", json=body) for _ in range(burst)]
            sent = asyncio.gather(*posts)
            waits, deadline = [], time.monotonic() + 6.0
            admitted = False
            while not admitted and time.monotonic() < deadline:
                start = time.monotonic()
                try:
                    assert (await ac.get("/health", timeout=3.0)).status_code == 200
                except httpx.TimeoutException:
                    pass
                waits.append(time.monotonic() - start)
                admitted = served.client.num_running == burst + 1
                await asyncio.sleep(0.1)
            overflowed = admitted and served.client._outbox.qsize() > 0
            engine.release.set()
            codes = [r.status_code for r in [await first, *await sent]]
            return waits, admitted, overflowed, codes

    try:
        waits, admitted, overflowed, codes = asyncio.run(main())
        # a loop that waited on the connection would answer only after the step: each /health
        # would time out (3 s); 2 s leaves a loaded 2-core machine its parsing of the burst
        assert max(waits) < 2.0, waits
        assert admitted, "the burst was not admitted during the step"
        assert overflowed, "the burst fitted in the connection: make it larger"
        assert codes == [200] * (burst + 1)
    finally:
        engine.release.set()
        served.client.fail("the test is over")
        served.thread.join(30)
    assert not served.thread.is_alive()
    assert not served.client._sender.is_alive()  # shutdown ended the sender thread


@pytest.mark.slow
def test_serve_under_torchrun_answers_as_one_process_and_stops_on_a_signal() -> None:
    """Under torchrun every rank is started for us and rank 0 runs the engine loop on a thread
    of the HTTP process (the same loop and messages as the engine's own process): two stages
    answer greedy requests as one process does, and SIGTERM drains and stops every rank."""
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    flags = ("--dtype", "float32", "--max-model-len", "256")
    body = {"prompt": "The capital of Bribrinu is", "max_tokens": 8, "temperature": 0}
    answers = []
    for launcher, extra in (
        (None, ()),
        ([torchrun, "--standalone", "--nproc-per-node", "2"], ("-pp", "2")),
    ):
        base, proc = start_server(*flags, *extra, launcher=launcher)
        try:
            r = httpx.post(f"{base}/v1/completions", json=body, timeout=60)
            assert r.status_code == 200, r.text
            answers.append(r.json()["choices"][0]["text"])
            if launcher is not None:  # torchrun passes SIGTERM on (and exits 1 itself)
                assert "stage 1 of 2" in _log(proc)
                os.kill(proc.pid, signal.SIGTERM)
                proc.wait(timeout=60)
                log = _log(proc)
                assert "SIGTERM: shutting down" in log and "drained" in log, log[-2000:]
                with pytest.raises(ProcessLookupError):  # no rank outlives it
                    os.killpg(proc.pid, 0)
        finally:
            stop_server(proc)
    assert answers[0] == answers[1] and answers[0]
