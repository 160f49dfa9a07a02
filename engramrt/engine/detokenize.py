"""From output token ids to the text a client sees, a step at a time, where the text is wanted
(the server's process: the engine sends ids and never decodes).

``IncrementalDecoder`` turns a growing list of ids into text, decoding only the tokens since the
last whole character. ``StopStringHoldback`` decides how much of that text may be sent: text that
could still turn out to start a stop string, or an unfinished UTF-8 character, is held back until
it cannot; a stop string ends the request and is not sent. ``RequestText`` applies both to one
request's outputs and ends the request at a stop string (its caller then aborts it in the
engine, which may have run a step or two past it; those outputs are dropped).
"""

from __future__ import annotations

from dataclasses import replace

from tokenizers import Tokenizer

from engramrt.engine.engine import RequestOutput


class IncrementalDecoder:
    """``decode(ids[start:])`` of a growing ``ids``, at O(1) per token instead of O(length):
    only the tokens since the last point where the text ended on a whole character are decoded
    (the earlier text is kept). The window starts one chunk back, so tokenizers whose decoders
    strip a leading space see the same context as a full decode. ``skip_special`` as in
    ``Tokenizer.decode``: generated text leaves special tokens out, an echoed prompt keeps them."""

    def __init__(self, tokenizer: Tokenizer, start: int = 0, skip_special: bool = True):
        self.tok, self.start, self.skip_special, self.done = tokenizer, start, skip_special, ""
        self.prefix = self.read = start
        self.partial = ""  # decoded since the last commit, ending inside a character
        self.rewrote = False  # the last call's text changed what came before

    def _dec(self, ids: list[int], a: int, b: int | None = None) -> str:
        return self.tok.decode(ids[a:b], skip_special_tokens=self.skip_special)

    def advance(self, ids: list[int]) -> str | None:
        """The text the ids since the last commit add, committed, when it ends on a whole
        character; ``""`` while it does not (it waits in ``partial``); ``None`` when the decoder
        rewrote earlier text (only a full decode is right then)."""
        head = self._dec(ids, self.prefix, self.read) if self.read > self.prefix else ""
        full = self._dec(ids, self.prefix)
        if not full.startswith(head):
            return None
        tail = full[len(head) :]
        if tail and not tail.endswith("\ufffd"):  # ends on a whole character: commit
            self.prefix, self.read, self.partial = self.read, len(ids), ""
            return tail
        self.partial = tail
        return ""

    def __call__(self, ids: list[int]) -> str:
        new = self.advance(ids)
        self.rewrote = new is None
        if new is None:  # a decoder that rewrites earlier text: decode it all
            return self._dec(ids, self.start)
        self.done += new
        return self.done + self.partial


class StopStringHoldback:
    def __init__(self, stops: list[str]):
        self.stops, self.sent = stops, 0
        self.longest = max((len(s) for s in stops), default=0)
        self.hold = max(self.longest, 1) - 1

    def update(self, text: str, finished: bool, rescan: bool = False) -> tuple[str, bool]:
        """The new text to send of the whole output ``text`` so far, and whether a stop string
        ended the request. Only the unsent end (and a stop string's length before it) is
        searched: everything sent earlier was searched when it arrived, unless the text before
        it changed (``rescan``)."""
        since = 0 if rescan else max(0, self.sent - self.longest)
        hit = min((i for i in (text.find(s, since) for s in self.stops) if i >= 0), default=-1)
        if hit >= 0:
            text, finished = text[:hit], True
        # an unfinished UTF-8 character (U+FFFD) is held back, and the stop-string margin
        # counts from before it
        end = len(text) if finished else len(text.rstrip("\ufffd")) - self.hold
        new = text[self.sent : max(end, self.sent)]
        self.sent = max(end, self.sent)
        return new, hit >= 0


class OutputText:
    """One request's text state: decoder and hold-back together."""

    def __init__(self, tokenizer: Tokenizer, stops: list[str], start: int):
        self.decoder = IncrementalDecoder(tokenizer, start)
        self.holdback = StopStringHoldback(stops)

    def update(self, ids: list[int], finished: bool) -> tuple[str, bool]:
        text = self.decoder(ids)
        return self.holdback.update(text, finished, rescan=self.decoder.rewrote)


class RequestText:
    """One request's outputs with their text: token by token, so a stop string ends the
    output at the token that completed it (the ids, logprobs and counts after it are cut)."""

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], stops: list[str]):
        self.ids = list(prompt_ids)
        self.text = OutputText(tokenizer, stops, len(self.ids))
        self.done = False

    def apply(self, out: RequestOutput) -> RequestOutput | None:
        """``out`` with its text; None once the request has ended (a later step's output)."""
        if self.done:
            return None
        n, text, hit, kept = len(out.new_token_ids), "", False, len(out.new_token_ids)
        for j, token in enumerate(out.new_token_ids):
            self.ids.append(token)
            piece, hit = self.text.update(self.ids, out.finished and j == n - 1)
            text += piece
            if hit:
                kept = j + 1
                break
        if not n and out.finished:  # nothing new: flush what was held back
            piece, hit = self.text.update(self.ids, True)
            text += piece
        self.done = out.finished or hit
        if not hit:
            return replace(out, new_text=text)
        return replace(
            out,
            new_token_ids=out.new_token_ids[:kept],
            new_logprobs=out.new_logprobs[:kept],
            new_text=text,
            finished=True,
            finish_reason="stop",
            num_output_tokens=out.num_output_tokens - (n - kept),
        )
