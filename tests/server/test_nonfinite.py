"""Logits that are not finite, over HTTP (issue 51, item 7): a checkpoint whose embedding row of
one token is NaN (a matrix, which the load check leaves to run time) once served a prompt
holding that token empty text with finish reason ``length``. Now the request is a 500 naming
the cause and the request id the server's log names, or in a stream an error event with that
status; a request running beside it answers as it does alone, and the server serves on."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server.test_server import TOK, assert_error, sse_events, wait_idle
from tests.support.poisoned import edited_model, poison
from tests.support.server_fixture import start_server, stop_server

pytestmark = pytest.mark.slow  # a server process

POISONED = TOK.encode(" zebra").ids[0]  # its embedding row is NaN
VICTIM = "The zebra ran along the river"
CLEAN = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> Iterator[tuple[str, Path]]:
    """The server's URL and log."""
    model = edited_model(tmp_path_factory.mktemp("nan") / "m", poison("embed.weight", POISONED))
    base, proc = start_server(model=model)
    try:
        yield base, Path(proc.log_path)
    finally:
        stop_server(proc)


def _logged(log: Path, message: str) -> None:
    """The error names the engine's request id, and the server's log has the same line."""
    rid = re.search(r"request ([0-9a-f]{32})", message)
    assert rid, message
    lines = [line for line in log.read_text().splitlines() if rid.group(1) in line]
    assert any(line.startswith("engramrt: request") and "NaN" in line for line in lines), lines


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_non_finite_logits_are_a_500_naming_the_cause(served, path: str) -> None:
    base, log = served
    body = {"max_tokens": 8, "temperature": 0}
    if path == "/v1/completions":
        body["prompt"] = VICTIM
    else:
        body["messages"] = [{"role": "user", "content": VICTIM}]
    r = httpx.post(f"{base}{path}", json=body, timeout=60)
    err = assert_error(r, 500, "NaN or infinity")
    assert err["type"] == "InternalServerError", err
    _logged(log, err["message"])
    wait_idle(base)


def test_a_stream_ends_with_an_error_event(served) -> None:
    base, log = served
    body = {"prompt": VICTIM, "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 500 and "NaN or infinity" in err["message"], err
    assert not any(json.loads(e).get("choices", [{}])[0].get("finish_reason") for e in events[:-2])
    _logged(log, err["message"])


def test_the_request_beside_it_answers_as_alone(served) -> None:
    base, _ = served
    alone = httpx.post(f"{base}/v1/completions", json=CLEAN, timeout=60)
    assert alone.status_code == 200, alone.text
    bodies = [{**CLEAN, "prompt": VICTIM}, CLEAN] * 3
    with ThreadPoolExecutor(len(bodies)) as pool:
        rs = list(
            pool.map(lambda b: httpx.post(f"{base}/v1/completions", json=b, timeout=60), bodies)
        )
    for body, r in zip(bodies, rs, strict=True):
        if body is CLEAN:
            assert r.status_code == 200, r.text
            assert r.json()["choices"] == alone.json()["choices"]
        else:
            assert_error(r, 500, "NaN or infinity")
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    wait_idle(base)
