"""The first stage's image spans (``runner/images.py``): over random requests with random images
and random steps of chunks and decode tokens, each token's row is the one a brute-force walk over
(slot, position) finds in its request's spans, or none; an image is encoded once however many
requests and re-admissions show it, until the cache lets it go."""

from __future__ import annotations

import random
from types import SimpleNamespace

import torch

from engramrt.runner.batch import ImageRef, NewRequest, StepBatch
from engramrt.runner.images import ImageSpans

D = 4


class Encoder:
    """Rows that name their image and position: key k's row j is ``[k, j, k, j]``."""

    def __init__(self):
        self.calls: list[str] = []

    def encode_image(self, model, ref: ImageRef) -> torch.Tensor:
        self.calls.append(ref.key)
        k = float(ref.key.removeprefix("img"))
        j = torch.arange(ref.length, dtype=torch.float32)
        return torch.stack([torch.full_like(j, k), j] * (D // 2), dim=1)


def _spans(encoder: Encoder, cache_bytes: int = 1 << 20) -> ImageSpans:
    model = SimpleNamespace(cfg=SimpleNamespace(family=encoder))
    return ImageSpans(model, torch.device("cpu"), cache_bytes)


def _request(rng: random.Random, slot: int, keys: list[int]) -> NewRequest:
    tokens, images = [], []
    for k in keys:
        tokens += [1] * rng.randint(0, 5)
        length = 1 + 5 * k % 12  # an image's span has one length (its key is its content)
        images.append(ImageRef(len(tokens), length, f"img{k}", [], b""))
        tokens += [9] * length
    tokens += [1] * rng.randint(0, 5)
    return NewRequest(slot, tokens, len(tokens), 0, images=images)


def test_each_token_takes_its_own_row_in_random_steps() -> None:
    rng = random.Random(0)
    for _ in range(40):
        encoder = Encoder()
        spans = _spans(encoder)
        reqs = [_request(rng, s, rng.sample(range(6), rng.randint(0, 3))) for s in range(4)]
        done = dict.fromkeys(range(4), 0)
        admitted = list(reqs)
        while any(done[r.slot] < len(r.tokens) + 3 for r in reqs):
            live = [r for r in reqs if done[r.slot] < len(r.tokens) + 3]
            runs = [(r.slot, done[r.slot], rng.randint(1, 9)) for r in live]
            batch = StepBatch(
                None, [s for s, _, _ in runs], [n for *_, n in runs], [p for _, p, _ in runs]
            )
            batch.admitted, admitted = [r for r in admitted if r in live], []
            spans.admit(batch.admitted)
            got = spans.step(batch)
            want = []  # brute force: each token's (image, index) or None
            for slot, start, n in runs:
                for pos in range(start, start + n):
                    hit = [
                        (float(ref.key[3:]), float(pos - ref.start))
                        for ref in reqs[slot].images
                        if ref.start <= pos < ref.start + ref.length
                    ]
                    want.append(hit[0] if hit else None)
                done[slot] = start + n
            if got is None:
                assert want == [None] * len(want)
                continue
            at, rows = got
            assert [None if a < 0 else tuple(rows[a, :2].tolist()) for a in at.tolist()] == want
        # every image encoded once, whatever chunks read it
        assert sorted(encoder.calls) == sorted({ref.key for r in reqs for ref in r.images})


def test_the_cache_keeps_an_image_for_later_requests_until_it_is_full() -> None:
    """A re-admitted or second request with a cached image is not encoded again; past the
    cache's bytes the least recently used image goes (and is encoded again if it returns)."""
    encoder = Encoder()
    spans = _spans(encoder, cache_bytes=3 * 8 * D * 4)  # three 8-row images
    refs = {k: ImageRef(2, 8, f"img{k}", [], b"") for k in range(5)}

    def admit(slot: int, *keys: int) -> None:
        images = [refs[k] for k in keys]
        spans.admit([NewRequest(slot, [1] * 20, 20, 0, images=images)])

    admit(0, 0)
    admit(1, 0)  # the same image in another request
    admit(0, 0)  # re-admitted (preempted, resumed)
    assert encoder.calls == ["img0"]
    admit(1, 1, 2)
    admit(0, 3)  # four images: img0, the least recently used, goes
    assert list(spans.cache) == ["img1", "img2", "img3"]
    admit(1, 0)
    assert encoder.calls == ["img0", "img1", "img2", "img3", "img0"]
    admit(0)  # a request without images clears its slot's spans
    batch = StepBatch(None, [0], [20], [0])
    assert spans.step(batch) is None
