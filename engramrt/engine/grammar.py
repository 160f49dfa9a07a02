"""Structured outputs: a request's grammar (a JSON schema, any JSON object, a regex, a choice
among strings, or a Lark grammar) as an llguidance matcher over the model's tokenizer; and the
per-token masks the host builds for them and for bad words of several tokens.

The engine keeps one matcher per request on the host: before a step that samples the request's
next token it asks the matcher which tokens may come next (a bitmask, one bit per token id,
applied in the batched sampler), and once it has the token it advances the matcher. A step that
samples a guided request therefore needs the previous token on the host first: the engine runs
such steps synchronously (overlap scheduling resumes when no guided request is running). When
the grammar is complete the request stops (finish reason ``stop``); when the matcher fails on
the way (one of llguidance's limits, on a path the model chose), the request ends with an error
the client sees, never a silent stop.
"""

from __future__ import annotations

import functools
import json
import re
import sys
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

# compact JSON: one space after ':' and ',' at most, no free whitespace between tokens (a model
# can otherwise spend its whole budget on newlines, which a schema allows)
_JSON_OPTIONS = {"whitespace_flexible": False}


@dataclass(frozen=True)
class GrammarSpec:
    """What the client asked for: ``kind`` one of json, regex, choice, lark; ``value`` a JSON
    schema (dict; ``{}`` = any JSON object), a regex, a list of strings or a Lark grammar."""

    kind: str
    value: Any

    def grammar(self) -> str:
        """llguidance's grammar text (not yet checked against a tokenizer)."""
        import llguidance

        m = llguidance.LLMatcher
        if self.kind == "json":
            schema = self.value if self.value else {"type": "object"}
            if isinstance(schema, str):
                schema = json.loads(schema)
            return m.grammar_from_json_schema(schema, defaults=_JSON_OPTIONS)
        if self.kind == "regex":
            return m.grammar_from_regex(self.value)
        if self.kind == "choice":
            if not self.value:
                raise ValueError("guided_choice needs at least one choice")
            return m.grammar_from_regex("|".join(re.escape(str(c)) for c in self.value))
        if self.kind == "lark":
            return m.grammar_from_lark(self.value)
        raise ValueError(f"unknown grammar kind {self.kind!r}")


@functools.cache
def _ll_tokenizer(tokenizer_json: str, vocab: int, eos: int | None):
    import llguidance

    return llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)


class Grammars:
    """Matchers for one engine's tokenizer."""

    def __init__(self, tokenizer: Tokenizer, vocab: int, eos_token_id: int | None):
        self.tokenizer, self.vocab, self.eos = tokenizer, vocab, eos_token_id
        self._json: str | None = None  # the tokenizer, serialised once (the cache's key)

    def matcher(self, spec: GrammarSpec):
        """A fresh matcher; ValueError (with the grammar's own message) if it is invalid."""
        import llguidance

        try:
            grammar = spec.grammar()
        except (ValueError, TypeError) as exc:
            raise refused(f"invalid {spec.kind} grammar", str(exc)) from None
        self._json = self._json or self.tokenizer.to_str()
        tok = _ll_tokenizer(self._json, self.vocab, self.eos)
        error = llguidance.LLMatcher.validate_grammar(grammar, tok)
        if error:
            raise refused(f"invalid {spec.kind} grammar", error)
        matcher = llguidance.LLMatcher(tok, grammar)
        if matcher.is_error():
            raise refused(f"invalid {spec.kind} grammar", matcher.get_error())
        _probe(matcher, spec.kind)
        return matcher


def one_line(detail: str) -> str:
    """llguidance's message as one line: its first, completed by the ``error:`` line that a
    regex parse error puts under its caret. The rest (the parser's state, the grammar echoed
    back, a caret drawing) is for the log, not for a client's error message."""
    lines = [line.strip() for line in detail.strip().splitlines()] or [""]
    cause = next((line[len("error: ") :] for line in lines[1:] if line.startswith("error: ")), "")
    if cause and lines[0].endswith(":"):
        return f"{lines[0]} {cause}"
    return lines[0].rstrip(":")


def refused(what: str, detail: str) -> ValueError:
    """The client's one-line error; llguidance's whole message goes to the log."""
    if one_line(detail) != detail.strip():
        print(f"engramrt: {what}: {detail.strip()}", file=sys.stderr, flush=True)
    return ValueError(f"{what}: {one_line(detail)}")


def _probe(matcher, kind: str) -> None:
    """Refuse what llguidance can tell before generation: a grammar that allows no first token,
    or one that breaks one of its limits on the tokens it forces (``a{1000}{1000}``, a schema
    whose required property recurses), on a copy of the matcher. What breaks later, on a path
    the model chooses, ends the request with an error (``Engine._append``)."""
    import numpy as np

    if not np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32).any():
        raise ValueError(f"invalid {kind} grammar: it matches nothing")
    probe = matcher.deep_copy()
    probe.consume_tokens(probe.compute_ff_tokens())
    probe.compute_bitmask()
    if probe.is_error():
        raise refused(f"{kind} grammar cannot be followed", probe.get_error())


def token_mask(req, vocab: int) -> list[int] | None:
    """The tokens ``req`` may sample next (its grammar's, less the bad words it would complete),
    one bit each, as int32 words (token t is bit t % 32 of word t // 32); None: any."""
    import numpy as np

    banned = req.banned_now()
    if req.matcher is None and not banned:
        return None
    if req.matcher is not None:
        words = np.frombuffer(req.matcher.compute_bitmask(), dtype=np.uint32).copy()
    else:
        words = np.full(-(-vocab // 32), 0xFFFFFFFF, dtype=np.uint32)
    for t in banned:
        if t // 32 < len(words):
            words[t // 32] &= ~np.uint32(1 << (t % 32))
    return words.view(np.int32).tolist()
