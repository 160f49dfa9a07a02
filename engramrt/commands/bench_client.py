"""The streaming client of ``engramrt bench serve``: a streamed /v1/completions request becomes
a record of when each content chunk arrived; the numbers are computed from the records later,
so the client stays as thin as possible while the clock runs."""

from __future__ import annotations

import json
import time
from typing import Any

from engramrt.commands.bench_metrics import RequestRecord

_NO_CONTENT = "Never received a valid chunk to calculate TTFT. This response is marked as failed!"


class SSEDecoder:
    """Splits an SSE byte stream into ``data:`` payloads, whatever the network chunking.

    Each ``data:`` line is its own payload (OpenAI-style servers send one per event);
    blank lines, ``:`` keep-alive comments and other fields are skipped. Lines are split on
    bytes before decoding so a multi-byte character cut by the network stays intact.
    """

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, data: bytes) -> list[str]:
        self._buf += data
        *lines, self._buf = self._buf.split(b"\n")
        return [p for p in map(self._payload, lines) if p is not None]

    def flush(self) -> list[str]:
        """A last line that had no newline."""
        rest, self._buf = self._buf, b""
        p = self._payload(rest)
        return [] if p is None else [p]

    @staticmethod
    def _payload(raw: bytes) -> str | None:
        line = raw.decode("utf-8").rstrip("\r")
        if not line.startswith("data:"):
            return None
        value = line[5:]
        return value[1:] if value.startswith(" ") else value


def _error_message(err: Any) -> str:
    if isinstance(err, dict):
        return str(err.get("message") or json.dumps(err))
    return str(err)


class CompletionStream:
    """Turns one streamed /v1/completions response body into a :class:`RequestRecord`.

    Pure apart from the timestamps it is handed, so crafted byte streams can test it.
    """

    def __init__(self, record: RequestRecord) -> None:
        self.record = record
        self.decoder = SSEDecoder()
        self.done = False  # [DONE] seen, or the stream reported an error
        self._usage_tokens: int | None = None

    def feed(self, data: bytes, now: float) -> bool:
        """Consume bytes that arrived at ``now``; True once nothing more is expected."""
        for payload in self.decoder.feed(data):
            self._payload(payload, now)
            if self.done:
                break
        return self.done

    def _payload(self, payload: str, now: float) -> None:
        r = self.record
        if payload.strip() == "[DONE]":
            self.done = True
            return
        try:
            obj = json.loads(payload)
        except json.JSONDecodeError:
            r.error = f"invalid JSON in stream: {payload[:200]!r}"
            self.done = True
            return
        if not isinstance(obj, dict):
            r.error = f"unexpected stream chunk: {payload[:200]!r}"
            self.done = True
            return
        if "error" in obj or obj.get("object") == "error":
            r.error = _error_message(obj.get("error", obj))
            self.done = True
            return
        choices = obj.get("choices") or []
        text = (choices[0].get("text") or "") if choices else ""
        if text:
            r.chunk_times.append(now)
            r.text += text
        usage = obj.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self._usage_tokens = int(usage["completion_tokens"])

    def finish(self, now: float) -> RequestRecord:
        """Settle success, error and the output token count once the body has ended."""
        r = self.record
        if not self.done:
            for payload in self.decoder.flush():
                self._payload(payload, now)
                if self.done:
                    break
        if not r.error and not self.done:
            r.error = "the stream ended without data: [DONE]"
        if not r.error and not r.chunk_times:
            r.error = _NO_CONTENT
        r.success = not r.error
        r.output_tokens = (
            self._usage_tokens if self._usage_tokens is not None else len(r.chunk_times)
        )
        return r


async def send_request(
    client: Any, url: str, payload: dict[str, Any], headers: dict[str, str], input_tokens: int
) -> RequestRecord:
    """One streamed completion; never raises, so one bad request cannot sink the run."""
    record = RequestRecord(input_tokens=input_tokens)
    stream = CompletionStream(record)
    record.send_time = time.perf_counter()
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode("utf-8", "replace")
                record.error = f"HTTP {resp.status_code}: {body[:500]}"
                return record
            async for data in resp.aiter_bytes():
                if stream.feed(data, time.perf_counter()):
                    break
        stream.finish(time.perf_counter())
    except Exception as exc:  # any failure is recorded, not raised
        record.success = False
        record.error = f"{type(exc).__name__}: {exc}".rstrip(": ")
    return record
