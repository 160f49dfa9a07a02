"""``engramrt serve`` over HTTP: the official openai client, raw requests for bad input, metrics,
load, disconnects, PP = 2 and batch invariance (chunked prefill, preemption).

Every expectation comes from another run of the same server (or another server) or from an
invariant of the API; no generated text is hard-coded."""

from __future__ import annotations

import asyncio
import json
import math
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import httpx
import openai
import pytest
import torch
from pydantic import BaseModel

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.config import load_json
from engramrt.engram.token_map import load_tokenizer
from engramrt.models import model_config
from engramrt.prompts import PromptEncoder
from engramrt.runner.batch import NewRequest, StepBatch
from engramrt.runner.stage import StageRunner
from engramrt.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tests.support.offsets_oracle import check_text_offsets
from tests.support.server_fixture import running_server, server_fixture, start_server, stop_server

pytestmark = pytest.mark.slow  # every test talks to a server process

MAX_LEN = 1024
API_KEY = "sk-engramrt-test"
TOK = load_tokenizer(GQA_MODEL_DIR)
BOS = model_config(load_json(GQA_MODEL_DIR)).bos_token_id
VOCAB = TOK.get_vocab_size(with_added_tokens=True)

server = server_fixture("--max-model-len", str(MAX_LEN))
keyed_server = server_fixture("--api-key", API_KEY)

PROMPTS = [
    "The quick brown fox",
    "Hello",
    "In a garden by the river, the mountains rose over the quiet town and",
    "Engram tables hash n-grams of the prompt into rows",
]


# --- helpers ---------------------------------------------------------------------------------


ADD_BOS = json.loads((GQA_MODEL_DIR / "tokenizer_config.json").read_text())["add_bos_token"]


def ids_of(text: str) -> list[int]:
    """The prompt ids the server builds for a string prompt: the tokenizer's ids, after BOS
    only where the tokenizer config adds it (the bundled one does not)."""
    return [BOS] * ADD_BOS + TOK.encode(text).ids


def client(base: str, key: str = "EMPTY") -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=f"{base}/v1", max_retries=0, timeout=120)


def model_name(base: str, headers: dict | None = None) -> str:
    return httpx.get(f"{base}/v1/models", headers=headers).json()["data"][0]["id"]


def post(base: str, path: str, body: dict, **kw) -> dict:
    r = httpx.post(f"{base}{path}", json=body, timeout=120, **kw)
    assert r.status_code == 200, r.text
    return r.json()


def complete(base: str, **body) -> dict:
    return post(base, "/v1/completions", body)


def greedy(base: str, prompt, max_tokens: int = 12) -> str:
    out = complete(base, prompt=prompt, max_tokens=max_tokens, temperature=0)
    return out["choices"][0]["text"]


def metrics(base: str) -> dict[str, float]:
    """``name{labels}`` -> value for every sample line of /metrics."""
    r = httpx.get(f"{base}/metrics", timeout=30)
    assert r.status_code == 200
    out = {}
    for line in r.text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def metric(m: dict[str, float], name: str) -> float:
    """The sum over all label sets of one metric name."""
    hits = [v for k, v in m.items() if k == name or k.startswith(name + "{")]
    assert hits, f"{name} not in /metrics"
    return sum(hits)


IDLE = (
    "engramrt:num_requests_running",
    "engramrt:num_requests_waiting",
    "engramrt:kv_cache_usage_perc",
    "engramrt:engram_history_slots_used",
)


def wait_idle(base: str, timeout: float = 5.0) -> dict[str, float]:
    """Poll /metrics until nothing runs or waits and no KV block or history slot is held."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(base)
        values = {name: metric(m, name) for name in IDLE}
        if all(v == 0 for v in values.values()):
            return m
        if time.monotonic() > deadline:
            pytest.fail(f"server not idle after {timeout} s: {values}")
        time.sleep(0.1)


def assert_error(r: httpx.Response, status: int, *needles: str) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    assert err["code"] == status, err
    for needle in needles:
        assert needle.lower() in err["message"].lower(), (needle, err)
    return err


def sse_events(r: httpx.Response) -> list[str]:
    return [line[len("data: ") :] for line in r.iter_lines() if line.startswith("data: ")]


def mid_substring(text: str) -> str:
    """A short ASCII substring whose first occurrence lies strictly inside ``text``."""
    for size in (3, 2, 1):
        for k in range(len(text) // 3, len(text) - size):
            s = text[k : k + size]
            if s.isascii() and s.isprintable() and s.strip() and 0 < text.find(s) < k + 1:
                return s
    pytest.skip(f"no usable stop substring in {text!r}")


# --- models, health, metrics -------------------------------------------------------------------


def test_models_health_metrics(server: str) -> None:
    r = httpx.get(f"{server}/v1/models")
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "list" and len(body["data"]) >= 1
    for m in body["data"]:
        assert {"id", "object", "created", "owned_by", "root", "max_model_len"} <= set(m)
        assert m["object"] == "model" and isinstance(m["id"], str) and m["id"]
        assert isinstance(m["created"], int) and m["max_model_len"] == MAX_LEN
    listed = client(server).models.list()
    assert [m.id for m in listed.data] == [m["id"] for m in body["data"]]
    for card in body["data"]:  # one model's card, as client.models.retrieve asks for it
        assert httpx.get(f"{server}/v1/models/{card['id']}").json() == card
        assert client(server).models.retrieve(card["id"]).id == card["id"]
    assert_error(httpx.get(f"{server}/v1/models/no-such-model"), 404, "does not exist")
    with pytest.raises(openai.NotFoundError):
        client(server).models.retrieve("no-such-model")

    assert httpx.get(f"{server}/health").status_code == 200
    greedy(server, PROMPTS[0], 2)  # so the latency histograms have a sample
    r = httpx.get(f"{server}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    for name in (
        "engramrt:num_requests_running",
        "engramrt:num_requests_waiting",
        "engramrt:kv_cache_usage_perc",
        "engramrt:engram_history_slots_used",
        "engramrt:time_to_first_token_seconds",
        "engramrt:prompt_tokens_total",
        "engramrt:generation_tokens_total",
        "engramrt:num_preemptions_total",
    ):
        assert name in r.text, name
    m = metrics(server)
    assert metric(m, "engramrt:time_to_first_token_seconds_count") >= 1
    assert metric(m, "engramrt:prompt_tokens_total") >= len(ids_of(PROMPTS[0]))


def test_metrics_count_tokens(server: str) -> None:
    before = metrics(server)
    out = complete(server, prompt=PROMPTS[2], max_tokens=5, temperature=0)
    after = metrics(server)
    usage = out["usage"]
    for name, key in (
        ("engramrt:prompt_tokens_total", "prompt_tokens"),
        ("engramrt:generation_tokens_total", "completion_tokens"),
    ):
        assert metric(after, name) - metric(before, name) == usage[key], name


# --- the openai client ---------------------------------------------------------------------------


def check_usage(usage, completion_tokens: int | None = None) -> None:
    assert usage.prompt_tokens + usage.completion_tokens == usage.total_tokens
    if completion_tokens is not None:
        assert usage.completion_tokens == completion_tokens


def test_openai_completion(server: str) -> None:
    c, model = client(server), model_name(server)
    prompt = PROMPTS[0]
    out = c.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0, logprobs=0)
    assert out.object == "text_completion" and out.model == model and out.id.startswith("cmpl-")
    (choice,) = out.choices
    assert choice.index == 0 and choice.finish_reason in ("stop", "length")
    n_tokens = len(choice.logprobs.tokens)
    check_usage(out.usage, n_tokens)
    assert out.usage.prompt_tokens == len(ids_of(prompt))
    if choice.finish_reason == "length":
        assert n_tokens == 10
    again = c.completions.create(model=model, prompt=prompt, max_tokens=10, temperature=0)
    assert again.choices[0].text == choice.text  # greedy is deterministic
    assert again.choices[0].logprobs is None


def test_openai_completion_length_usage(server: str) -> None:
    c = client(server)
    out = c.completions.create(
        model=model_name(server),
        prompt=PROMPTS[1],
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].finish_reason == "length"
    check_usage(out.usage, 7)


def test_max_tokens_defaults(server: str) -> None:
    """Without max_tokens a chat runs to the end of the context and a completion stops at 16
    tokens (OpenAI's default, as vLLM)."""
    messages = [{"role": "user", "content": "x " * 495}]
    n_prompt = post(server, "/tokenize", {"messages": messages})["count"]
    assert MAX_LEN - 40 < n_prompt < MAX_LEN
    body = {"messages": messages, "temperature": 0, "ignore_eos": True}
    out = post(server, "/v1/chat/completions", body)
    assert out["usage"]["completion_tokens"] == MAX_LEN - n_prompt
    assert out["choices"][0]["finish_reason"] == "length"
    out = complete(server, prompt=PROMPTS[1], temperature=0, ignore_eos=True)
    assert out["usage"]["completion_tokens"] == 16


def test_override_generation_config_sets_request_defaults() -> None:
    """vLLM's --override-generation-config: max_new_tokens caps a chat that gives no
    max_tokens, temperature is the default of a request that gives none; a request's own
    values win, and a completion keeps its default of 16."""
    config = json.dumps({"max_new_tokens": 5, "temperature": 0})
    with running_server("--override-generation-config", config) as base:
        chat = {"messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}
        out = post(base, "/v1/chat/completions", chat)
        assert out["usage"]["completion_tokens"] == 5
        assert out["choices"][0]["finish_reason"] == "length"
        out = post(base, "/v1/chat/completions", {**chat, "max_tokens": 9})
        assert out["usage"]["completion_tokens"] == 9
        assert (
            complete(base, prompt=PROMPTS[1], ignore_eos=True)["usage"]["completion_tokens"] == 16
        )

        def texts(**sampling) -> list[str]:
            body = {"prompt": PROMPTS[0], "max_tokens": 8, "n": 4, "seed": 0, **sampling}
            return [c["text"] for c in complete(base, **body)["choices"]]

        assert texts() == texts(temperature=0) == [greedy(base, PROMPTS[0], 8)] * 4
        assert len(set(texts(temperature=1.0))) > 1  # the request's own temperature


def test_openai_completion_stream(server: str) -> None:
    c, model = client(server), model_name(server)
    prompt = PROMPTS[2]
    full = c.completions.create(model=model, prompt=prompt, max_tokens=9, temperature=0)
    stream = c.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=9,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    *content, last = chunks
    assert last.choices == [] and last.usage is not None
    check_usage(last.usage, full.usage.completion_tokens)
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(len(ch.choices) == 1 and ch.usage is None for ch in content)
    assert len(content) <= full.usage.completion_tokens  # a chunk per token, or fewer (held)
    assert all(ch.choices[0].text or ch.choices[0].finish_reason for ch in content)
    assert "".join(ch.choices[0].text for ch in content) == full.choices[0].text
    assert all(ch.choices[0].finish_reason is None for ch in content[:-1])
    assert content[-1].choices[0].finish_reason == full.choices[0].finish_reason

    plain = list(
        c.completions.create(model=model, prompt=prompt, max_tokens=9, temperature=0, stream=True)
    )
    assert all(ch.usage is None and len(ch.choices) == 1 for ch in plain)
    assert "".join(ch.choices[0].text for ch in plain) == full.choices[0].text


def test_openai_chat(server: str) -> None:
    c, model = client(server), model_name(server)
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Name three rivers."},
    ]
    full = c.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    assert full.object == "chat.completion" and full.model == model
    (choice,) = full.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    check_usage(full.usage)
    if choice.finish_reason == "length":
        assert full.usage.completion_tokens == 8
    assert full.usage.completion_tokens <= 8

    via_mct = c.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=8, temperature=0
    )
    assert via_mct.choices[0].message.content == choice.message.content

    stream = c.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    *content, last = chunks
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump() == full.usage.model_dump()
    assert content[0].choices[0].delta.role == "assistant"
    text = "".join(ch.choices[0].delta.content or "" for ch in content)
    assert text == choice.message.content
    assert content[-1].choices[0].finish_reason == choice.finish_reason
    assert all(ch.choices[0].finish_reason is None for ch in content[:-1])


def test_completion_logprobs(server: str) -> None:
    c = client(server)
    k, max_tokens = 3, 10
    out = c.completions.create(
        model=model_name(server),
        prompt=PROMPTS[3],
        max_tokens=max_tokens,
        temperature=0,
        logprobs=k,
    )
    (choice,) = out.choices
    lp = choice.logprobs
    n = out.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert len(lp.text_offset) == n
    assert lp.text_offset[0] == 0
    for i in range(1, n):  # offsets advance by each token's text
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    for token_lp, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert isinstance(token_lp, float) and token_lp <= 0
        # keyed by token text, so two tokens with the same text can share one entry
        assert 1 <= len(top) <= k
        assert all(v <= 0 for v in top.values())
        assert token_lp >= min(top.values()) - 1e-6
        assert token_lp >= max(top.values()) - 1e-5  # greedy picks the argmax


def test_chat_logprobs(server: str) -> None:
    c = client(server)
    out = c.chat.completions.create(
        model=model_name(server),
        messages=[{"role": "user", "content": "Tell me about gardens."}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    (choice,) = out.choices
    content = choice.logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert isinstance(entry.token, str) and entry.logprob <= 0
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and all(v <= 0 for v in tops)
        assert entry.logprob >= min(tops) - 1e-6
        assert abs(entry.logprob - tops[0]) <= 1e-5  # greedy: the sampled token is the top one
        assert entry.top_logprobs[0].token == entry.token


def test_echo_loglikelihood_token_ids(server: str) -> None:
    """lm-eval's local-completions loglikelihood request."""
    c, model = client(server), model_name(server)
    ids = ids_of(PROMPTS[2])
    out = c.completions.create(
        model=model, prompt=ids, max_tokens=1, logprobs=1, echo=True, temperature=0
    )
    (choice,) = out.choices
    lp = choice.logprobs
    assert choice.text.startswith(TOK.decode(ids, skip_special_tokens=False))
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(v, float) and v <= 0 for v in lp.token_logprobs[1:])
    assert all(isinstance(t, dict) and 1 <= len(t) for t in lp.top_logprobs[1:])
    assert lp.tokens[: len(ids)] == [TOK.decode([t], skip_special_tokens=False) for t in ids]
    assert lp.text_offset[0] == 0
    check_usage(out.usage, 1)
    assert out.usage.prompt_tokens == len(ids)

    # the generated token and its logprob match a plain (non-echo) request
    plain = c.completions.create(model=model, prompt=ids, max_tokens=1, logprobs=1, temperature=0)
    assert choice.text.endswith(plain.choices[0].text)
    assert lp.tokens[-1] == plain.choices[0].logprobs.tokens[0]
    assert math.isclose(
        lp.token_logprobs[-1], plain.choices[0].logprobs.token_logprobs[0], abs_tol=1e-4
    )
    # a prompt token's score does not depend on what follows it: to bfloat16 rounding here
    # (a chunk of another length is a GEMM of another shape; float32 in the test below)
    half = len(ids) // 2
    head = c.completions.create(
        model=model, prompt=ids[:half], max_tokens=1, logprobs=1, echo=True, temperature=0
    )
    for a, b in zip(
        head.choices[0].logprobs.token_logprobs[1:half], lp.token_logprobs[1:half], strict=True
    ):
        assert math.isclose(a, b, abs_tol=0.05)
    # max_tokens 0 (as vLLM takes it): the same prompt part, and nothing generated
    bare = c.completions.create(
        model=model, prompt=ids, max_tokens=0, logprobs=1, echo=True, temperature=0
    )
    (only,) = bare.choices
    assert only.text == TOK.decode(ids, skip_special_tokens=False)
    assert only.logprobs.tokens == lp.tokens[:-1] and only.finish_reason == "length"
    assert only.logprobs.token_logprobs[0] is None
    for a, b in zip(only.logprobs.token_logprobs[1:], lp.token_logprobs[1:-1], strict=True):
        assert math.isclose(a, b, abs_tol=1e-4)
    assert bare.usage.completion_tokens == 0 and bare.usage.prompt_tokens == len(ids)
    stream = list(
        c.completions.create(model=model, prompt=ids, max_tokens=0, echo=True, stream=True)
    )
    assert "".join(ch.choices[0].text for ch in stream if ch.choices) == only.text
    wait_idle(server)


def test_echo_text_starts_with_prompt_string(server: str) -> None:
    out = complete(server, prompt=PROMPTS[0], max_tokens=1, logprobs=1, echo=True, temperature=0)
    assert out["choices"][0]["text"].startswith(PROMPTS[0])


def _stream_pieces(base: str, body: dict) -> tuple[str, dict]:
    """Text and legacy logprobs of a streamed completion, concatenated over its chunks."""
    text, lps = "", {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    for e in events[:-1]:
        (choice,) = json.loads(e)["choices"]
        text += choice["text"]
        for key in lps:
            lps[key] += choice["logprobs"][key]
    return text, lps


@pytest.mark.parametrize("echo", [False, True], ids=["plain", "echo"])
def test_stream_logprobs_match_non_stream(server: str, echo: bool) -> None:
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "logprobs": 2, "echo": echo}
    full = complete(server, **body)["choices"][0]
    text, lps = _stream_pieces(server, body)
    assert text == full["text"]
    assert lps["tokens"] == full["logprobs"]["tokens"]
    assert lps["top_logprobs"] == full["logprobs"]["top_logprobs"]
    assert lps["token_logprobs"] == full["logprobs"]["token_logprobs"]


def test_stream_text_offset_is_cumulative(server: str) -> None:
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0, "logprobs": 1}
    full = complete(server, **body)["choices"][0]
    _, lps = _stream_pieces(server, body)
    assert lps["text_offset"] == full["logprobs"]["text_offset"]


# --- text offsets index the returned text; logprobs 0 names the sampled token -----------------

# characters split over byte tokens, in the prompt and (sampled at temperature 1) in the output
OFFSET_PROMPTS = ["Tea in 日本 costs ¥5 🙂 today", "Hello"]


@pytest.fixture(scope="module")
def bos_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The bundled model with ``add_bos_token: true``: every text prompt gets a BOS that is not
    in the text the client sent."""
    model = tmp_path_factory.mktemp("bos") / "model"
    shutil.copytree(GQA_MODEL_DIR, model)
    path = model / "tokenizer_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "add_bos_token": True}))
    with running_server("--model", str(model), "--max-model-len", str(MAX_LEN), *FP32) as base:
        yield base


def _by_choice(base: str, body: dict) -> dict[int, tuple[str, dict]]:
    """Each choice's text and legacy logprobs, from one response or gathered over a stream."""
    if not body.get("stream"):
        return {
            ch["index"]: (ch["text"], ch["logprobs"]) for ch in complete(base, **body)["choices"]
        }
    out: dict[int, tuple[str, dict]] = {}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        events = sse_events(r)
    for e in events[:-1]:
        for ch in json.loads(e)["choices"]:
            text, lps = out.get(ch["index"], ("", {k: [] for k in ch["logprobs"]}))
            out[ch["index"]] = (text + ch["text"], {k: lps[k] + ch["logprobs"][k] for k in lps})
    return out


@pytest.mark.parametrize("stream", [False, True], ids=["full", "stream"])
@pytest.mark.parametrize("kind", ["text", "ids"])
def test_echo_text_offsets_index_the_text(bos_server: str, kind: str, stream: bool) -> None:
    """Issue 13: with ``add_bos_token`` the echoed prompt is the text as sent, without the BOS
    its ids start with; the offsets still index the text (the BOS adds nothing), through split
    characters, for several prompts times n, streamed or not, and the same in both."""
    ids = [[BOS, *TOK.encode(p).ids] for p in OFFSET_PROMPTS]
    prompt = OFFSET_PROMPTS if kind == "text" else ids
    body = {
        "prompt": prompt,
        "n": 2,
        "max_tokens": 8,
        "temperature": 1.0,
        "seed": 7,
        "ignore_eos": True,
        "logprobs": 2,
        "echo": True,
        "stream": stream,
    }
    got = _by_choice(bos_server, {**body, "return_tokens_as_token_ids": True})
    assert sorted(got) == [0, 1, 2, 3]
    for index, (text, lp) in got.items():
        p = index // 2
        all_ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
        assert all_ids[: len(ids[p])] == ids[p]
        out_ids = all_ids[len(ids[p]) :]
        if kind == "text":  # the text as sent; its first id, the BOS, is not in it
            prompt_part = [(ids[p][:1], "", False), (ids[p][1:], OFFSET_PROMPTS[p], True)]
        else:
            prompt_part = [(ids[p], TOK.decode(ids[p], skip_special_tokens=False), True)]
        out_text = TOK.decode(out_ids, skip_special_tokens=True)
        assert len(lp["tokens"]) == len(lp["text_offset"])
        check_text_offsets(TOK, text, lp["text_offset"], [*prompt_part, (out_ids, out_text, False)])
    plain = _by_choice(bos_server, body)  # tokens named by text: the same offsets
    assert {i: lp["text_offset"] for i, (_, lp) in plain.items()} == {
        i: lp["text_offset"] for i, (_, lp) in got.items()
    }
    if stream:  # a stream gives what the single response gives: the same text, tokens and
        # offsets; logprobs to fp32 rounding (the two may be batched in steps of other shapes)
        full = _by_choice(bos_server, {**body, "stream": False})
        assert sorted(full) == sorted(plain)
        for i, (text, lp) in full.items():
            ptext, plp = plain[i]
            assert text == ptext and lp["tokens"] == plp["tokens"]
            assert lp["text_offset"] == plp["text_offset"]
            for a, b in zip(lp["token_logprobs"], plp["token_logprobs"], strict=True):
                assert (a is None and b is None) or math.isclose(a, b, abs_tol=1e-4)


@pytest.fixture(scope="module")
def oracle():
    """Log-probabilities of every next token of ``ids`` from one float32 prefill of the model
    in this process: ``log_softmax`` of the logits, the rows past the tokenizer masked."""
    runner = StageRunner.load(GQA_MODEL_DIR, 1, MAX_LEN, "cpu", "float32")

    def logprobs(ids: list[int]) -> torch.Tensor:
        logits = runner.compute(
            StepBatch(ids, [0], [len(ids)], [0], admitted=[NewRequest(0, ids, len(ids), 0)])
        )
        return torch.log_softmax(logits.double()[:, :VOCAB], dim=-1)

    return logprobs


def _ids(tokens: list[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


@pytest.mark.parametrize("echo", [False, True], ids=["plain", "echo"])
def test_logprobs_zero_is_the_sampled_token(fp32_server: str, oracle, echo: bool) -> None:
    """Issue 13: ``logprobs: 0`` gives each token's own logprob and a top entry holding just
    that token (vLLM's answer; OpenAI's "up to logprobs + 1"); ``logprobs: k`` also names the
    sampled token, next to the k most likely ones. Sampled at temperature 1, so the sampled
    token is often not the most likely; every value is the oracle's."""
    for k in (0, 2):
        body = {
            "prompt": PROMPTS[2],
            "max_tokens": 8,
            "temperature": 1.0,
            "seed": 3,
            "ignore_eos": True,
            "logprobs": k,
            "echo": echo,
        }
        (ch,) = complete(fp32_server, **body, return_tokens_as_token_ids=True)["choices"]
        lp = ch["logprobs"]
        ids = _ids(lp["tokens"])
        prompt = ids_of(PROMPTS[2])
        assert ids[: len(prompt) * echo] == prompt[: len(prompt) * echo]
        full = ids if echo else [*prompt, *ids]
        want = oracle(full[:-1])  # row p scores token p + 1
        first = 1 if echo else len(prompt)  # the first prompt token has no logprob
        if echo:
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        rows = list(
            zip(
                ids[first - len(full) :],
                lp["token_logprobs"][first - len(full) :],
                lp["top_logprobs"][first - len(full) :],
                strict=True,
            )
        )
        assert len(rows) == len(full) - first
        for p, (t, value, top) in enumerate(rows, start=first - 1):
            assert value == pytest.approx(float(want[p, t]), abs=1e-4), (p, k)
            assert top[f"token_id:{t}"] == value
            best = want[p].topk(k).indices.tolist()
            assert set(top) == {f"token_id:{i}" for i in {t, *best}}, (p, k)
            for i in best:
                assert top[f"token_id:{i}"] == pytest.approx(float(want[p, i]), abs=1e-4)
        named = complete(fp32_server, **body)["choices"][0]["logprobs"]  # tokens by their text
        assert named["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-4)
        for top, t in zip(
            named["top_logprobs"][first - len(full) :], ids[first - len(full) :], strict=True
        ):
            assert TOK.decode([t], skip_special_tokens=False) in top


@pytest.mark.parametrize("top", [None, 0], ids=["absent", "zero"])
def test_chat_logprobs_without_top(fp32_server: str, oracle, top: int | None) -> None:
    """Chat with ``logprobs: true`` and no (or zero) ``top_logprobs``: each token's own logprob
    (the oracle's) and an empty top list, as OpenAI and vLLM answer."""
    messages = [{"role": "user", "content": "Tell me about gardens."}]
    body = {
        "messages": messages,
        "max_tokens": 6,
        "temperature": 1.0,
        "seed": 5,
        "ignore_eos": True,
        "logprobs": True,
        "return_tokens_as_token_ids": True,
    }
    if top is not None:
        body["top_logprobs"] = top
    content = post(fp32_server, "/v1/chat/completions", body)["choices"][0]["logprobs"]["content"]
    prompt = PromptEncoder.load(GQA_MODEL_DIR).chat(messages)
    ids = _ids([e["token"] for e in content])
    want = oracle([*prompt, *ids][:-1])
    for j, (t, e) in enumerate(zip(ids, content, strict=True)):
        assert e["logprob"] == pytest.approx(float(want[len(prompt) - 1 + j, t]), abs=1e-4)
        assert e["top_logprobs"] == []


def test_stop_string(server: str) -> None:
    c, model = client(server), model_name(server)
    prompt = PROMPTS[2]
    base = c.completions.create(
        model=model, prompt=prompt, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    text = base.choices[0].text
    stop = mid_substring(text)
    expected = text[: text.find(stop)]

    out = c.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].text == expected
    assert out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 24
    check_usage(out.usage)

    stream = c.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=24,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(ch.choices[0].text for ch in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "stop"

    chat_base = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    chat_text = chat_base.choices[0].message.content
    chat_stop = mid_substring(chat_text)
    chat = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=24,
        temperature=0,
        stop=[chat_stop],
        extra_body={"ignore_eos": True},
    )
    assert chat.choices[0].message.content == chat_text[: chat_text.find(chat_stop)]
    assert chat.choices[0].finish_reason == "stop"


def test_seed_reproducibility(server: str) -> None:
    c, model = client(server), model_name(server)

    def sample(seed: int) -> str:
        out = c.completions.create(
            model=model, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=seed
        )
        return out.choices[0].text

    first = [sample(s) for s in range(5)]
    assert [sample(s) for s in range(5)] == first
    assert len(set(first)) > 1, first
    stream = c.completions.create(
        model=model, prompt=PROMPTS[0], max_tokens=12, temperature=1.0, seed=3, stream=True
    )
    assert "".join(ch.choices[0].text for ch in stream) == first[3]


def test_n_choices(server: str) -> None:
    c, model = client(server), model_name(server)
    out = c.completions.create(
        model=model, prompt=PROMPTS[1], max_tokens=6, temperature=1.0, n=3, seed=11, logprobs=0
    )
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    assert out.usage.completion_tokens == sum(len(ch.logprobs.tokens) for ch in out.choices)
    assert out.usage.prompt_tokens == len(ids_of(PROMPTS[1]))  # the prompt counts once
    check_usage(out.usage)

    streamed = list(
        c.completions.create(
            model=model,
            prompt=PROMPTS[1],
            max_tokens=6,
            temperature=1.0,
            n=3,
            seed=11,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *content, last = streamed
    texts = dict.fromkeys(range(3), "")
    for ch in content:
        texts[ch.choices[0].index] += ch.choices[0].text
    assert [texts[i] for i in range(3)] == [ch.text for ch in out.choices]
    assert last.choices == [] and last.usage.model_dump() == out.usage.model_dump()
    assert len(content) <= out.usage.completion_tokens  # chunks without text are held
    assert all(ch.choices[0].text or ch.choices[0].finish_reason for ch in content)

    chat = c.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=5,
        temperature=1.0,
        n=3,
        seed=5,
    )
    assert [ch.index for ch in chat.choices] == [0, 1, 2]
    check_usage(chat.usage)

    # several prompts times n: prompt i owns choices i*n .. i*n+n-1
    multi = c.completions.create(model=model, prompt=PROMPTS[:2], max_tokens=6, temperature=0, n=2)
    assert [ch.index for ch in multi.choices] == [0, 1, 2, 3]
    singles = [greedy(server, p, 6) for p in PROMPTS[:2]]
    assert [ch.text for ch in multi.choices] == [singles[0]] * 2 + [singles[1]] * 2


def test_prompt_token_ids(server: str) -> None:
    c, model = client(server), model_name(server)
    text = PROMPTS[3]
    by_text = c.completions.create(model=model, prompt=text, max_tokens=8, temperature=0)
    by_ids = c.completions.create(model=model, prompt=ids_of(text), max_tokens=8, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage == by_text.usage

    batch = [ids_of(p) for p in PROMPTS[:3]]
    out = c.completions.create(model=model, prompt=batch, max_tokens=8, temperature=0)
    assert [ch.index for ch in out.choices] == [0, 1, 2]
    assert [ch.text for ch in out.choices] == [greedy(server, p, 8) for p in PROMPTS[:3]]
    assert out.usage.prompt_tokens == sum(map(len, batch))
    check_usage(out.usage)

    strings = c.completions.create(model=model, prompt=PROMPTS[:3], max_tokens=8, temperature=0)
    assert [ch.text for ch in strings.choices] == [ch.text for ch in out.choices]


# --- bad input -----------------------------------------------------------------------------------

OK_BODY = {"prompt": "Hello", "max_tokens": 2, "temperature": 0}


def still_serves(base: str) -> None:
    out = complete(base, **OK_BODY)
    assert out["usage"]["completion_tokens"] >= 1


BAD_COMPLETIONS = [
    ("max_tokens_type", {"prompt": "hi", "max_tokens": "x"}, 400, ["max_tokens"]),
    ("max_tokens_negative", {"prompt": "hi", "max_tokens": -1}, 400, ["max_tokens"]),
    ("max_tokens_zero", {"prompt": "hi", "max_tokens": 0}, 400, ["max_tokens"]),
    ("temperature_type", {"prompt": "hi", "temperature": "hot"}, 400, ["temperature"]),
    ("temperature_negative", {"prompt": "hi", "temperature": -0.5}, 400, ["temperature"]),
    ("top_p_zero", {"prompt": "hi", "top_p": 0}, 400, ["top_p"]),
    ("top_p_above_one", {"prompt": "hi", "top_p": 1.5}, 400, ["top_p"]),
    ("n_zero", {"prompt": "hi", "n": 0}, 400, ["n"]),
    ("logprobs_too_many", {"prompt": "hi", "logprobs": 21}, 400, ["logprobs"]),
    ("prompt_missing", {"max_tokens": 2}, 400, ["prompt"]),
    ("prompt_empty_list", {"prompt": [], "max_tokens": 2}, 400, ["prompt", "empty"]),
    ("prompt_empty_ids", {"prompt": [[]], "max_tokens": 2}, 400, ["empty"]),
    ("prompt_wrong_type", {"prompt": 5, "max_tokens": 2}, 400, ["prompt"]),
    ("id_above_vocab", {"prompt": [BOS, 10**6], "max_tokens": 2}, 400, [str(10**6), "vocab"]),
    ("id_negative", {"prompt": [BOS, -1], "max_tokens": 2}, 400, ["-1", "vocab"]),
    ("id_in_batch", {"prompt": [[BOS, 7], [BOS, VOCAB]], "max_tokens": 2}, 400, [str(VOCAB)]),
    (
        "max_tokens_over_context",
        {"prompt": "hi", "max_tokens": 4 * MAX_LEN},
        400,
        ["maximum context length", str(MAX_LEN), str(4 * MAX_LEN)],
    ),
    (
        "prompt_over_context",
        {"prompt": [BOS] + [7] * MAX_LEN, "max_tokens": 1},
        400,
        ["maximum context length", str(MAX_LEN), str(MAX_LEN + 1)],
    ),
    ("unknown_model", {"prompt": "hi", "model": "no-such-model"}, 404, ["no-such-model"]),
    # what the server does not do is refused, never accepted and ignored
    (
        "format_type",
        {"prompt": "hi", "response_format": {"type": "yaml"}},
        400,
        ["response_format", "yaml"],
    ),
    (
        "schema_missing",
        {"prompt": "hi", "response_format": {"type": "json_schema"}},
        400,
        ["json_schema.schema"],
    ),
    (
        "two_grammars",
        {"prompt": "hi", "guided_regex": "a+", "guided_choice": ["x"]},
        400,
        ["one of"],
    ),
    ("bad_regex", {"prompt": "hi", "guided_regex": "(a"}, 400, ["regex"]),
    ("bad_schema", {"prompt": "hi", "guided_json": {"type": "no-such-type"}}, 400, ["json"]),
    (
        "tools",
        {"prompt": "hi", "tools": [{"type": "function", "function": {"name": "f"}}]},
        400,
        ["tools", "not supported"],
    ),
    ("suffix", {"prompt": "hi", "suffix": "end"}, 400, ["suffix"]),
    ("best_of", {"prompt": "hi", "best_of": 3}, 400, ["best_of"]),
    ("bias_key", {"prompt": "hi", "logit_bias": {"abc": 1}}, 400, ["logit_bias", "abc"]),
    ("bias_digit_like", {"prompt": "hi", "logit_bias": {"²": 1}}, 400, ["logit_bias"]),
    (
        "allowed_all_stop",
        {"prompt": "hi", "allowed_token_ids": [1], "min_tokens": 2},
        400,
        ["min_tokens"],
    ),
    ("bias_id", {"prompt": "hi", "logit_bias": {str(VOCAB): 1}}, 400, [str(VOCAB), "vocab"]),
    ("allowed_id", {"prompt": "hi", "allowed_token_ids": [VOCAB + 3]}, 400, [str(VOCAB + 3)]),
    # inputs once quietly ignored: an empty stop string and a stop id that can never be sampled
    ("stop_empty", {"prompt": "hi", "stop": [""]}, 400, ["stop", "empty string"]),
    ("stop_empty_str", {"prompt": "hi", "stop": ["x", ""]}, 400, ["stop", "empty string"]),
    ("stop_id", {"prompt": "hi", "stop_token_ids": [VOCAB]}, 400, ["stop_token_ids", str(VOCAB)]),
    ("stop_id_negative", {"prompt": "hi", "stop_token_ids": [-1]}, 400, ["stop_token_ids"]),
    ("penalty_range", {"prompt": "hi", "presence_penalty": 2.5}, 400, ["presence_penalty"]),
    ("repetition_zero", {"prompt": "hi", "repetition_penalty": 0}, 400, ["repetition_penalty"]),
    (
        "min_over_max",
        {"prompt": "hi", "max_tokens": 2, "min_tokens": 5},
        400,
        ["min_tokens", "max_tokens"],
    ),
]


@pytest.mark.parametrize(
    "body,status,needles", [c[1:] for c in BAD_COMPLETIONS], ids=[c[0] for c in BAD_COMPLETIONS]
)
def test_bad_completion_request(server: str, body: dict, status: int, needles: list[str]) -> None:
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=30)
    assert_error(r, status, *needles)
    still_serves(server)


BAD_CHAT = [
    ("messages_empty", {"messages": []}, 400, ["messages"]),
    ("messages_missing", {"max_tokens": 2}, 400, ["messages"]),
    ("role_unknown", {"messages": [{"role": "robot", "content": "hi"}]}, 400, ["role"]),
    (
        "max_tokens_over_context",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2 * MAX_LEN},
        400,
        ["maximum context length", str(MAX_LEN)],
    ),
    (
        "top_logprobs_too_many",
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 99},
        400,
        ["top_logprobs"],
    ),
    (
        "unknown_model",
        {"messages": [{"role": "user", "content": "hi"}], "model": "gpt-4"},
        404,
        ["gpt-4"],
    ),
    (
        "stop_empty",
        {"messages": [{"role": "user", "content": "hi"}], "stop": ""},
        400,
        ["stop", "empty string"],
    ),
    (
        "stop_id",
        {"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [VOCAB + 1]},
        400,
        ["stop_token_ids", str(VOCAB + 1)],
    ),
    # OpenAI's and vLLM's answers where engramrt once differed
    (
        "top_logprobs_without_logprobs",
        {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2},
        400,
        ["top_logprobs needs logprobs"],
    ),
    (
        "image_part",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                    ],
                }
            ]
        },
        400,
        ["messages[0].content[1]", "image_url", "text only"],
    ),
]


@pytest.mark.parametrize(
    "body,status,needles", [c[1:] for c in BAD_CHAT], ids=[c[0] for c in BAD_CHAT]
)
def test_bad_chat_request(server: str, body: dict, status: int, needles: list[str]) -> None:
    r = httpx.post(f"{server}/v1/chat/completions", json=body, timeout=30)
    assert_error(r, status, *needles)


# Strict types: every number and boolean field of every request model, found from the models
# so that a new field cannot be missed. A string or a boolean where a number is expected, a number
# where a boolean is, and a fraction where an integer is are each a 400 naming the field; an int is
# a float, and an integer-valued float (clients send ``8.0``) an int.
BAD_VALUES = {int: ["8", True, 8.5], float: ["1", True], bool: ["true", 1, 1.0]}
GOOD_VALUES = {int: [1, 1.0], float: [1, 0.5], bool: [True, False]}
STRINGS_TOO = {"prompt"}  # a list of strings is a prompt as well as a list of ids
HI = [{"role": "user", "content": "hi"}]
TYPED_MODELS = [
    ("/v1/completions", CompletionRequest, {"prompt": "hi", "max_tokens": 2}),
    ("/v1/chat/completions", ChatCompletionRequest, {"messages": HI, "max_tokens": 2}),
    ("/tokenize", TokenizeRequest, {"prompt": "hi"}),
    ("/detokenize", DetokenizeRequest, {"tokens": [1]}),
]


def number_slots(ann, path: str) -> list[tuple[str, type, Callable[[Any], Any]]]:
    """Where a JSON value of type ``ann`` holds a number or a boolean: (the path an error names,
    the scalar type, how to build the field's value around one scalar)."""
    origin, args = get_origin(ann), get_args(ann)
    if origin is Annotated:
        return number_slots(args[0], path)
    if ann in (int, float, bool):
        return [(path, ann, lambda v: v)]
    if origin in (Union, UnionType):  # the first member that holds numbers (one is enough)
        return next((s for a in args if (s := number_slots(a, path))), [])
    if origin is list:
        return [(p, t, lambda v, w=w: [w(v)]) for p, t, w in number_slots(args[0], path)]
    if origin is dict:
        return [(p, t, lambda v, w=w: {"1": w(v)}) for p, t, w in number_slots(args[1], path)]
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return [
            (p, t, lambda v, n=name, w=w: {n: w(v)})
            for name, f in ann.model_fields.items()
            for p, t, w in number_slots(f.annotation, f"{path}.{name}")
        ]
    return []


TYPED_FIELDS = [
    (route, base, name, path, kind, wrap)
    for route, model, base in TYPED_MODELS
    for name, f in model.model_fields.items()
    for path, kind, wrap in number_slots(f.annotation, name)
]


def test_every_typed_field_is_found() -> None:
    """The generator sees the fields it must (a guard against it quietly finding none)."""
    found = {(route, path) for route, _, _, path, _, _ in TYPED_FIELDS}
    for route, path in [
        ("/v1/completions", "max_tokens"),
        ("/v1/completions", "temperature"),
        ("/v1/completions", "echo"),
        ("/v1/completions", "prompt"),
        ("/v1/completions", "logit_bias"),
        ("/v1/chat/completions", "stream_options.include_usage"),
        ("/v1/chat/completions", "logprobs"),
        ("/v1/chat/completions", "top_logprobs"),
        ("/detokenize", "tokens"),
    ]:
        assert (route, path) in found, (route, path)


@pytest.mark.parametrize(
    "route,base,name,path,kind,wrap",
    TYPED_FIELDS,
    ids=[f"{r.strip('/').replace('/', '_')}-{p}-{k.__name__}" for r, _, _, p, k, _ in TYPED_FIELDS],
)
def test_request_types_are_strict(
    server: str, route: str, base: dict, name: str, path: str, kind: type, wrap: Callable
) -> None:
    extra = {"logprobs": True} if (route, name) == ("/v1/chat/completions", "top_logprobs") else {}
    for value in BAD_VALUES[kind]:
        if isinstance(value, str) and name in STRINGS_TOO:
            continue
        body = {**base, **extra, name: wrap(value)}
        err = assert_error(httpx.post(f"{server}{route}", json=body, timeout=30), 400, path)
        assert err["param"].startswith(name), err
    for value in GOOD_VALUES[kind]:
        body = {**base, **extra, name: wrap(value)}
        r = httpx.post(f"{server}{route}", json=body, timeout=60)
        assert r.status_code == 200, (body, r.text)


def test_errors_name_their_field_without_pydantics_prefix(server: str) -> None:
    for path, body, param in [
        ("/v1/completions", {"prompt": "hi", "suffix": "x"}, "suffix"),
        ("/v1/completions", {"prompt": "hi", "logit_bias": {"abc": 1}}, "logit_bias"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 1},
            "top_logprobs",
        ),
        (
            "/tokenize",
            {"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
            "messages[0].content[0]",
        ),
    ]:
        err = assert_error(httpx.post(f"{server}{path}", json=body, timeout=30), 400)
        assert err["param"] == param, err
        assert not err["message"].startswith("Value error"), err


def test_tools_with_tool_choice_none_are_accepted_and_ignored(server: str) -> None:
    chat = {
        "messages": [{"role": "user", "content": "What is the capital of Bribrinu?"}],
        "max_tokens": 8,
        "temperature": 0,
    }
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    plain = httpx.post(f"{server}/v1/chat/completions", json=chat, timeout=60).json()
    r = httpx.post(
        f"{server}/v1/chat/completions",
        timeout=60,
        json={**chat, "tools": tools, "tool_choice": "none"},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"] == plain["choices"][0]["message"]


def test_developer_messages_speak_as_the_system(server: str) -> None:
    """OpenAI's ``developer`` role reaches the chat template as ``system``, never dropped."""

    def ids(role: str) -> list[int]:
        body = {
            "messages": [
                {"role": role, "content": "Answer in one word."},
                {"role": "user", "content": "hi"},
            ]
        }
        return httpx.post(f"{server}/tokenize", json=body, timeout=30).json()["tokens"]

    assert ids("developer") == ids("system") != ids("user")
    still_serves(server)


def test_malformed_json_param_is_null(server: str) -> None:
    r = httpx.post(
        f"{server}/v1/completions",
        content=b'{"prompt": "hi", "max_tokens": ',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert assert_error(r, 400, "json")["param"] is None


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_malformed_json(server: str, path: str) -> None:
    r = httpx.post(
        f"{server}{path}",
        content=b'{"prompt": "hi", "max_tokens": ',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert_error(r, 400, "json")
    still_serves(server)


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
        ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 2}'),
        ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x\\ud800"}]}'),
    ],
)
def test_lone_surrogate_is_a_400(server: str, path: str, raw: bytes) -> None:
    """JSON can spell a lone UTF-16 surrogate, which no tokenizer takes: a 400 naming the
    field, and the connection and server keep serving."""
    with httpx.Client(timeout=30) as c:
        r = c.post(f"{server}{path}", content=raw, headers={"content-type": "application/json"})
        assert_error(r, 400, "surrogate")
        assert c.get(f"{server}/health").status_code == 200  # same keep-alive connection
    still_serves(server)


def test_non_api_errors_have_the_openai_shape(server: str) -> None:
    """A body that is not UTF-8, an unknown route and a wrong method answer in OpenAI's error
    shape with their own status."""
    r = httpx.post(
        f"{server}/v1/completions",
        content=b'{"prompt": "\xff\xfe"}',
        headers={"content-type": "application/json"},
        timeout=30,
    )
    assert_error(r, 400)
    assert_error(httpx.get(f"{server}/v1/nothing-here", timeout=30), 404)
    for path in ("/v1/embeddings", "/v1/responses", "/v1/audio/speech"):
        r = httpx.post(f"{server}{path}", json={"input": "hi", "model": "x"}, timeout=30)
        assert_error(r, 404, path, "not supported", "/v1/chat/completions")
    assert_error(httpx.get(f"{server}/v1/completions", timeout=30), 405)
    still_serves(server)


def test_start_line_access_log_and_request_log() -> None:
    """The start line names device and dtype and comes once the port is bound; each request
    gets an access-log line unless --disable-uvicorn-access-log, and a request-log line with its
    response id and prompt size under --enable-log-requests (vLLM's older
    --disable-log-requests is accepted and logs none, the default); a port that cannot be bound
    ends the server with an error and no start line."""
    import socket

    from tests.support.server_fixture import REPO

    body = {"prompt": [5, 6, 7, 8], "max_tokens": 3, "n": 2}
    for flags, access, requests in (  # each log on in one run and off in the other
        (("--enable-log-requests", "--disable-uvicorn-access-log"), False, True),
        (("--disable-log-requests",), True, False),  # the default's logs
    ):
        base, proc = start_server(*flags, "--max-model-len", "256")
        try:
            assert httpx.get(f"{base}/v1/models", timeout=30).status_code == 200
            rid = post(base, "/v1/completions", body)["id"]
            time.sleep(0.3)
            log = Path(proc.log_path).read_text()
            start = [line for line in log.splitlines() if "engramrt: serving" in line]
            assert len(start) == 1 and f"at {base}/v1" in start[0], log
            assert "| cpu, torch." in start[0], start[0]
            assert ('"GET /v1/models HTTP/1.1" 200' in log) == access, log
            assert (f"request {rid}: 2 choice(s), 4 prompt tokens, max_tokens 3" in log) is requests
            assert ("engramrt: request " in log) is requests
        finally:
            stop_server(proc)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        run = subprocess.run(
            [sys.executable, "-m", "engramrt", "serve", "--port", str(port), "--device", "cpu"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert run.returncode != 0 and "engramrt: serving" not in run.stdout + run.stderr


def test_port_0_start_line_names_the_bound_port(tmp_path: Path) -> None:
    """--port 0 lets the system choose: the start line names the port it chose, where the
    server answers (it said ``:0``)."""
    from tests.support.server_fixture import REPO

    log = tmp_path / "serve.log"
    cmd = [sys.executable, "-m", "engramrt", "serve", str(GQA_MODEL_DIR), "--device", "cpu"]
    with log.open("w") as out:
        proc = subprocess.Popen(
            [*cmd, "--port", "0", "--max-model-len", "256"],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 90
        while not (found := re.search(r"engramrt: serving .* at (http://\S+)/v1", log.read_text())):
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        base = found.group(1)
        assert not base.endswith(":0"), base
        assert httpx.get(f"{base}/health", timeout=30).status_code == 200
    finally:
        stop_server(proc)


def test_request_body_limit() -> None:
    """A body over --max-request-bytes is a 413 in OpenAI's shape, whether its length is
    declared or it arrives chunked; smaller bodies are served, and the server goes on."""
    with running_server("--max-request-bytes", "2000") as base:
        assert complete(base, prompt="x" * 500, max_tokens=1)["choices"]
        big = {"prompt": "x" * 3000, "max_tokens": 1}
        assert_error(httpx.post(f"{base}/v1/completions", json=big, timeout=30), 413, "2000")

        def chunks():
            raw = json.dumps(big).encode()
            yield from (raw[i : i + 500] for i in range(0, len(raw), 500))

        r = httpx.post(
            f"{base}/v1/completions",
            content=chunks(),
            timeout=30,
            headers={"content-type": "application/json"},
        )
        assert "content-length" not in r.request.headers  # sent chunked
        assert_error(r, 413, "2000")
        still_serves(base)


def test_long_prompt_does_not_stall_the_server(server: str) -> None:
    """Prompts that take seconds to tokenise (then fail: each is over the context) do not
    hold up /health, which answers while they are still being tokenised. Each is short enough
    for the length bound to let it through to the tokenizer (one long prompt is refused by its
    length alone: test_a_prompt_too_long_by_its_length_alone_...)."""
    k = PromptEncoder.load(GQA_MODEL_DIR).max_token_bytes
    line = "The quick brown fox jumps over the lazy dog. "
    one = line * (k * MAX_LEN // len(line))  # just under the bound
    huge = [one] * 100  # ~2.9 MB, ~1 s or more

    async def main() -> tuple[float, float]:
        async with httpx.AsyncClient(base_url=server, timeout=120) as ac:
            done = {}

            async def big() -> None:
                r = await ac.post("/v1/completions", json={"prompt": huge, "max_tokens": 1})
                assert r.status_code == 400
                done["big"] = time.monotonic()

            async def health() -> None:
                await asyncio.sleep(0.3)  # the big body is in, its tokenising under way
                assert (await ac.get("/health")).status_code == 200
                done["health"] = time.monotonic()

            await asyncio.gather(big(), health())
            return done["health"], done["big"]

    health_at, big_at = asyncio.run(main())
    assert health_at < big_at


def test_return_tokens_as_token_ids(server: str) -> None:
    """vLLM's ``return_tokens_as_token_ids``: logprobs name tokens ``token_id:N`` (no two
    top-logprobs entries can collide), each N the token that the plain request names by its
    text, with the same logprobs and text offsets."""
    body = {"prompt": PROMPTS[1], "max_tokens": 6, "temperature": 0, "logprobs": 5, "echo": True}
    plain = post(server, "/v1/completions", body)["choices"][0]["logprobs"]
    named = post(server, "/v1/completions", {**body, "return_tokens_as_token_ids": True})
    lp = named["choices"][0]["logprobs"]
    ids = [int(t.removeprefix("token_id:")) for t in lp["tokens"]]
    assert all(t.startswith("token_id:") for t in lp["tokens"])
    assert [TOK.decode([i], skip_special_tokens=False) for i in ids] == plain["tokens"]
    assert lp["token_logprobs"] == plain["token_logprobs"]
    assert lp["text_offset"] == plain["text_offset"]
    for t, mine, theirs in zip(
        ids[1:], lp["top_logprobs"][1:], plain["top_logprobs"][1:], strict=True
    ):
        assert all(k.startswith("token_id:") for k in mine)
        assert f"token_id:{t}" in mine and len(mine) in (5, 6)  # the token, then the top 5
        texts = {TOK.decode([int(k[9:])], skip_special_tokens=False): v for k, v in mine.items()}
        assert texts.keys() == theirs.keys()  # fewer keys in the plain one when texts collide
    chat = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
    }
    a = post(server, "/v1/chat/completions", chat)["choices"][0]["logprobs"]["content"]
    b = post(server, "/v1/chat/completions", {**chat, "return_tokens_as_token_ids": True})
    b = b["choices"][0]["logprobs"]["content"]
    for x, y in zip(a, b, strict=True):
        assert TOK.decode([int(y["token"][9:])], skip_special_tokens=False) == x["token"]
        assert y["bytes"] == x["bytes"] and y["logprob"] == x["logprob"]


def test_bad_stream_request_is_plain_error(server: str) -> None:
    """A request that fails validation is an HTTP error even when it asked for a stream."""
    r = httpx.post(
        f"{server}/v1/completions",
        json={"prompt": "hi", "max_tokens": 4 * MAX_LEN, "stream": True},
        timeout=30,
    )
    assert_error(r, 400, "maximum context length")
    with pytest.raises(openai.BadRequestError):
        client(server).completions.create(
            model=model_name(server), prompt=[BOS, VOCAB + 5], max_tokens=2, stream=True
        )
    still_serves(server)


def test_empty_string_prompt(server: str) -> None:
    """An empty string is no prompt when the tokenizer config adds no BOS: a 400, as an empty
    list of ids is."""
    assert not ids_of("")
    assert_error(
        httpx.post(f"{server}/v1/completions", json={"prompt": ""}, timeout=30), 400, "empty"
    )
    still_serves(server)


def test_logit_controls_are_applied(server: str) -> None:
    """Controls change what is generated as they say: a +100 bias forces its token, -100 bans
    the greedy choice, allowed ids confine the output, min_tokens holds back a favoured stop
    token, and a strong repetition penalty keeps greedy output from repeating."""
    base = complete(server, prompt=PROMPTS[0], max_tokens=8, temperature=0)
    first = TOK.encode(base["choices"][0]["text"]).ids[0]
    forced = 500 if first != 500 else 501
    r = complete(
        server,
        prompt=PROMPTS[0],
        max_tokens=6,
        temperature=0,
        logit_bias={str(forced): 100},
        return_tokens_as_token_ids=True,
        logprobs=0,
    )
    ids = [int(t.split(":")[1]) for t in r["choices"][0]["logprobs"]["tokens"]]
    assert ids == [forced] * 6
    r = complete(
        server,
        prompt=PROMPTS[0],
        max_tokens=1,
        temperature=0,
        logit_bias={str(first): -100},
        logprobs=0,
        return_tokens_as_token_ids=True,
    )
    assert int(r["choices"][0]["logprobs"]["tokens"][0].split(":")[1]) != first
    allowed = [40, 41, 300, 301, 302]
    r = complete(
        server,
        prompt=PROMPTS[1],
        max_tokens=12,
        temperature=1.0,
        seed=3,
        allowed_token_ids=allowed,
        logprobs=0,
        return_tokens_as_token_ids=True,
    )
    ids = [int(t.split(":")[1]) for t in r["choices"][0]["logprobs"]["tokens"]]
    assert ids and set(ids) <= set(allowed)
    stop = 77
    r = complete(
        server,
        prompt=PROMPTS[1],
        max_tokens=20,
        temperature=0,
        min_tokens=5,
        logit_bias={str(stop): 100},
        stop_token_ids=[stop],
        logprobs=0,
        return_tokens_as_token_ids=True,
    )
    ids = [int(t.split(":")[1]) for t in r["choices"][0]["logprobs"]["tokens"]]
    assert len(ids) == 5 + (r["choices"][0]["finish_reason"] == "stop")
    assert stop not in ids[:5]
    r = complete(
        server,
        prompt=PROMPTS[2],
        max_tokens=24,
        temperature=0,
        repetition_penalty=2.0,
        presence_penalty=2.0,
        logprobs=0,
        return_tokens_as_token_ids=True,
    )
    ids = [int(t.split(":")[1]) for t in r["choices"][0]["logprobs"]["tokens"]]
    plain = complete(
        server,
        prompt=PROMPTS[2],
        max_tokens=24,
        temperature=0,
        logprobs=0,
        return_tokens_as_token_ids=True,
    )
    plain_ids = [int(t.split(":")[1]) for t in plain["choices"][0]["logprobs"]["tokens"]]
    assert ids != plain_ids  # the penalties change the greedy path, and repeat no more
    assert len(ids) - len(set(ids)) <= len(plain_ids) - len(set(plain_ids))


@pytest.mark.parametrize("path", ["completions", "chat/completions"])
def test_stream_holds_chunks_without_text(server: str, path: str) -> None:
    """Tokens that end inside a character (byte tokens 0xC3 and 0xA9 make "é") send no empty
    chunk: their text and logprobs go out with the token that completes the character, and the
    stream still adds up to the plain response, token for token."""
    chat = path.startswith("chat")
    body = {
        "max_tokens": 14,
        "temperature": 1.0,
        "seed": 11,
        "allowed_token_ids": [133, 108],
        "logprobs": True if chat else 0,
        "return_tokens_as_token_ids": True,
    }
    body |= {"messages": [{"role": "user", "content": "hi"}]} if chat else {"prompt": "hi"}
    full = post(server, f"/v1/{path}", body)["choices"][0]
    r = httpx.post(f"{server}/v1/{path}", json=body | {"stream": True}, timeout=60)
    chunks = [json.loads(e) for e in sse_events(r) if e != "[DONE]"]
    if chat:
        chunks = chunks[1:]  # the role
        texts = [ch["choices"][0]["delta"].get("content", "") for ch in chunks]
        tokens = [t["token"] for ch in chunks for t in ch["choices"][0]["logprobs"]["content"]]
        want_text = full["message"]["content"]
        want = [t["token"] for t in full["logprobs"]["content"]]
    else:
        texts = [ch["choices"][0]["text"] for ch in chunks]
        tokens = [t for ch in chunks for t in ch["choices"][0]["logprobs"]["tokens"]]
        want_text, want = full["text"], full["logprobs"]["tokens"]
    finish = [ch["choices"][0]["finish_reason"] for ch in chunks]
    assert all(t or f for t, f in zip(texts, finish, strict=True))
    assert "".join(texts) == want_text and tokens == want
    assert len(chunks) < len(want)  # some were held: the test covers the hold


STRUCTURED = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["name", "tags", "n"],
    "additionalProperties": False,
}


def _valid(obj) -> bool:
    """``STRUCTURED``, checked by hand."""
    return (
        isinstance(obj, dict)
        and set(obj) == {"name", "tags", "n"}
        and isinstance(obj["name"], str)
        and len(obj["name"]) <= 12
        and isinstance(obj["tags"], list)
        and len(obj["tags"]) <= 3
        and set(obj["tags"]) <= {"a", "b"}
        and isinstance(obj["n"], int)
        and 0 <= obj["n"] <= 99
    )


def _json_object_prefix(text: str) -> bool:
    """``text`` can still become a JSON object: a matcher of llguidance's own, apart from the
    server's, accepts all of its tokens."""
    import llguidance
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(GQA_MODEL_DIR / "tokenizer.json"))
    lt = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=None)
    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
    ids = tok.encode(text, add_special_tokens=False).ids
    return llguidance.LLMatcher(lt, grammar).validate_tokens(ids) == len(ids)


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_structured_outputs_parse_whatever_the_model_writes(server: str, seed: int) -> None:
    """Guided output parses and validates whatever the small model would write: a JSON schema
    (chat response_format, streamed too), any JSON object (or, cut by max_tokens, a prefix of
    one), a regex and a choice."""
    c, model = client(server), model_name(server)
    msgs = [{"role": "user", "content": "Describe a person."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": STRUCTURED}}
    r = c.chat.completions.create(
        model=model, messages=msgs, max_tokens=200, seed=seed, temperature=1.0, response_format=fmt
    )
    assert r.choices[0].finish_reason == "stop" and _valid(json.loads(r.choices[0].message.content))
    chunks = c.chat.completions.create(
        model=model,
        messages=msgs,
        max_tokens=200,
        seed=seed,
        temperature=1.0,
        response_format=fmt,
        stream=True,
    )
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert streamed == r.choices[0].message.content
    r = complete(
        server,
        prompt="{",
        max_tokens=150,
        seed=seed,
        temperature=1.0,
        response_format={"type": "json_object"},
    )
    text = r["choices"][0]["text"]
    if r["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # a model may write a string longer than max_tokens: the text must still be a prefix
        assert _json_object_prefix(text)
    r = complete(
        server,
        prompt="Code:",
        max_tokens=30,
        seed=seed,
        temperature=1.0,
        guided_regex="[A-F]{3}-[0-9]{2}",
    )
    assert re.fullmatch("[A-F]{3}-[0-9]{2}", r["choices"][0]["text"])
    r = complete(
        server,
        prompt="Pick:",
        max_tokens=30,
        seed=seed,
        temperature=1.0,
        structured_outputs={"choice": ["red", "green", "blue"]},
    )
    assert r["choices"][0]["text"] in {"red", "green", "blue"}


def _one_line(message: str) -> None:
    """A grammar error as the client sees it: one line, none of llguidance's parser state."""
    assert "\n" not in message and "<state>" not in message and "<grammar>" not in message, message


def test_a_grammar_the_engine_cannot_follow_is_an_error_the_client_sees(server: str) -> None:
    """Refused up front where llguidance can tell; failing mid-way (a bias steers the model onto
    the branch that breaks a limit) a 400 unstreamed and an error event with the same status
    in a stream, never a 200 with finish_reason 'stop'. Each message is one line naming what
    failed (llguidance's state dump goes to the server's log)."""
    r = httpx.post(
        f"{server}/v1/completions",
        timeout=60,
        json={"prompt": "hi", "guided_regex": "a{1000}{1000}"},
    )
    _one_line(assert_error(r, 400, "cannot be followed", "too many expressions")["message"])
    r = httpx.post(
        f"{server}/v1/completions", timeout=60, json={"prompt": "hi", "guided_regex": "(("}
    )
    _one_line(assert_error(r, 400, "invalid regex grammar", "unclosed group")["message"])
    a = load_tokenizer(GQA_MODEL_DIR).token_to_id("a")
    body = {
        "prompt": "hi",
        "max_tokens": 20,
        "temperature": 0,
        "logit_bias": {str(a): 100},
        "guided_regex": "b|a{1000}{1000}",
    }
    r = httpx.post(f"{server}/v1/completions", json=body, timeout=60)
    _one_line(assert_error(r, 400, "cannot be followed")["message"])
    with httpx.stream(
        "POST", f"{server}/v1/completions", json={**body, "stream": True}, timeout=60
    ) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 400 and "cannot be followed" in err["message"], err
    _one_line(err["message"])
    assert not any('"finish_reason": "stop"' in e or '"finish_reason":"stop"' in e for e in events)
    still_serves(server)


def test_a_prompt_too_long_by_its_length_alone_is_refused_before_tokenisation(server) -> None:
    """The bound's own message (characters, not tokens): the text was never tokenised."""
    k = PromptEncoder.load(GQA_MODEL_DIR).max_token_bytes
    text = "x" * (k * MAX_LEN + 1)
    for path, body in [
        ("/v1/completions", {"prompt": text}),
        ("/tokenize", {"prompt": text}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": text}]}),
    ]:
        r = httpx.post(f"{server}{path}", json=body, timeout=60)
        assert_error(r, 400, "characters", str(MAX_LEN))
    still_serves(server)


def test_unknown_fields_are_ignored(server: str) -> None:
    base = complete(server, **OK_BODY)
    extra = complete(server, **OK_BODY, frequency_penalty_v9=3, some_vendor_flag={"a": 1})
    assert extra["choices"][0]["text"] == base["choices"][0]["text"]


def test_errors_leave_server_idle(server: str) -> None:
    wait_idle(server)


# --- API key -------------------------------------------------------------------------------------


def test_api_key(keyed_server: str) -> None:
    base = keyed_server
    good = {"Authorization": f"Bearer {API_KEY}"}
    same_length = "Bearer " + API_KEY[:-1] + ("x" if API_KEY[-1] != "x" else "y")
    for headers in (
        None,
        {"Authorization": "Bearer wrong"},
        {"Authorization": API_KEY},
        {"Authorization": same_length},
        {"Authorization": "Bearer é".encode()},
    ):
        for path in ("/tokenizer_info",):
            assert_error(httpx.get(f"{base}{path}", headers=headers), 401)
        r = httpx.post(f"{base}/tokenize", json={"prompt": "hi"}, headers=headers, timeout=30)
        assert_error(r, 401)
        assert_error(httpx.get(f"{base}/v1/models", headers=headers), 401)
        r = httpx.post(f"{base}/v1/completions", json=OK_BODY, headers=headers, timeout=30)
        assert_error(r, 401)
        r = httpx.post(
            f"{base}/v1/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers=headers,
            timeout=30,
        )
        assert_error(r, 401)
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/metrics").status_code == 200
    assert httpx.get(f"{base}/v1/models", headers=good).status_code == 200
    # an unknown /v1 path asks for the key before it says the path does not exist
    assert_error(httpx.post(f"{base}/v1/embeddings", json={}), 401)
    assert_error(httpx.post(f"{base}/v1/embeddings", json={}, headers=good), 404)

    model = model_name(base, good)
    out = client(base, API_KEY).completions.create(model=model, prompt="Hello", max_tokens=3)
    check_usage(out.usage)
    with pytest.raises(openai.AuthenticationError):
        client(base, "EMPTY").completions.create(model=model, prompt="Hello", max_tokens=3)
    with pytest.raises(openai.AuthenticationError):
        client(base, "EMPTY").models.list()


# --- load and disconnects ------------------------------------------------------------------------


async def _stream_completion(ac: httpx.AsyncClient, body: dict) -> list[str]:
    async with ac.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line[6:] async for line in r.aiter_lines() if line.startswith("data: ")]


def test_concurrent_streams(server: str) -> None:
    num, max_tokens = 128, 8

    async def main() -> list[list[str]]:
        limits = httpx.Limits(max_connections=num + 8, max_keepalive_connections=num + 8)
        async with httpx.AsyncClient(base_url=server, timeout=180, limits=limits) as ac:
            bodies = [
                {
                    "prompt": f"{PROMPTS[i % len(PROMPTS)]} {i}",
                    "max_tokens": max_tokens,
                    "temperature": 0 if i % 2 else 1.0,
                    "seed": i,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                for i in range(num)
            ]
            return await asyncio.gather(*(_stream_completion(ac, b) for b in bodies))

    before = metrics(server)
    results = asyncio.run(main())
    assert len(results) == num
    for events in results:
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        *content, usage_chunk = chunks
        assert len(content) <= max_tokens  # chunks without text are held
        assert all(len(ch["choices"]) == 1 for ch in content)
        assert [ch["choices"][0]["finish_reason"] for ch in content] == [None] * (
            len(content) - 1
        ) + ["length"]
        assert usage_chunk["choices"] == []
        assert usage_chunk["usage"]["completion_tokens"] == max_tokens
        assert len({ch["id"] for ch in chunks}) == 1
    after = wait_idle(server)
    generated = metric(after, "engramrt:generation_tokens_total")
    assert generated - metric(before, "engramrt:generation_tokens_total") == num * max_tokens


def test_stream_disconnect_aborts(server: str) -> None:
    num, max_tokens = 4, MAX_LEN - 64
    before = metrics(server)

    async def main() -> None:
        async with httpx.AsyncClient(base_url=server, timeout=60) as ac:

            async def one(i: int) -> int:
                body = {
                    "prompt": f"{PROMPTS[i]}",
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                    "stream": True,
                }
                seen = 0
                async with ac.stream("POST", "/v1/completions", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: ")
                        if seen == 2:
                            break  # leaving the block closes the connection
                return seen

            assert await asyncio.gather(*(one(i) for i in range(num))) == [2] * num

    asyncio.run(main())
    after = wait_idle(server, timeout=5.0)
    generated = metric(after, "engramrt:generation_tokens_total")
    assert generated - metric(before, "engramrt:generation_tokens_total") < num * max_tokens

    def aborted(m: dict[str, float]) -> float:
        name = "engramrt:request_success_total{"
        return sum(v for k, v in m.items() if k.startswith(name) and 'reason="abort"' in k)

    assert aborted(after) - aborted(before) == num  # counted as vLLM counts them


def test_non_stream_disconnect_aborts() -> None:
    # its own server: if the request is not aborted it keeps the engine busy for seconds
    max_tokens = MAX_LEN - 64
    with running_server("--max-model-len", str(MAX_LEN), stop_timeout=2.0) as base:
        before = metrics(base)
        body = {"prompt": PROMPTS[0], "max_tokens": max_tokens, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/completions", json=body, timeout=0.5)
        after = wait_idle(base, timeout=3.0)
        generated = metric(after, "engramrt:generation_tokens_total")
        assert generated - metric(before, "engramrt:generation_tokens_total") < max_tokens


# --- pipeline parallelism ------------------------------------------------------------------------


def test_pp2_matches_pp1(server: str) -> None:
    expected = [greedy(server, p, 12) for p in PROMPTS]
    flags = ("--pipeline-parallel-size", "2", "--pp-layer-partition", "1,3")
    with running_server(*flags, "--max-model-len", str(MAX_LEN)) as pp:
        assert [greedy(pp, p, 12) for p in PROMPTS] == expected
        both = complete(pp, prompt=PROMPTS, max_tokens=12, temperature=0)
        assert [ch["text"] for ch in both["choices"]] == expected
        wait_idle(pp)


def test_tp2_matches_tp1_and_frees_its_blocks(fp32_server: str) -> None:
    """Two TP ranks (gloo, fp32): the greedy texts of one process, one at a time and batched;
    a request whose client gives up is aborted, and afterwards no KV block is held."""
    expected = [greedy(fp32_server, p, 12) for p in PROMPTS]
    with running_server("-tp", "2", "--max-model-len", str(MAX_LEN), *FP32) as tp:
        assert [greedy(tp, p, 12) for p in PROMPTS] == expected
        both = complete(tp, prompt=PROMPTS, max_tokens=12, temperature=0)
        assert [ch["text"] for ch in both["choices"]] == expected
        body = {"prompt": PROMPTS[0], "max_tokens": MAX_LEN // 2, "ignore_eos": True}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{tp}/v1/completions", json=body, timeout=0.5)
        wait_idle(tp, timeout=10)


# --- batch invariance ----------------------------------------------------------------------------

# 16 prompts of 4 .. ~45 tokens (at most 14 blocks of 4 with the 12 generated tokens)
WORDS = "the river runs past mountains and gardens while engram tables hash every n-gram".split()
INVARIANCE_PROMPTS = [" ".join((WORDS * 3)[i % 5 : i % 5 + 1 + (5 * i) % 19]) for i in range(16)]


def _concurrent_greedy(base: str, prompts: list[str], max_tokens: int) -> list[str]:
    async def main() -> list[str]:
        async with httpx.AsyncClient(base_url=base, timeout=180) as ac:

            async def one(p: str) -> str:
                body = {"prompt": p, "max_tokens": max_tokens, "temperature": 0}
                r = await ac.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return r.json()["choices"][0]["text"]

            return await asyncio.gather(*(one(p) for p in prompts))

    return asyncio.run(main())


# Batch invariance is a float32 property: in bfloat16 a batch of another shape may round a
# near-tie the other way (seen with these prompts), which is not a bug.
FP32 = ("--dtype", "float32")
fp32_server = server_fixture("--max-model-len", str(MAX_LEN), *FP32)


@pytest.fixture(scope="module")
def invariance_reference(fp32_server: str) -> list[str]:
    """A float32 server's greedy texts, one request at a time."""
    return [greedy(fp32_server, p, 12) for p in INVARIANCE_PROMPTS]


def test_prompt_lengths_vary() -> None:
    lengths = sorted(len(ids_of(p)) for p in INVARIANCE_PROMPTS)
    assert lengths[0] <= 4 and 40 <= lengths[-1] <= 48 and len(set(lengths)) >= 12


def test_batch_invariance_default(fp32_server: str, invariance_reference: list[str]) -> None:
    assert _concurrent_greedy(fp32_server, INVARIANCE_PROMPTS, 12) == invariance_reference
    wait_idle(fp32_server)


def test_batch_invariance_chunked_prefill(invariance_reference: list[str]) -> None:
    with running_server("--max-num-batched-tokens", "8", *FP32) as base:
        assert _concurrent_greedy(base, INVARIANCE_PROMPTS, 12) == invariance_reference
        assert [greedy(base, p, 12) for p in INVARIANCE_PROMPTS[::3]] == (invariance_reference[::3])
        wait_idle(base)


def test_batch_invariance_preemption(invariance_reference: list[str]) -> None:
    flags = ("--num-gpu-blocks-override", "24", "--block-size", "4", "--max-num-seqs", "8", *FP32)
    with running_server(*flags) as base:
        assert _concurrent_greedy(base, INVARIANCE_PROMPTS, 12) == invariance_reference
        m = wait_idle(base)
        assert metric(m, "engramrt:num_preemptions_total") > 0
        assert [greedy(base, p, 12) for p in INVARIANCE_PROMPTS[::5]] == (invariance_reference[::5])


def test_prompt_scores_do_not_depend_on_what_follows(fp32_server: str) -> None:
    """In float32 a prompt token's echo logprob is the same whether the prompt ends there or
    goes on (the score of position p reads positions <= p only)."""
    c, model = client(fp32_server), model_name(fp32_server)
    ids = ids_of(PROMPTS[2])

    def scores(prompt: list[int]) -> list[float | None]:
        out = c.completions.create(
            model=model, prompt=prompt, max_tokens=1, logprobs=1, echo=True, temperature=0
        )
        return out.choices[0].logprobs.token_logprobs

    whole, half = scores(ids), len(ids) // 2
    head = scores(ids[:half])
    assert head[0] is None and whole[0] is None
    for a, b in zip(head[1:half], whole[1:half], strict=True):
        assert math.isclose(a, b, abs_tol=1e-4)
