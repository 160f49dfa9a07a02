"""What a right ``text_offset`` is, stated on the tokenizer's own full decodes (the tests' oracle
for ``TextOffsets``, in process and over HTTP)."""

from __future__ import annotations

from tokenizers import Tokenizer


def check_text_offsets(
    tok: Tokenizer, text: str, offsets: list[int], parts: list[tuple[list[int], str, bool]]
) -> None:
    """``parts``: (ids, the text they make, whether special tokens are in that text), in order;
    together they make ``text``. Every offset indexes ``text``, offsets never decrease, and the
    slice from an offset to the next is what its token adds: before token j of a part, the part
    so far is its first j ids decoded, less at most an unfinished character; after whole
    characters, a token that decodes to whole characters on its own is its own slice, and a
    special token the text leaves out an empty one. (Tokens after an unfinished character share
    it with the one that completes it, or with the end of the text.)"""
    assert len(offsets) == sum(len(ids) for ids, _, _ in parts)
    assert offsets == sorted(offsets) and all(0 <= o <= len(text) for o in offsets)
    assert "".join(p for _, p, _ in parts) == text
    ends = [*offsets[1:], len(text)]
    i = start = 0
    for ids, part, specials_in in parts:
        for j, t in enumerate(ids):
            rel = offsets[i] - start
            so_far = tok.decode(ids[:j], skip_special_tokens=not specials_in)
            assert so_far[:rel] == part[:rel] and rel <= len(so_far), (i, so_far, part[:rel])
            clean = not so_far[rel:]  # else only an unfinished character is still to come
            assert clean or so_far.endswith("\ufffd"), (i, so_far[rel:])
            own = tok.decode([t], skip_special_tokens=False)
            if not specials_in and not tok.decode([t], skip_special_tokens=True):
                own = ""  # a special token the text leaves out
            if clean and "\ufffd" not in own:
                assert text[offsets[i] : ends[i]] == own, (i, own)
            i += 1
        start += len(part)
