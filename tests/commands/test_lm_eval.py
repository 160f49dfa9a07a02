"""lm-eval itself against ``engramrt serve``, with nothing installed but ``lm-eval[api]``: its
``local-completions`` model with ``tokenizer_backend=remote`` (our /tokenizer_info, /tokenize,
/detokenize, no ``transformers``) runs a multiple-choice and a generation task written here.

The bundled model has random weights, so scores mean nothing: the numbers are compared.
Requests sent as token ids and as text give the same loglikelihoods, and both equal a float32
forward of the model in this process on ids from the ``tokenizers`` library; generations equal
that forward's greedy decode."""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.config import load_json
from engramrt.models import model_config
from engramrt.runner.batch import NewRequest, StepBatch
from engramrt.runner.stage import StageRunner
from tests.support.server_fixture import running_server

pytest.importorskip("lm_eval")  # the test extra installs lm-eval[api]
pytestmark = pytest.mark.slow  # a server process

KEY = "sk-lm-eval-test"
NAME = "engramrt-tiny"
MAX_GEN = 6
EOS_ID = model_config(load_json(GQA_MODEL_DIR)).eos_token_id
DOCS = [
    {"question": "The sky on a clear day is", "choices": ["blue", "green", "loud"], "label": 0},
    {"question": "Two plus two equals", "choices": ["four", "five"], "label": 0},
    {"question": "Engram tables hash n-grams of the", "choices": ["prompt", "moon"], "label": 0},
    {"question": "naïve café, façade and", "choices": ["résumé", "jalapeño ☕"], "label": 1},
]
DATA = """dataset_path: json
dataset_kwargs:
  data_files: {{test: "{data}"}}
  cache_dir: "{cache}"
test_split: test
doc_to_text: "{{{{question}}}}"
"""
TASKS = {
    "engramrt_mc": """output_type: multiple_choice
doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]
""",
    "engramrt_gen": f"""output_type: generate_until
doc_to_target: "{{{{choices[label]}}}}"
generation_kwargs: {{until: ["\\n"], max_gen_toks: {MAX_GEN}}}
metric_list: [{{metric: exact_match, aggregation: mean, higher_is_better: true}}]
""",
}
OFFLINE = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def write_tasks(where: Path) -> None:
    data = where / "docs.jsonl"
    data.write_text("".join(json.dumps(d, ensure_ascii=False) + "\n" for d in DOCS))
    head = DATA.format(data=data, cache=where / "hf-cache")
    for name, body in TASKS.items():
        (where / f"{name}.yaml").write_text(f"task: {name}\n{head}{body}", encoding="utf-8")


@pytest.fixture(scope="module")
def base() -> Iterator[str]:
    with running_server("--dtype", "float32", "--api-key", KEY) as url:
        yield url


@pytest.fixture(scope="module")
def runs(base: str, tmp_path_factory: pytest.TempPathFactory) -> dict[bool, dict]:
    """``simple_evaluate``'s samples per task, for requests sent as ids (True) and as text."""
    where = tmp_path_factory.mktemp("lm-eval")
    write_tasks(where)
    with pytest.MonkeyPatch.context() as mp:
        for k, v in {**OFFLINE, "OPENAI_API_KEY": KEY}.items():  # the key of completions
            mp.setenv(k, v)
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        tasks = TaskManager(include_path=str(where), include_defaults=False)
        out = {}
        for tokenized in (True, False):
            model_args = {
                "model": NAME,
                "base_url": f"{base}/v1/completions",
                "tokenizer_backend": "remote",
                "auth_token": KEY,  # the remote tokenizer's key
                "tokenized_requests": tokenized,
                "num_concurrent": 1,
                "max_retries": 1,
            }
            res = simple_evaluate(
                model="local-completions",
                model_args=model_args,
                tasks=list(TASKS),
                task_manager=tasks,
                log_samples=True,
                bootstrap_iters=0,
            )
            out[tokenized] = res["samples"]
    return out


@pytest.fixture(scope="module")
def oracle() -> tuple[Tokenizer, Callable[[list[int]], torch.Tensor]]:
    """The tokenizer.json's ``tokenizers`` tokenizer, and next-token log-probabilities of a
    whole sequence from one float32 forward of the model, as a fresh request."""
    tok = Tokenizer.from_file(str(GQA_MODEL_DIR / "tokenizer.json"))
    runner = StageRunner.load(GQA_MODEL_DIR, 1, 256, "cpu", "float32")

    def logprobs(ids: list[int]) -> torch.Tensor:
        # one thread: a forward this small gains nothing from more, and on a busy machine
        # OpenMP's waits made it many times slower
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            logits = runner.compute(
                StepBatch(ids, [0], [len(ids)], [0], admitted=[NewRequest(0, ids, len(ids), 0)])
            )
        finally:
            torch.set_num_threads(threads)
        return torch.log_softmax(logits.double(), dim=-1)

    return tok, logprobs


def split(tok: Tokenizer, context: str, continuation: str) -> tuple[list[int], int]:
    """lm-eval's ids for a (context, continuation) pair: the whole text's ids, the first
    ``len(ids(context))`` of them the context (it would move a context's trailing spaces to the
    continuation first; these contexts have none)."""
    assert context == context.rstrip()
    whole = tok.encode(context + continuation, add_special_tokens=False).ids
    ctx = tok.encode(context, add_special_tokens=False).ids
    assert whole[: len(ctx)] == ctx  # the continuation starts a new pre-token
    return whole, len(ctx)


def scores(samples: list[dict]) -> list[list[float]]:
    by_doc = sorted(samples, key=lambda s: s["doc_id"])
    return [[float(ll) for ll, _ in s["filtered_resps"]] for s in by_doc]


def test_loglikelihood_ids_and_text_agree(runs: dict[bool, dict]) -> None:
    """Every choice's loglikelihood, per sample, whether lm-eval sent ids or decoded text."""
    ids, text = scores(runs[True]["engramrt_mc"]), scores(runs[False]["engramrt_mc"])
    assert [len(c) for c in ids] == [len(d["choices"]) for d in DOCS] == [len(c) for c in text]
    for a, b in zip(sum(ids, []), sum(text, []), strict=True):
        assert math.isfinite(a) and a < 0
        assert abs(a - b) <= 1e-4, (a, b)


def test_loglikelihood_equals_the_model(runs: dict[bool, dict], oracle) -> None:
    """The sums over the continuation's tokens of the model's log-probabilities, on ids
    tokenised here, equal lm-eval's (so /tokenize gave lm-eval these ids)."""
    tok, logprobs = oracle
    samples = sorted(runs[True]["engramrt_mc"], key=lambda s: s["doc_id"])
    for doc, sample in zip(DOCS, samples, strict=True):
        for choice, (ll, _) in zip(doc["choices"], sample["filtered_resps"], strict=True):
            whole, n_ctx = split(tok, doc["question"], " " + choice)  # target_delimiter " "
            lp = logprobs(whole)
            want = sum(lp[i - 1, whole[i]].item() for i in range(n_ctx, len(whole)))
            assert abs(float(ll) - want) <= 1e-4, (doc["question"], choice, ll, want)


def test_generate_until(runs: dict[bool, dict], oracle) -> None:
    """Greedy generations, cut at the task's ``until``, are the model's greedy decode, whether
    the prompt went as ids or as text."""
    tok, logprobs = oracle
    wants = []
    for doc in DOCS:
        ids = tok.encode(doc["question"], add_special_tokens=False).ids
        out: list[int] = []
        while len(out) < MAX_GEN and EOS_ID not in out[-1:]:
            out.append(int(logprobs(ids + out)[-1].argmax()))
        wants.append(tok.decode(out, skip_special_tokens=True).split("\n")[0])
    assert all(wants), wants  # text to compare, on these weights
    for tokenized in (True, False):
        samples = sorted(runs[tokenized]["engramrt_gen"], key=lambda s: s["doc_id"])
        got = [s["filtered_resps"][0] for s in samples]
        assert got == wants, tokenized


def test_no_transformers(runs: dict[bool, dict]) -> None:
    """The remote backend did the tokenising: lm-eval never loaded ``transformers``."""
    assert set(runs) == {True, False} and "transformers" not in sys.modules
