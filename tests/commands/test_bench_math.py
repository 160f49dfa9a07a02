"""`engramrt bench serve` math without a server: metrics, the SSE parser, Poisson arrivals.

Expected values are worked out by hand from the records below, not by re-running the code's
own formulas, so a wrong definition (e.g. TPOT over all tokens) shows up as a failure.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest

from engramrt.cli import add_bench_parser
from engramrt.commands import bench_serve
from engramrt.commands.bench_client import CompletionStream, SSEDecoder
from engramrt.commands.bench_metrics import (
    RequestRecord,
    compute_metrics,
    format_result,
    peak_output_throughput,
)
from engramrt.commands.bench_serve import arrival_offsets, random_prompts, sampleable_token_ids


def _records() -> list[RequestRecord]:
    """Two successes and one failure with round numbers (seconds)."""
    a = RequestRecord(
        input_tokens=10,
        send_time=100.0,
        chunk_times=[100.5, 100.7, 101.0, 101.5],
        output_tokens=4,
        success=True,
        text="abcd",
    )
    b = RequestRecord(
        input_tokens=20,
        send_time=100.2,
        chunk_times=[101.2],
        output_tokens=1,
        success=True,
        text="x",
    )
    # Failed requests carry partial data that must not leak into any metric.
    c = RequestRecord(
        input_tokens=30,
        send_time=100.1,
        chunk_times=[100.15, 100.16],
        output_tokens=2,
        success=False,
        error="HTTP 500: boom",
        text="zz",
    )
    return [a, b, c]


def test_compute_metrics_by_hand() -> None:
    m = compute_metrics(_records(), duration=2.0, percentiles=[50, 99])
    assert m["completed"] == 2 and m["failed"] == 1
    assert m["total_input_tokens"] == 30  # 10 + 20; the failed request's 30 is excluded
    assert m["total_output_tokens"] == 5  # 4 + 1
    assert m["request_throughput"] == pytest.approx(1.0)  # 2 / 2 s
    assert m["output_throughput"] == pytest.approx(2.5)  # 5 / 2 s
    assert m["total_token_throughput"] == pytest.approx(17.5)  # 35 / 2 s

    # TTFT: a 0.5 s, b 1.0 s.
    assert m["mean_ttft_ms"] == pytest.approx(750.0)
    assert m["median_ttft_ms"] == pytest.approx(750.0)
    assert m["std_ttft_ms"] == pytest.approx(250.0)
    assert m["p50_ttft_ms"] == pytest.approx(750.0)
    assert m["p99_ttft_ms"] == pytest.approx(500.0 + 0.99 * 500.0)  # linear interpolation
    # TPOT: only a (b has one token): (1.5 - 0.5) / (4 - 1).
    assert m["mean_tpot_ms"] == pytest.approx(1000.0 / 3)
    assert m["std_tpot_ms"] == pytest.approx(0.0)
    # ITL: a's gaps 0.2, 0.3, 0.5; b has none; c's 0.01 gap is excluded.
    itl = [200.0, 300.0, 500.0]
    assert m["mean_itl_ms"] == pytest.approx(1000.0 / 3)
    assert m["median_itl_ms"] == pytest.approx(300.0)
    assert m["p50_itl_ms"] == pytest.approx(300.0)
    assert m["p99_itl_ms"] == pytest.approx(np.percentile(itl, 99))
    assert m["p99_itl_ms"] == pytest.approx(300.0 + 0.98 * 200.0)  # rank 1.98 of 0..2
    assert m["std_itl_ms"] == pytest.approx(np.std(itl))
    # E2EL: a 1.5 s, b 1.0 s.
    assert m["mean_e2el_ms"] == pytest.approx(1250.0)
    # Token times 100.5, 100.7, 101.0, 101.2, 101.5: [100.5, 101.5) holds four.
    assert m["max_output_tokens_per_s"] == pytest.approx(4.0)

    assert m["input_lens"] == [10, 20, 30]
    assert m["output_lens"] == [4, 1, 0]
    assert m["ttfts"] == pytest.approx([0.5, 1.0, 0.0])
    assert [pytest.approx(x) for x in m["itls"][0]] == [0.2, 0.3, 0.5]
    assert m["itls"][1:] == [[], []]
    assert m["generated_texts"] == ["abcd", "x", "zz"]
    assert m["errors"] == ["", "", "HTTP 500: boom"]
    json.dumps(m)  # plain Python types only, ready for --save-result


def test_tpot_uses_reported_token_count_not_chunks() -> None:
    """Usage may report more tokens than text chunks (e.g. a chunk held back mid-UTF-8)."""
    r = RequestRecord(
        input_tokens=1, send_time=0.0, chunk_times=[0.1, 0.5], output_tokens=5, success=True
    )
    m = compute_metrics([r], duration=1.0, percentiles=[99])
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # (0.5 - 0.1) / 4
    assert m["mean_itl_ms"] == pytest.approx(400.0)


def test_all_failed_reads_as_zeros() -> None:
    bad = RequestRecord(input_tokens=7, send_time=1.0, error="ConnectError")
    m = compute_metrics([bad, bad], duration=3.0, percentiles=[99.9])
    assert (m["completed"], m["failed"], m["total_output_tokens"]) == (0, 2, 0)
    assert m["mean_ttft_ms"] == 0.0 and m["p99.9_ttft_ms"] == 0.0
    assert m["max_output_tokens_per_s"] == 0.0


def test_compute_metrics_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        compute_metrics([], duration=0.0, percentiles=[99])
    empty_success = RequestRecord(input_tokens=1, success=True)
    with pytest.raises(ValueError):
        compute_metrics([empty_success], duration=1.0, percentiles=[99])


def test_peak_output_throughput_sliding_window() -> None:
    assert peak_output_throughput([]) == 0.0
    # Fixed 1 s buckets from 0 see at most 3; the window [0.6, 1.6) holds 4.
    assert peak_output_throughput([0.1, 0.6, 0.9, 1.2, 1.5, 2.7]) == 4.0
    # Exactly one second apart falls outside a half-open 1 s window.
    assert peak_output_throughput([0.0, 1.0, 2.0]) == 1.0
    assert peak_output_throughput([3.0, 0.0, 0.5]) == 2.0  # order does not matter


def test_format_result_matches_vllm_layout() -> None:
    m = compute_metrics(_records(), duration=2.0, percentiles=[99])
    text = format_result(m, [99], ["ttft", "tpot", "itl"])
    lines = text.splitlines()
    assert lines[0] == "============ Serving Benchmark Result ============"
    assert lines[1] == f"{'Successful requests:':<40} 2         "
    assert lines[2].startswith("Failed requests:") and lines[2].split()[-1] == "1"
    assert lines[-1] == "=" * 50
    assert "---------------Time to First Token----------------" in lines
    assert "-----Time per Output Token (excl. 1st token)------" in lines
    assert "---------------Inter-token Latency----------------" in lines
    assert not any("End-to-end" in line for line in lines)  # e2el not selected
    assert any(line.startswith("P99 TTFT (ms):") and "995.00" in line for line in lines)
    for label in (
        "Benchmark duration (s):",
        "Total input tokens:",
        "Total generated tokens:",
        "Request throughput (req/s):",
        "Output token throughput (tok/s):",
        "Peak output token throughput (tok/s):",
        "Total token throughput (tok/s):",
    ):
        assert any(line.startswith(label) for line in lines), label


# --------------------------------------------------------------------------- SSE


def _stream_bytes() -> bytes:
    chunks = [
        b": keep-alive\n\n",
        b'data: {"choices":[{"index":0,"text":"H\xc3\xa9"}],"usage":null}\r\n\r\n',
        b"\n",
        b'data: {"choices":[{"index":0,"text":""}],"usage":null}\n\n',  # no content
        b"event: ping\n\n",
        b'data:{"choices":[{"index":0,"text":"llo"}]}\n\n',  # no space after the colon
        b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":3}}\n\n',
        b"data: [DONE]\n\n",
    ]
    return b"".join(chunks)


def test_sse_decoder_survives_any_split() -> None:
    raw = _stream_bytes()
    expected = None
    for step in (1, 2, 3, 7, len(raw)):
        dec = SSEDecoder()
        got = []
        for i in range(0, len(raw), step):
            got += dec.feed(raw[i : i + step])  # byte-wise splits cut the 2-byte "é"
        got += dec.flush()
        if expected is None:
            expected = got
        assert got == expected
    assert expected is not None and len(expected) == 5
    assert json.loads(expected[0])["choices"][0]["text"] == "Hé"
    assert expected[-1] == "[DONE]"


def test_completion_stream_times_content_chunks() -> None:
    rec = RequestRecord(input_tokens=3, send_time=10.0)
    stream = CompletionStream(rec)
    raw = _stream_bytes()
    cut1 = raw.index(b"data:{")  # first batch: keep-alive, "Hé", the empty-text chunk
    cut2 = raw.index(b"data: [DONE]")
    assert not stream.feed(raw[:cut1], now=10.5)
    assert not stream.feed(raw[cut1:cut2], now=10.8)
    assert stream.feed(raw[cut2:] + b'data: {"choices":[{"text":"late"}]}\n\n', now=11.0)
    stream.finish(now=11.0)
    assert rec.success and rec.error == ""
    assert rec.chunk_times == [10.5, 10.8]  # the empty-text chunk is not a token time
    assert rec.text == "Héllo"  # nothing after [DONE] is read
    assert rec.output_tokens == 3  # from usage


def test_completion_stream_counts_chunks_without_usage() -> None:
    rec = RequestRecord(input_tokens=1)
    stream = CompletionStream(rec)
    body = b"".join(b'data: {"choices":[{"text":"%s"}]}\n\n' % t.encode() for t in ("a", "b", "c"))
    stream.feed(body + b"data: [DONE]", now=1.0)  # no trailing newline: done on flush
    stream.finish(now=1.0)
    assert rec.success and rec.output_tokens == 3 and rec.text == "abc"


def test_completion_stream_error_chunk_fails() -> None:
    rec = RequestRecord(input_tokens=1)
    stream = CompletionStream(rec)
    body = (
        b'data: {"choices":[{"text":"a"}]}\n\n'
        b'data: {"error":{"object":"error","message":"engine died","code":500}}\n\n'
        b"data: [DONE]\n\n"
    )
    assert stream.feed(body, now=1.0)
    stream.finish(now=1.0)
    assert not rec.success and rec.error == "engine died"


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        (b'data: {"choices":[{"text":"a"}]}\n\n', "[DONE]"),  # truncated stream
        (b'data: {"choices":[],"usage":{"completion_tokens":0}}\n\ndata: [DONE]\n\n', "TTFT"),
        (b"data: {not json\n\n", "invalid JSON"),
    ],
)
def test_completion_stream_other_failures(body: bytes, needle: str) -> None:
    rec = RequestRecord(input_tokens=1)
    stream = CompletionStream(rec)
    stream.feed(body, now=1.0)
    stream.finish(now=1.0)
    assert not rec.success and needle in rec.error


# --------------------------------------------------------------------------- arrivals, prompts


def test_poisson_arrivals() -> None:
    rate = 4.0
    t = arrival_offsets(20001, rate, seed=0)
    gaps = np.diff(t)
    assert t[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    assert gaps.std() == pytest.approx(1 / rate, rel=0.05)  # exponential: std == mean
    np.testing.assert_array_equal(t, arrival_offsets(20001, rate, seed=0))
    assert not np.array_equal(t, arrival_offsets(20001, rate, seed=1))


def test_infinite_rate_sends_at_once() -> None:
    np.testing.assert_array_equal(arrival_offsets(5, float("inf"), seed=0), np.zeros(5))
    assert arrival_offsets(0, 1.0, seed=0).size == 0
    with pytest.raises(ValueError):
        arrival_offsets(3, 0.0, seed=0)


class _FakeTokenizer:
    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return 12

    def get_added_tokens_decoder(self) -> dict[int, object]:
        return {0: "<bos>", 1: "<eos>", 11: "<extra>"}


def test_random_prompts_skip_special_tokens() -> None:
    ids = sampleable_token_ids(_FakeTokenizer())
    assert ids.tolist() == list(range(2, 11))
    prompts = random_prompts(ids, num_prompts=50, input_len=40, seed=3)
    assert len(prompts) == 50 and all(len(p) == 40 for p in prompts)
    flat = {t for p in prompts for t in p}
    assert flat <= set(range(2, 11)) and len(flat) == 9
    assert prompts == random_prompts(ids, num_prompts=50, input_len=40, seed=3)


def test_parser_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "serve"])
    assert args.bench_command == "serve" and args.func is bench_serve.run
    assert (args.backend, args.endpoint, args.host, args.port) == (
        "openai",
        "/v1/completions",
        "127.0.0.1",
        8000,
    )
    assert (args.random_input_len, args.random_output_len, args.num_prompts) == (32, 16, 100)
    assert args.request_rate == float("inf") and args.max_concurrency is None
    assert args.percentile_metrics == ["ttft", "tpot", "itl"]
    assert args.metric_percentiles == [99.0]
    args = parser.parse_args(
        ["bench", "serve", "--percentile-metrics", "ttft,e2el", "--metric-percentiles", "50,99.9"]
    )
    assert args.percentile_metrics == ["ttft", "e2el"] and args.metric_percentiles == [50, 99.9]
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "serve", "--percentile-metrics", "ttft,bogus"])
