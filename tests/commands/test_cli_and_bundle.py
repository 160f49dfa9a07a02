"""`engramrt engram-hash` on the bundled model against the oracle; the bundle's recipe."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engramrt.bundled import DEFAULT_MODEL_DIR, GQA_MODEL_DIR, recipe
from engramrt.cli import main
from engramrt.config import engram_config, load_json
from engramrt.engram import load_hasher
from engramrt.engram.layout import EngramLayout
from engramrt.engram.token_map import build_token_map, load_tokenizer
from tests.support.hash_oracle import oracle_ids


def _oracle(tokens: list[int]) -> list[list[list[int]]]:
    cfg = engram_config(load_json(DEFAULT_MODEL_DIR))
    tmap = build_token_map(load_tokenizer(DEFAULT_MODEL_DIR)).tolist()
    return oracle_ids(EngramLayout.from_config(cfg), tmap, tokens, cfg.image_token_id)


def _run_json(capsys: pytest.CaptureFixture, *argv: str) -> dict:
    assert main(["engram-hash", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_version(capsys: pytest.CaptureFixture) -> None:
    """``engramrt --version`` prints the package's version and exits 0, as vLLM's does."""
    import engramrt

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"engramrt {engramrt.__version__}"


def test_every_help_shows_the_defaults() -> None:
    """Each subcommand's --help states the default of every option that has one (in its own
    words or as "(default: X)"); the top help is plain text."""
    import argparse

    from engramrt.cli import build_parser

    parser = build_parser()
    assert "``" not in parser.format_help()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    parsers = [p for s in subs for p in s.choices.values()]
    bench = parsers.pop([p.prog for p in parsers].index("engramrt bench"))
    parsers += [
        p
        for a in bench._actions
        if isinstance(a, argparse._SubParsersAction)
        for p in a.choices.values()
    ]
    assert len(parsers) == 7  # engram-hash, generate, check-pp, serve, eval, bench serve/throughput
    for p in parsers:
        text = " ".join(p.format_help().split())
        for a in p._actions:
            unset = any(a.default is v for v in (None, False, argparse.SUPPRESS))
            if not a.option_strings or unset:
                continue
            said = f"(default: {a.default})" in text or "default" in (a.help or "")
            assert said, (p.prog, a.option_strings)


def test_engram_hash_text_matches_oracle(capsys: pytest.CaptureFixture) -> None:
    text = "The Engram café hashes THE tokens  of   <｜image｜> a prompt."
    out = _run_json(capsys, "--text", text)
    tokens = [row["token_id"] for row in out["tokens"]]
    assert tokens == load_tokenizer(DEFAULT_MODEL_DIR).encode(text).ids
    assert 5 in tokens  # the image token blocks its n-grams; the oracle covers it
    expected = _oracle(tokens)
    for p, row in enumerate(out["tokens"]):
        assert row["position"] == p
        assert [row["hash_ids"][str(lid)] for lid in out["engram_layer_ids"]] == expected[p]


def test_engram_hash_token_ids(capsys: pytest.CaptureFixture) -> None:
    ids = [0, 17, 300, 2, 2, 1023, 5, 44]
    out = _run_json(capsys, "--token-ids", ",".join(map(str, ids)))
    got = [[row["hash_ids"][str(lid)] for lid in out["engram_layer_ids"]] for row in out["tokens"]]
    assert got == _oracle(ids)
    hasher, _ = load_hasher(DEFAULT_MODEL_DIR)
    assert [row["compressed_id"] for row in out["tokens"]] == [
        None if t == 5 else int(hasher.token_map[t]) for t in ids
    ]


@pytest.mark.parametrize("bad", [["--token-ids", "1,2,1024"], ["--token-ids", "-1"]])
def test_engram_hash_rejects_out_of_range(bad: list[str], capsys: pytest.CaptureFixture) -> None:
    assert main(["engram-hash", *bad]) == 2
    assert "outside the tokenizer" in capsys.readouterr().err


@pytest.mark.slow
def test_console_entry_point_text_output() -> None:
    """`python -m engramrt` works and the text output lists every Engram layer per token."""
    run = subprocess.run(
        [sys.executable, "-m", "engramrt", "engram-hash", "--token-ids", "9,10"],
        capture_output=True,
        text=True,
        check=True,
    )
    lines = run.stdout.splitlines()
    assert len(lines) == 2 * 3 and lines[0].startswith("pos    0") and "layer   3:" in lines[5]


@pytest.mark.parametrize("v41", [True, False], ids=["v41", "gqa"])
def test_recipe_reproduces_bundle(tmp_path: Path, v41: bool) -> None:
    """The committed configs and tokenizers of the default model and of the GQA fixture are
    exactly what the recipe generates offline."""
    recipe.write(tmp_path, v41=v41)
    committed = DEFAULT_MODEL_DIR if v41 else GQA_MODEL_DIR
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (committed / name).read_bytes(), name
