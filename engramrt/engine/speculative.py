"""Speculative decoding, vLLM's ``--speculative-config``: n-gram (prompt-lookup) drafts, or
DeepSeek-V4.1's DSpark stages (``engramrt.models.deepseek_v41.dspark``).

``ngram``: a decoding request whose last ``n`` tokens (``prompt_lookup_max`` down to
``prompt_lookup_min``) occurred earlier in its own tokens proposes the ``k`` tokens that followed
that occurrence. ``dspark``: the last stage drafts each request's next ``k`` tokens at the end of
every step (after its sampler, from its last accepted position) and sends them with the sampled
tokens; the next step verifies them. Either way the step computes the anchor (its last sampled
token) and the drafts as one run and samples a token after each of them; the drafts are
accepted while they equal those samples, and the sample after the last accepted one (the bonus)
is kept too. A draft is a point mass, so "sample from the target, accept while equal" is exactly
the rejection-sampling rule (accept with probability p(draft); on rejection, draw from p without
the draft): greedy output is token for token the output without speculation, and sampled output
keeps the target distribution.

The Engram history must advance by the anchor and the accepted drafts only (SPEC: history
commits): a verify run commits nothing when it is hashed, and ``1 + accepted`` tokens of the
block are committed after it (``EngramHasher.commit_verify``), never the bonus, which is the
next anchor, and never a rejected draft.

Where one stage of one rank keeps its samples, all of this runs on the device after the sampler
(``engramrt.runner.verify``: acceptance, kept samples, the commit, the next drafts, the n-gram
lookup over the token rows included), so speculation runs under overlap scheduling; the host
decides how many drafts a run verifies and learns them with the tokens. Over several stages the
host looks up the n-gram drafts (``SpecConfig.propose``), sends them and the commits.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

KEYS = {
    "ngram": {"num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"},
    "dspark": {"num_speculative_tokens"},
}


@dataclass(frozen=True)
class SpecConfig:
    num_speculative_tokens: int
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    method: str = "ngram"

    @classmethod
    def parse(cls, text: str | None) -> SpecConfig | None:
        """vLLM's JSON: ``{"method": "ngram", "num_speculative_tokens": K,
        "prompt_lookup_max": 4, "prompt_lookup_min": 2}`` or ``{"method": "dspark",
        "num_speculative_tokens": K}``."""
        if not text:
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--speculative-config is not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        method = raw.pop("method", "ngram")
        if method not in KEYS:
            raise ValueError(f"--speculative-config method {method!r}: one of {sorted(KEYS)}")
        unknown = sorted(set(raw) - KEYS[method])
        if unknown:
            raise ValueError(f"--speculative-config: unknown keys {unknown}")
        if "num_speculative_tokens" not in raw:
            raise ValueError("--speculative-config needs num_speculative_tokens")
        cfg = cls(**{k: int(v) for k, v in raw.items()}, method=method)
        if cfg.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if not 1 <= cfg.prompt_lookup_min <= cfg.prompt_lookup_max:
            raise ValueError("need 1 <= prompt_lookup_min <= prompt_lookup_max")
        return cfg

    def to_json(self) -> str:
        """vLLM's spelling, which ``parse`` reads back."""
        return json.dumps(
            {k: v for k, v in asdict(self).items() if k in KEYS[self.method]}
            | {"method": self.method}
        )

    def propose(self, tokens: list[int], limit: int) -> list[int]:
        """Up to ``min(k, limit)`` drafts: what followed the latest earlier occurrence of the
        longest suffix of ``tokens`` (``prompt_lookup_max`` .. ``prompt_lookup_min`` long)."""
        k = min(self.num_speculative_tokens, limit)
        if k <= 0:
            return []
        seq = np.asarray(tokens, dtype=np.int64)  # one vectorised scan per suffix length
        for n in range(
            min(self.prompt_lookup_max, len(tokens) - 1), self.prompt_lookup_min - 1, -1
        ):
            windows = sliding_window_view(seq[:-1], n)  # every earlier start
            hits = np.flatnonzero((windows == seq[-n:]).all(axis=1))
            if hits.size:  # the latest occurrence
                start = int(hits[-1])
                return tokens[start + n : start + n + k]
        return []


def accepted(drafts: list[int], sampled: list[int]) -> int:
    """How many drafts equal the tokens sampled before them (``sampled[i]`` follows the anchor
    and drafts ``< i``)."""
    a = 0
    while a < len(drafts) and sampled[a] == drafts[a]:
        a += 1
    return a
