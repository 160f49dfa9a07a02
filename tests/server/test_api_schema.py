"""The server's contract as ``/openapi.json`` states it: every route's statuses and content
types as the server answers them (no FastAPI 422: bad bodies are 400s), the API key compared in
constant time; and a schema-driven fuzzer (schemathesis, coverage and a bounded fuzzing phase)
against the running server finds no 5xx and no response outside the schema."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import httpx
import pytest
from fastapi.testclient import TestClient

from engramrt.server import app as app_mod
from engramrt.server.serving import ServerConfig
from tests.support.server_fixture import server_fixture


class _Stub:
    """Enough of a Server for routes that answer before touching the engine."""

    def __init__(self, key: str | None = None):
        self.cfg = ServerConfig(["m"], 128, api_key=key)


def test_schema_states_what_the_server_answers() -> None:
    schema = app_mod.create_app(_Stub()).openapi()
    text = json.dumps(schema)
    assert "422" not in json.dumps(
        {p: list(o) for p, ops in schema["paths"].items() for o in ops.values()}
    )
    assert "HTTPValidationError" not in text
    for path in ("/v1/completions", "/v1/chat/completions"):
        op = schema["paths"][path]["post"]["responses"]
        assert set(op["200"]["content"]) == {"application/json", "text/event-stream"}
        assert op["200"]["content"]["text/event-stream"]["schema"]["properties"]["data"]
        for status in ("400", "401", "404", "413", "500", "503"):
            assert op[status]["content"]["application/json"]["schema"]["$ref"].endswith(
                "/ErrorBody"
            )
    assert schema["paths"]["/health"]["get"]["responses"]["200"].get("content", {}) == {}
    assert set(schema["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    req = schema["components"]["schemas"]["CompletionRequest"]["properties"]
    assert req["top_p"]["exclusiveMinimum"] == 0 and req["top_p"]["maximum"] == 1


def test_api_key_is_compared_in_constant_time(monkeypatch) -> None:
    calls = []
    real = app_mod.hmac.compare_digest

    def recording(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app_mod.hmac, "compare_digest", recording)
    client = TestClient(app_mod.create_app(_Stub("sk-secret")))
    for header in ("Bearer sk-secreT", "Bearer sk", ""):
        r = client.get("/v1/models", headers={"Authorization": header} if header else {})
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
    assert len(calls) == 3 and all(b == b"Bearer sk-secret" for _, b in calls)


fuzz_server = server_fixture("--max-model-len", "192", "--max-num-seqs", "8")


@pytest.mark.slow
def test_fuzzing_finds_no_server_error_and_no_schema_mismatch(fuzz_server: str, tmp_path) -> None:
    cmd = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "run",
        f"{fuzz_server}/openapi.json",
        "--phases",
        "coverage,fuzzing",
        "--max-examples",
        "12",
        "--seed",
        "1",
        "--checks",
        "not_a_server_error,status_code_conformance,content_type_conformance,"
        "response_schema_conformance",
        "--request-timeout",
        "60",
        "--no-color",
    ]
    # from a scratch folder: schemathesis keeps a cache in the current directory
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-6000:]
    counts = re.search(r"(\d+) generated", out)
    print("schemathesis:", counts.group(0) if counts else out[-400:])
    r = httpx.post(f"{fuzz_server}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    assert r.status_code == 200
    metrics = httpx.get(f"{fuzz_server}/metrics").text
    assert re.search(r"engramrt:num_requests_running\{[^}]*\} 0\.0", metrics)
