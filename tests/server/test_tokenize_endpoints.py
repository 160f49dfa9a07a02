"""vLLM's tokenizer endpoints over HTTP: /tokenize, /detokenize, /tokenizer_info.

The server runs the bundled model with a tokenizer config that adds BOS (spelled as an added
token, as many hub configs spell it) and a chat template that writes none, so
``add_special_tokens`` shows for text and for messages. The oracle is the
``tokenizers`` library on the same tokenizer.json, jinja2 on the config's chat template and the
prompt rule restated here; the completion routes check that /tokenize gives the ids they run."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import jinja2
import pytest
from tokenizers import Tokenizer

from engramrt.bundled import GQA_MODEL_DIR
from tests.support.server_fixture import running_server

pytestmark = pytest.mark.slow  # a server process

KEY = "sk-tokenize-test"
AUTH = {"Authorization": f"Bearer {KEY}"}
NAME = "tiny-bos"
MAX_LEN = 512
TEXTS = ["The quick brown fox", "", " leading space", "naïve café ☕ 日本", "a<｜User｜>b\n\tc"]
ADDED_BOS = {
    "content": "<｜begin▁of▁sentence｜>",
    "lstrip": False,
    "normalized": False,
    "rstrip": False,
    "single_word": False,
    "special": True,
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tiny-bos")
    for f in GQA_MODEL_DIR.iterdir():
        if f.is_file():
            shutil.copy(f, out / f.name)
    cfg = json.loads((out / "tokenizer_config.json").read_text())
    cfg.update(add_bos_token=True, bos_token=ADDED_BOS, added_tokens_decoder={"0": ADDED_BOS})
    assert cfg["chat_template"].startswith("{{ bos_token }}")
    cfg["chat_template"] = cfg["chat_template"].removeprefix("{{ bos_token }}")
    (out / "tokenizer_config.json").write_text(json.dumps(cfg))
    return out


@pytest.fixture(scope="module")
def base(model_dir: Path) -> Iterator[str]:
    flags = ("--api-key", KEY, "--served-model-name", NAME, "--max-model-len", str(MAX_LEN))
    with running_server(str(model_dir), *flags) as url:
        yield url


@pytest.fixture(scope="module")
def tok(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def config(model_dir: Path) -> dict:
    return json.loads((model_dir / "tokenizer_config.json").read_text())


def post(base: str, path: str, body: dict, status: int = 200) -> dict:
    r = httpx.post(f"{base}{path}", json=body, headers=AUTH, timeout=60)
    assert r.status_code == status, r.text
    return r.json()


def text_ids(tok: Tokenizer, text: str, special: bool = True) -> list[int]:
    """A text prompt's ids: the tokenizer's (with its post-processor when ``special``), after
    one BOS when ``special`` (the config sets add_bos_token)."""
    ids = tok.encode(text, add_special_tokens=special).ids
    bos = tok.token_to_id(ADDED_BOS["content"])
    return [bos, *ids] if special and ids[:1] != [bos] else ids


def rendered(config: dict, messages: list[dict], generation_prompt: bool = True) -> str:
    return jinja2.Template(config["chat_template"]).render(
        messages=messages,
        add_generation_prompt=generation_prompt,
        bos_token=ADDED_BOS["content"],
        eos_token=config["eos_token"],
    )


def test_tokenize_text(base: str, tok: Tokenizer) -> None:
    for text in TEXTS:
        want = text_ids(tok, text)
        assert want[0] == tok.token_to_id(ADDED_BOS["content"])
        body = {"count": len(want), "max_model_len": MAX_LEN, "tokens": want, "token_strs": None}
        assert post(base, "/tokenize", {"prompt": text}) == body
        assert post(base, "/tokenize", {"prompt": text, "model": NAME}) == body
        bare = post(base, "/tokenize", {"prompt": text, "add_special_tokens": False})
        assert bare["tokens"] == text_ids(tok, text, special=False) == want[1:]
        named = post(base, "/tokenize", {"prompt": text, "return_token_strs": True})
        assert named["token_strs"] == [tok.id_to_token(t) for t in want]


def test_tokenize_gives_the_ids_a_completion_runs(base: str) -> None:
    """The same text, sent as text or as the ids /tokenize gives, is the same prompt."""
    text = TEXTS[0]
    ids = post(base, "/tokenize", {"prompt": text})["tokens"]
    common = {"max_tokens": 0, "echo": True, "logprobs": 0}
    by_text = post(base, "/v1/completions", {"prompt": text, **common})
    by_ids = post(base, "/v1/completions", {"prompt": ids, **common})
    assert by_text["usage"]["prompt_tokens"] == len(ids) == by_ids["usage"]["prompt_tokens"]
    lps = [r["choices"][0]["logprobs"]["token_logprobs"] for r in (by_text, by_ids)]
    assert len(lps[0]) == len(ids) and lps[0] == lps[1]


def test_tokenize_chat(base: str, tok: Tokenizer, config: dict) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    want = tok.encode(rendered(config, messages), add_special_tokens=False).ids
    got = post(base, "/tokenize", {"messages": messages})
    assert got["tokens"] == want and got["count"] == len(want)
    assert tok.token_to_id(ADDED_BOS["content"]) not in want
    chat = post(base, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert chat["usage"]["prompt_tokens"] == len(want)
    plain = post(base, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert (
        plain["tokens"]
        == tok.encode(rendered(config, messages, False), add_special_tokens=False).ids
    )
    assert plain["tokens"] != want
    # specials on top of the template: the text-prompt rule, here a BOS in front
    special = post(base, "/tokenize", {"messages": messages, "add_special_tokens": True})
    assert special["tokens"] == text_ids(tok, rendered(config, messages))
    assert special["tokens"] == [tok.token_to_id(ADDED_BOS["content"]), *want]


def test_detokenize(base: str, tok: Tokenizer) -> None:
    rng = random.Random(0)
    size = tok.get_vocab_size(with_added_tokens=True)
    cases = [[], [0, 1, 2, 3, 4], [rng.randrange(size) for _ in range(50)], [size - 1]]
    for ids in cases:
        want = tok.decode(ids, skip_special_tokens=False)
        assert post(base, "/detokenize", {"tokens": ids}) == {"prompt": want}
        assert post(base, "/detokenize", {"tokens": ids, "model": NAME}) == {"prompt": want}
    for text in TEXTS:  # lm-eval sends decoded requests as text: the round trip is exact
        ids = post(base, "/tokenize", {"prompt": text, "add_special_tokens": False})["tokens"]
        assert post(base, "/detokenize", {"tokens": ids})["prompt"] == text


def test_tokenizer_info(base: str, config: dict) -> None:
    """tokenizer_config.json with added tokens as their text."""
    info = httpx.get(f"{base}/tokenizer_info", headers=AUTH, timeout=30).json()
    want = dict(config, bos_token=ADDED_BOS["content"])
    want["added_tokens_decoder"] = {"0": ADDED_BOS["content"]}
    assert info == want
    assert info["eos_token"] == "<｜end▁of▁sentence｜>" and info["chat_template"]


def assert_error(r: httpx.Response, status: int, needle: str = "") -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status, err
    assert needle.lower() in err["message"].lower(), err


VOCAB = 1024  # the bundled tokenizer's size, checked below
BAD = [
    ("/detokenize", {"tokens": [-1]}, 400, "[-1] are not in the tokenizer's vocabulary"),
    ("/detokenize", {"tokens": [5, VOCAB, 7]}, 400, f"[{VOCAB}]"),
    ("/detokenize", {"tokens": [2**64]}, 400, "vocabulary"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
    ("/detokenize", {"tokens": [1], "model": "nope"}, 404, "nope"),
    ("/tokenize", {}, 400, "exactly one of prompt"),
    (
        "/tokenize",
        {"prompt": "a", "messages": [{"role": "user", "content": "b"}]},
        400,
        "exactly one",
    ),
    ("/tokenize", {"prompt": 3}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("/tokenize", {"prompt": "a", "model": "nope"}, 404, "nope"),
]


@pytest.mark.parametrize(("path", "body", "status", "needle"), BAD)
def test_bad_requests(
    base: str, tok: Tokenizer, path: str, body: dict, status: int, needle: str
) -> None:
    assert tok.get_vocab_size(with_added_tokens=True) == VOCAB
    assert_error(httpx.post(f"{base}{path}", json=body, headers=AUTH, timeout=30), status, needle)


def test_api_key(base: str) -> None:
    for headers in (None, {"Authorization": "Bearer wrong"}):
        assert_error(httpx.get(f"{base}/tokenizer_info", headers=headers), 401, "API key")
        for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
            assert_error(httpx.post(f"{base}{path}", json=body, headers=headers), 401, "API key")
