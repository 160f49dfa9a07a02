"""EngramHasher (extend / decode / verify) and its n-gram history vs a brute-force oracle.

Every expected value comes from ``tests/support/hash_oracle.py`` (on Python integers) or from
a stated invariant (chunking, batching, rebuild); nothing is hard-coded.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
from collections.abc import Iterable
from dataclasses import dataclass, field

import pytest
import torch

from engramrt.config import EngramConfig
from engramrt.engram.hashing import EngramHasher
from engramrt.engram.layout import EngramLayout, search_primes
from tests.support.hash_oracle import (
    oracle_history,
    oracle_ids,
    oracle_pad_ids,
    oracle_position_ids,
)
from tests.support.kernel_env import interpreter_on

V = 300  # tokenizer size = len(token_map)
K = 240  # compressed vocab; smaller than V so compressed ids collide
PAD = 2  # engram_pad_token_id
IMAGE = 297  # image_token_id, inside the vocab
MM = 5000  # mm_pad_start: ids at or above it are multimodal pads
NUM_SLOTS = 8
SEEDS = range(6)
GARBAGE = (-7, -1, V, V + 13, 99_999)  # token ids a padding row may carry


def make_config(n: int, heads: int, **overrides) -> EngramConfig:
    """A small EngramConfig whose num_embeddings are the true sums of its primes."""
    fields = {
        "layer_ids": (1, 3),
        "num_embeddings": (0, 0),
        "max_ngram_size": n,
        "n_heads": heads,
        "head_dim": 8,
        "vocab_size": 1000,
        "pad_token_id": PAD,
        "compressed_vocab_size": K,
        "hidden_size": 16,
        "hc_mult": 4,
        "rms_norm_eps": 1e-6,
        "image_token_id": IMAGE,
    }
    cfg = EngramConfig(**(fields | overrides))
    sums = tuple(sum(p for per_n in layer for p in per_n) for layer in search_primes(cfg))
    return dataclasses.replace(cfg, num_embeddings=sums)


@dataclass
class Setup:
    layout: EngramLayout
    token_map: torch.Tensor
    kernels: bool = False  # the Triton kernels (under TRITON_INTERPRET=1 on a CPU)
    tmap: list[int] = field(init=False)

    def __post_init__(self) -> None:
        self.tmap = self.token_map.tolist()

    @property
    def n(self) -> int:
        return self.layout.config.max_ngram_size

    def hasher(self, num_slots: int = NUM_SLOTS, mm_pad_start: int | None = None) -> EngramHasher:
        return EngramHasher(
            self.layout,
            self.token_map,
            num_slots,
            mm_pad_start=mm_pad_start,
            kernels=self.kernels,
        )

    def expect(
        self, seq: list[int], positions: Iterable[int], mm_pad_start: int | None = None
    ) -> list:
        """Oracle ids of ``positions`` of a request whose full token history is ``seq``."""
        img = self.layout.config.image_token_id
        return [
            oracle_position_ids(self.layout, self.tmap, seq, p, img, mm_pad_start)
            for p in positions
        ]

    def pad_ids(self) -> list:
        return oracle_pad_ids(self.layout, self.tmap)


# the same oracle suite on the Triton kernels, in the interpreter (CPU tensors); on a GPU the
# kernels are checked by tests/kernels/test_kernels.py instead
KERNEL_CASES = [(4, 8, True), (3, 2, True)] if interpreter_on() else []


@pytest.fixture(
    scope="module",
    params=[(4, 8, False), (3, 2, False), *KERNEL_CASES],
    ids=["N4H8", "N3H2", *(f"triton-N{n}H{h}" for n, h, _ in KERNEL_CASES)],
)
def setup(request) -> Setup:
    n, heads, kernels = request.param
    layout = EngramLayout.from_config(make_config(n, heads))
    gen = torch.Generator().manual_seed(1234 + n)
    token_map = torch.randint(0, K, (V,), generator=gen, dtype=torch.int64)
    # pad_c must differ from 0, from the raw pad id and from token_map[0] (see test_pad_value)
    token_map[PAD] = next(c for c in range(3, K) if c != token_map[0])
    return Setup(layout, token_map, kernels)


def t64(xs) -> torch.Tensor:
    return torch.tensor(list(xs), dtype=torch.int64)


def rand_tokens(rng: random.Random, count: int, image_rate: float = 0.05) -> list[int]:
    return [IMAGE if rng.random() < image_rate else rng.randrange(V) for _ in range(count)]


def row(hasher: EngramHasher, slot: int) -> list[int]:
    return hasher.history.table[slot].tolist()


def extend_one(hasher: EngramHasher, tokens: list[int], slot: int, start: int) -> None:
    """Extend one request by ``tokens`` from ``start``; an empty run is skipped (an extend with
    no tokens at all is the case of test_extend_with_no_tokens)."""
    if tokens:
        hasher.extend(t64(tokens), t64([slot]), t64([len(tokens)]), t64([start]))


def prefill(hasher: EngramHasher, prompts: dict[int, list[int]]) -> None:
    """One extend from position 0 of every prompt, keyed by slot. An empty prompt leaves its row
    (possibly stale) alone: hashing from position 0 must ignore it."""
    slots = list(prompts)
    flat = [tok for slot in slots for tok in prompts[slot]]
    lens = [len(prompts[slot]) for slot in slots]
    if flat:  # an extend with no tokens at all: see test_extend_with_no_tokens
        hasher.extend(t64(flat), t64(slots), t64(lens), t64([0] * len(slots)))


# --- extend -------------------------------------------------------------------------------------


def test_extend_matches_oracle(setup):
    """Extend over random batches: nonzero starts with rebuilt history, zero-length runs,
    trailing garbage padding (all-pad ids), history = last N-1 tokens, empty runs untouched."""
    for seed in SEEDS:
        rng = random.Random(seed)
        hasher = setup.hasher()
        for slot in range(NUM_SLOTS):  # unrelated stale rows everywhere
            hasher.rebuild(slot, rand_tokens(rng, rng.randrange(6)))
        bsz = rng.randint(2, 5)
        slots = rng.sample(range(NUM_SLOTS), bsz)
        lens = [rng.choice([0, 1, 2, 3, 5, 9]) for _ in range(bsz)]
        empty, busy = rng.sample(range(bsz), 2)
        lens[empty], lens[busy] = 0, rng.randint(1, 9)
        starts, priors, runs = [], [], []
        for slot, length in zip(slots, lens, strict=True):
            start = rng.choice([0, 1, 2, rng.randint(3, 12)])
            prior = rand_tokens(rng, start)
            if start or rng.random() < 0.5:  # start 0 without rebuild: stale row must be ignored
                hasher.rebuild(slot, prior)
            starts.append(start)
            priors.append(prior)
            runs.append(rand_tokens(rng, length))
        n_pad = rng.randint(0, 4)
        flat = [tok for run in runs for tok in run] + [rng.choice(GARBAGE) for _ in range(n_pad)]
        before = hasher.history.table.clone()

        ids = hasher.extend(t64(flat), t64(slots), t64(lens), t64(starts))

        cfg = setup.layout.config
        assert ids.dtype == torch.int64
        assert ids.shape == (len(flat), cfg.num_layers, cfg.n_hash_cols)
        got, at = ids.tolist(), 0
        for start, prior, run in zip(starts, priors, runs, strict=True):
            full = prior + run
            assert got[at : at + len(run)] == setup.expect(full, range(start, len(full)))
            at += len(run)
        assert got[at:] == [setup.pad_ids()] * n_pad
        written = set()
        for slot, prior, run in zip(slots, priors, runs, strict=True):
            if run:
                assert row(hasher, slot) == oracle_history(prior + run, setup.n)
                written.add(slot)
        for slot in set(range(NUM_SLOTS)) - written:
            assert row(hasher, slot) == before[slot].tolist()


def test_extend_only_padding_tokens(setup):
    """Every run empty, only padding tokens: all-pad ids and no live row changes."""
    hasher = setup.hasher()
    rng = random.Random(0)
    for slot in range(NUM_SLOTS):
        hasher.rebuild(slot, rand_tokens(rng, 4))
    before = hasher.history.table[:NUM_SLOTS].clone()
    ids = hasher.extend(t64([5, V + 1, -3]), t64([1, 4]), t64([0, 0]), t64([3, 0]))
    assert ids.tolist() == [setup.pad_ids()] * 3
    assert torch.equal(hasher.history.table[:NUM_SLOTS], before)


def test_extend_with_no_tokens(setup):
    """An extend whose runs are all empty and that has no tokens returns [0, L, C] ids."""
    hasher = setup.hasher()
    before = hasher.history.table.clone()
    ids = hasher.extend(t64([]), t64([1, 2]), t64([0, 0]), t64([4, 0]))
    assert ids.shape == (0, setup.layout.config.num_layers, setup.layout.config.n_hash_cols)
    assert torch.equal(hasher.history.table, before)


# --- decode -------------------------------------------------------------------------------------


def test_decode_matches_oracle_with_aliasing_padding(setup):
    """Many decode steps with num_real < batch: padding rows alias live slots yet never commit,
    get all-pad ids; num_real as int and as a 0-dim tensor."""
    for seed in SEEDS:
        rng = random.Random(seed)
        if seed == 0:
            slots, num_real = [7, 2, 0, 5, 2], 4  # slot 2 must get row 1's update only
        else:
            num_real = rng.randint(1, 5)
            live = rng.sample(range(NUM_SLOTS), num_real)
            slots = live + [rng.choice(live) for _ in range(rng.randint(1, 3))]
        live = slots[:num_real]
        hasher = setup.hasher()
        for slot in range(NUM_SLOTS):  # stale rows of finished requests: must be ignored
            hasher.rebuild(slot, rand_tokens(rng, 3))
        seqs = {slot: rand_tokens(rng, rng.choice([0, 1, 2, 6])) for slot in live}
        prefill(hasher, seqs)
        for step in range(10):
            new = {slot: rand_tokens(rng, 1)[0] for slot in live}
            n_pad = len(slots) - num_real
            toks = [new[s] for s in live] + [rng.choice(GARBAGE) for _ in range(n_pad)]
            positions = [len(seqs[s]) for s in live] + [rng.randint(0, 40) for _ in range(n_pad)]
            before = hasher.history.table.clone()
            nr = num_real if step % 2 else torch.tensor(num_real)

            ids = hasher.decode(t64(toks), t64(slots), t64(positions), num_real=nr).tolist()

            for i, slot in enumerate(live):
                seqs[slot].append(new[slot])
                assert ids[i] == setup.expect(seqs[slot], [len(seqs[slot]) - 1])[0]
                assert row(hasher, slot) == oracle_history(seqs[slot], setup.n)
            assert ids[num_real:] == [setup.pad_ids()] * n_pad
            for slot in set(range(NUM_SLOTS)) - set(live):
                assert row(hasher, slot) == before[slot].tolist()


# --- verify -------------------------------------------------------------------------------------


def test_verify_and_commit_match_oracle(setup):
    """Verify blocks (anchor + m drafts) hash like the oracle; commit_verify advances by the anchor
    plus k accepted drafts (k = 0..m), never the bonus; padding requests neither hash nor commit."""
    m = 4
    for seed in SEEDS[:4]:
        rng = random.Random(seed)
        num_real = 4
        live = rng.sample(range(NUM_SLOTS), num_real)
        slots = [*live, live[1]]  # a padding request aliasing a live slot
        hasher = setup.hasher()
        seqs = {slot: rand_tokens(rng, rng.randint(0, 7)) for slot in live}
        prefill(hasher, seqs)
        anchors = {slot: rand_tokens(rng, 1)[0] for slot in live}
        for rnd in range(m + 1):
            blocks = {s: [anchors[s], *rand_tokens(rng, m)] for s in live}
            flat = [tok for s in live for tok in blocks[s]]
            flat += [rng.choice(GARBAGE) for _ in range(1 + m)]
            positions = [len(seqs[s]) for s in live] + [rng.randint(0, 30)]
            nr = num_real if rnd % 2 else torch.tensor(num_real)
            before = hasher.history.table.clone()

            ids = hasher.verify(t64(flat), t64(slots), t64(positions), num_real=nr).tolist()

            assert torch.equal(hasher.history.table, before), "verify must not commit"
            for i, s in enumerate(live):
                full = seqs[s] + blocks[s]
                want = setup.expect(full, range(len(seqs[s]), len(full)))
                assert ids[i * (1 + m) : (i + 1) * (1 + m)] == want
            assert ids[num_real * (1 + m) :] == [setup.pad_ids()] * (1 + m)

            accepted = [(rnd + i) % (m + 1) for i in range(num_real)] + [m]
            hasher.commit_verify(t64(flat), t64(slots), t64(accepted), num_real=nr)

            for s, k in zip(live, accepted[:num_real], strict=True):
                seqs[s] += blocks[s][: 1 + k]
                assert row(hasher, s) == oracle_history(seqs[s], setup.n)
                bonus = blocks[s][1 + k] if k < m else rand_tokens(rng, 1)[0]
                anchors[s] = bonus
            for slot in set(range(NUM_SLOTS)) - set(live):
                assert row(hasher, slot) == before[slot].tolist()


def test_commit_verify_rejects_out_of_range_accepts(setup):
    """num_accepted outside [0, m] raises ValueError and leaves the history untouched."""
    m = 4
    rng = random.Random(3)
    hasher = setup.hasher()
    prefill(hasher, {1: rand_tokens(rng, 5), 6: rand_tokens(rng, 2)})
    block = t64(rand_tokens(rng, 2 * (1 + m)))
    before = hasher.history.table.clone()
    for bad in ([0, -1], [m + 1, 0], [2, m + 7]):
        with pytest.raises(ValueError):
            hasher.commit_verify(block, t64([1, 6]), t64(bad))
        assert torch.equal(hasher.history.table, before)
    hasher.commit_verify(block, t64([1, 6]), t64([m, 0]))  # both ends of the range are fine
    with pytest.raises(ValueError, match="slots"):
        hasher.commit_verify(block, t64([1, 99]), t64([0, 0]))


def test_commit_verify_ignores_padding_rows(setup):
    """Padding requests (>= num_real) may carry garbage slots and accept counts: they neither
    raise nor write, even when they alias a live slot."""
    m = 4
    rng = random.Random(5)
    hasher = setup.hasher()
    prompt = rand_tokens(rng, 6)
    prefill(hasher, {3: prompt})
    block = rand_tokens(rng, 1 + m)
    for pad_slot, pad_acc in ((99, 7), (3, 2), (-1, -5)):
        h = setup.hasher()
        prefill(h, {3: prompt})
        garbage = rand_tokens(rng, 1 + m)
        h.commit_verify(t64(block + garbage), t64([3, pad_slot]), t64([1, pad_acc]), num_real=1)
        assert h.history.table[3].tolist() == oracle_history(prompt + block[:2], setup.n)
        assert torch.equal(h.history.table[:3], hasher.history.table[:3])
        assert torch.equal(h.history.table[4:NUM_SLOTS], hasher.history.table[4:NUM_SLOTS])


# --- invariances --------------------------------------------------------------------------------


def test_chunked_prefill_equals_full_prefill(setup):
    """Any chunk split of a prompt (extend per chunk, same slot) + decodes is bitwise equal to one
    full prefill + the same decodes, and both match the oracle."""
    for seed in SEEDS:
        rng = random.Random(seed)
        prompt = rand_tokens(rng, rng.randint(1, 24))
        decodes = rand_tokens(rng, 6)
        cuts = sorted(rng.sample(range(1, len(prompt)), min(len(prompt) - 1, rng.randint(0, 5))))
        bounds = [0, *cuts, len(prompt)]
        slot = rng.randrange(NUM_SLOTS)

        chunked = setup.hasher()
        parts = [
            chunked.extend(t64(prompt[a:b]), t64([slot]), t64([b - a]), t64([a]))
            for a, b in itertools.pairwise(bounds)
        ]
        full = setup.hasher()
        parts_full = [full.extend(t64(prompt), t64([slot]), t64([len(prompt)]), t64([0]))]
        for i, tok in enumerate(decodes):
            pos = t64([len(prompt) + i])
            parts.append(chunked.decode(t64([tok]), t64([slot]), pos))
            parts_full.append(full.decode(t64([tok]), t64([slot]), pos))

        got, want = torch.cat(parts), torch.cat(parts_full)
        assert torch.equal(got, want), f"chunk bounds {bounds}"
        assert torch.equal(chunked.history.table, full.history.table)
        assert got.tolist() == oracle_ids(setup.layout, setup.tmap, prompt + decodes, IMAGE)


def test_ids_independent_of_batch_and_slot(setup):
    """A request's ids are the same alone in slot 0 and inside a batch with random neighbours and
    padding in another slot, through extend, decode and verify."""
    m = 3
    for seed in SEEDS:
        rng = random.Random(seed)
        prompt = rand_tokens(rng, rng.randint(1, 12))
        decodes = rand_tokens(rng, 4)
        block = rand_tokens(rng, 1 + m)

        alone = setup.hasher()
        ref = [alone.extend(t64(prompt), t64([0]), t64([len(prompt)]), t64([0]))]
        for i, tok in enumerate(decodes):
            ref.append(alone.decode(t64([tok]), t64([0]), t64([len(prompt) + i])))
        pos = len(prompt) + len(decodes)
        ref.append(alone.verify(t64(block), t64([0]), t64([pos])))

        batched = setup.hasher()
        slot = rng.randrange(1, NUM_SLOTS)
        others = rng.sample([s for s in range(NUM_SLOTS) if s != slot], rng.randint(1, 4))
        for s in others:
            batched.rebuild(s, rand_tokens(rng, 5))
        where = rng.randrange(len(others) + 1)
        slots = [*others[:where], slot, *others[where:]]
        runs = [prompt if s == slot else rand_tokens(rng, rng.randint(0, 6)) for s in slots]
        starts = [0 if s == slot else rng.randint(0, 9) for s in slots]
        flat = [tok for run in runs for tok in run] + [rng.choice(GARBAGE) for _ in range(3)]
        ids = batched.extend(t64(flat), t64(slots), t64(map(len, runs)), t64(starts))
        at = sum(map(len, runs[:where]))
        got = [ids[at : at + len(prompt)]]
        n_real = len(slots)
        pad_slots = [rng.choice(slots) for _ in range(2)]
        for i, tok in enumerate(decodes):
            toks = rand_tokens(rng, n_real) + [rng.choice(GARBAGE) for _ in pad_slots]
            toks[where] = tok
            positions = [rng.randint(10, 20) for _ in range(n_real + len(pad_slots))]
            positions[where] = len(prompt) + i
            out = batched.decode(t64(toks), t64(slots + pad_slots), t64(positions), n_real)
            got.append(out[where : where + 1])
        blocks = rand_tokens(rng, n_real * (1 + m))
        blocks[where * (1 + m) : (where + 1) * (1 + m)] = block
        positions = [rng.randint(10, 20) for _ in range(n_real)]
        positions[where] = pos
        out = batched.verify(t64(blocks), t64(slots), t64(positions))
        got.append(out[where * (1 + m) : (where + 1) * (1 + m)])

        assert torch.equal(torch.cat(got), torch.cat(ref))


def test_rebuild_equals_committed_history(setup):
    """rebuild(slot, tokens) gives the row that extend/decode/verify commits produced."""
    for length in range(0, 10):
        rng = random.Random(100 + length)
        prompt = rand_tokens(rng, length, image_rate=0.15)
        hasher = setup.hasher()
        hasher.rebuild(3, rand_tokens(rng, 3))  # a stale row: the commits must not keep it
        cut = rng.randint(0, length)
        extend_one(hasher, prompt[:cut], 3, 0)
        extend_one(hasher, prompt[cut:], 3, cut)
        seq = list(prompt)
        if length % 2:
            tok = rand_tokens(rng, 1)[0]
            hasher.decode(t64([tok]), t64([3]), t64([len(seq)]))
            seq.append(tok)
        else:
            block = rand_tokens(rng, 4)
            hasher.verify(t64(block), t64([3]), t64([len(seq)]))
            hasher.commit_verify(t64(block), t64([3]), t64([2]))
            seq += block[:3]
        hasher.rebuild(6, seq)
        assert row(hasher, 6) == row(hasher, 3) == oracle_history(seq, setup.n)
        nxt = t64(rand_tokens(rng, 3))
        a = hasher.extend(nxt, t64([3]), t64([3]), t64([len(seq)]))
        b = hasher.extend(nxt, t64([6]), t64([3]), t64([len(seq)]))
        assert torch.equal(a, b)


# --- dead tokens and pad value ------------------------------------------------------------------


def test_image_token_blocks_itself_and_older_shifts(setup):
    """An image mid-sequence (in the batch or in history) hashes as all-pad and cuts every later
    n-gram at the image: the tokens after it hash exactly like that suffix from position 0."""
    n = setup.n
    for seed in SEEDS:
        rng = random.Random(seed)
        seq = rand_tokens(rng, rng.randint(n + 2, 16), image_rate=0.0)
        img = rng.randrange(1, len(seq) - 1)
        seq[img] = IMAGE
        ids = setup.hasher().extend(t64(seq), t64([5]), t64([len(seq)]), t64([0])).tolist()
        assert ids == oracle_ids(setup.layout, setup.tmap, seq, IMAGE)
        assert ids[img] == setup.pad_ids()
        suffix = seq[img + 1 :]
        fresh = setup.hasher().extend(t64(suffix), t64([0]), t64([len(suffix)]), t64([0]))
        assert ids[img + 1 :] == fresh.tolist()

        # the image sits in history: a chunk starting right after it reads it as dead
        cut = img + 1
        chunked = setup.hasher()
        chunked.rebuild(2, seq[:cut])
        tail = chunked.extend(t64(seq[cut:]), t64([2]), t64([len(seq) - cut]), t64([cut]))
        assert tail.tolist() == ids[cut:]
        assert row(chunked, 2) == oracle_history(seq, n)


def test_mm_pad_ids_count_as_dead(setup):
    """With mm_pad_start, ids >= it (in history via rebuild, in the batch, in decode) are dead;
    without it, such an id is out of the tokenizer and rejected."""
    n = setup.n
    for seed in SEEDS:
        rng = random.Random(seed)
        hasher = setup.hasher(mm_pad_start=MM)
        mm_id = MM + rng.randrange(1000)
        prior = [*rand_tokens(rng, rng.randint(0, 3)), mm_id, *rand_tokens(rng, 2)]
        hasher.rebuild(4, prior)
        assert row(hasher, 4) == oracle_history(prior, n)
        chunk = rand_tokens(rng, 5, image_rate=0.0)
        chunk[rng.randrange(5)] = MM + rng.randrange(1000)
        ids = hasher.extend(t64(chunk), t64([4]), t64([len(chunk)]), t64([len(prior)]))
        seq = prior + chunk
        assert ids.tolist() == setup.expect(seq, range(len(prior), len(seq)), MM)
        # the same positions with the pad ids treated as ordinary tokens would differ
        live_view = [3 if tok >= MM else tok for tok in seq]
        assert ids.tolist() != setup.expect(live_view, range(len(prior), len(seq)), MM)
        for _ in range(n):
            tok = rng.choice([MM + 3, *rand_tokens(rng, 3)])
            out = hasher.decode(t64([tok]), t64([4]), t64([len(seq)]))
            seq.append(tok)
            assert out.tolist() == setup.expect(seq, [len(seq) - 1], MM)
            assert row(hasher, 4) == oracle_history(seq, n)
    with pytest.raises(ValueError):
        setup.hasher().extend(t64([1, MM + 1]), t64([0]), t64([2]), t64([0]))


def test_pad_value_is_token_map_of_pad_id(setup):
    """A position-0 token's 2-gram is hash(token_map[tok], token_map[pad_token_id]), which
    differs from padding with compressed id 0, the raw pad id or token_map[0]."""
    layout, tmap = setup.layout, setup.tmap
    heads = layout.config.n_heads
    pad_c = tmap[PAD]
    assert pad_c not in (0, PAD, tmap[0])
    toks = [t for t in range(0, V, 37) if t != IMAGE]
    hasher = setup.hasher(num_slots=len(toks))
    count = len(toks)
    ids = hasher.extend(t64(toks), t64(range(count)), t64([1] * count), t64([0] * count))

    def two_gram(c0: int, c1: int) -> list[list[int]]:
        out = []
        for layer in range(layout.config.num_layers):
            m0, m1 = layout.multipliers[layer][:2]
            r = (c0 * m0) ^ (c1 * m1)
            primes, offsets = layout.primes[layer], layout.offsets[layer]
            out.append([r % primes[h] + offsets[h] for h in range(heads)])
        return out

    for i, tok in enumerate(toks):
        got = ids[i, :, :heads].tolist()
        assert got == two_gram(tmap[tok], pad_c)
        for wrong in (0, PAD, tmap[0]):
            assert got != two_gram(tmap[tok], wrong)


def test_hash_at_top_of_compressed_vocab():
    """DeepSeek-like layout (layers 1 and 14, K = 99092) with compressed ids near K-1: int64 math
    matches the Python-int oracle, ids never negative and always inside their column."""
    cfg = make_config(
        4,
        8,
        layer_ids=(1, 14),
        vocab_size=16_000_000,
        compressed_vocab_size=99_092,
        image_token_id=None,
    )
    layout = EngramLayout.from_config(cfg)
    k = cfg.compressed_vocab_size
    assert max(max(m) for m in layout.multipliers) * (k - 1) > 2**62  # products near 2**63
    gen = torch.Generator().manual_seed(7)
    vocab = 64
    token_map = torch.randint(k - 8, k, (vocab,), generator=gen, dtype=torch.int64)
    token_map[::3] = k - 1
    hasher = EngramHasher(layout, token_map, num_slots=2)
    rng = random.Random(7)
    seq = [rng.randrange(vocab) for _ in range(40)]
    ids = hasher.extend(t64(seq[:32]), t64([1]), t64([32]), t64([0]))
    steps = [hasher.decode(t64([tok]), t64([1]), t64([32 + i])) for i, tok in enumerate(seq[32:])]
    ids = torch.cat([ids, *steps])
    lo = layout.offsets_tensor
    hi = lo + layout.primes_tensor
    assert bool((ids >= 0).all())
    assert bool(((ids >= lo) & (ids < hi)).all())
    assert ids.tolist() == oracle_ids(layout, token_map.tolist(), seq)


# --- errors -------------------------------------------------------------------------------------


def test_out_of_vocab_token_raises(setup):
    """Real token ids >= V or negative raise ValueError in every mode, before any commit."""
    hasher = setup.hasher()
    prefill(hasher, {0: [4, 5, 6], 1: [7]})
    before = hasher.history.table.clone()
    for bad in (V, V + 100, -1):
        with pytest.raises(ValueError):
            hasher.extend(t64([3, bad]), t64([0, 1]), t64([1, 1]), t64([3, 1]))
        with pytest.raises(ValueError):
            hasher.decode(t64([3, bad]), t64([0, 1]), t64([3, 1]))
        with pytest.raises(ValueError):
            hasher.verify(t64([3, 4, bad, 5]), t64([0, 1]), t64([3, 1]))
        assert torch.equal(hasher.history.table, before)


def test_image_id_outside_vocab_is_accepted():
    """An image_token_id >= V is not an out-of-range token: it hashes as all-pad."""
    layout = EngramLayout.from_config(make_config(4, 8, image_token_id=V + 5))
    token_map = torch.randint(0, K, (V,), generator=torch.Generator().manual_seed(5))
    hasher = EngramHasher(layout, token_map, num_slots=2)
    ids = hasher.extend(t64([1, V + 5, 9]), t64([0]), t64([3]), t64([0]))
    tmap = token_map.tolist()
    assert ids.tolist() == oracle_ids(layout, tmap, [1, V + 5, 9], V + 5)
    assert ids[1].tolist() == oracle_pad_ids(layout, tmap)


def test_slot_out_of_range_raises(setup):
    """Live slots outside [0, num_slots) raise ValueError in every mode and in rebuild."""
    hasher = setup.hasher()
    for bad in (NUM_SLOTS, NUM_SLOTS + 3, -1):
        with pytest.raises(ValueError):
            hasher.extend(t64([3, 4]), t64([0, bad]), t64([1, 1]), t64([0, 0]))
        with pytest.raises(ValueError):
            hasher.decode(t64([3, 4]), t64([bad, 0]), t64([0, 0]))
        with pytest.raises(ValueError):
            hasher.verify(t64([3, 4, 5, 6]), t64([0, bad]), t64([0, 0]))
        with pytest.raises(ValueError):
            hasher.rebuild(bad, [1, 2, 3])
    assert not hasher.history.table.any()


def test_padding_rows_with_garbage_do_not_raise(setup):
    """Garbage token ids (and positions) in padding rows are ignored by the range checks."""
    hasher = setup.hasher()
    prefill(hasher, {0: [4, 5, 6], 1: [7]})
    pad = setup.pad_ids()
    for bad in GARBAGE:
        ids = hasher.extend(t64([3, bad, bad]), t64([0]), t64([1]), t64([3]))
        assert ids[1:].tolist() == [pad, pad]
        ids = hasher.decode(t64([3, bad]), t64([1, 1]), t64([1, -5]), num_real=1)
        assert ids[1].tolist() == pad
        ids = hasher.verify(t64([3, 4, bad, bad]), t64([0, 0]), t64([4, 99]), num_real=1)
        assert ids[2:].tolist() == [pad, pad]
