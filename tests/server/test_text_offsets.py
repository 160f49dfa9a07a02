"""``text_offset`` in process: ``TextOffsets`` against the oracle of ``offsets_oracle`` (the
tokenizer's full decodes), on random ids that split characters and hold special tokens, fed in
random chunks as a stream feeds them, and on prompts whose text lacks the BOS before it."""

from __future__ import annotations

import random

import pytest

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.engram.token_map import load_tokenizer
from engramrt.server.responses import TextOffsets
from tests.support.offsets_oracle import check_text_offsets

TOK = load_tokenizer(GQA_MODEL_DIR)
BOS = TOK.token_to_id("<｜begin▁of▁sentence｜>")
SPECIALS = [i for i in range(TOK.get_vocab_size()) if not TOK.decode([i], skip_special_tokens=True)]
# byte tokens: three or four of them make one character, alone each is U+FFFD
BYTES = [TOK.token_to_id(c) for c in ("\u00e2", "\u0124", "\u00ac", "\u00e4", "\u00bd", "æ")]


def _random_ids(rng: random.Random, n: int) -> list[int]:
    pick = [rng.random() for _ in range(n)]
    return [
        rng.choice(BYTES)
        if p < 0.3
        else rng.choice(SPECIALS)
        if p < 0.4
        else rng.randrange(TOK.get_vocab_size())
        for p in pick
    ]


def _in_chunks(offsets: TextOffsets, ids: list[int], rng: random.Random) -> list[int]:
    out, i = [], 0
    while i < len(ids):
        n = rng.randint(1, 4)
        out += offsets(ids[i : i + n])
        i += n
    return out


@pytest.mark.parametrize("specials", [False, True], ids=["generated", "echoed-ids"])
def test_offsets_follow_the_decoded_text(specials: bool) -> None:
    """Generated text leaves special tokens out (they add nothing); a prompt of ids is echoed
    as their decode with them. Offsets start where the text before them ends."""
    rng = random.Random(1)
    assert None not in BYTES and len(SPECIALS) >= 2
    for _ in range(40):
        ids, start = _random_ids(rng, rng.randint(1, 40)), rng.randint(0, 5)
        text = TOK.decode(ids, skip_special_tokens=not specials)
        offsets = _in_chunks(TextOffsets(TOK, start, specials=specials), ids, rng)
        check_text_offsets(
            TOK, "x" * start + text, offsets, [([], "x" * start, True), (ids, text, specials)]
        )


@pytest.mark.parametrize(
    "text", ["Tea in 日本 costs ¥5 🙂 today", "Hello", "", "<｜User｜>hi", "  two  spaces "]
)
def test_prompt_text_as_sent_without_its_bos(text: str) -> None:
    """The ids of a text prompt with the BOS that ``add_bos_token`` puts first: the BOS is not
    in the echoed text, adds nothing, and the offsets index the text as sent."""
    ids = [BOS, *TOK.encode(text).ids]
    offsets = TextOffsets(TOK, specials=True, text=text)(ids)
    check_text_offsets(TOK, text, offsets, [(ids[:1], "", False), (ids[1:], text, True)])
    assert offsets[:2] == [0, 0][: len(offsets)]
    # a text that starts with the BOS's own text keeps it (the config adds no second one)
    spelled = "<｜begin▁of▁sentence｜>" + text
    ids = TOK.encode(spelled).ids
    assert ids[0] == BOS
    offsets = TextOffsets(TOK, specials=True, text=spelled)(ids)
    check_text_offsets(TOK, spelled, offsets, [(ids, spelled, True)])
