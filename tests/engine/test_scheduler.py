"""Scheduler with a BlockManager, driven the way the engine drives them, with no model.

``Sim`` stands in for the engine: it advances ``num_computed``, registers blocks, appends a
"sampled" token and finishes requests. Its fake KV cache records, for every slot a step writes,
the token prefix whose K/V a model would store there, and the sampled token is a function of what
the last position reads back, so a wrongly shared or overwritten block changes the output. Every
step is checked against the scheduling rules (budget, order, preemption victims, FIFO admission)
and the bookkeeping invariants (ref counts, free list, history slots, prefix-chain keys).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import pytest

from engramrt.engine.block_manager import BlockManager
from engramrt.engine.request import Request, SamplingParams, Status
from engramrt.engine.scheduler import Scheduler
from tests.engine.test_block_manager import oracle_keys

Batch = list[tuple[Request, int]]


def next_token(prefix: Sequence[int]) -> int:
    """The fake model: the next token as a function of the whole prefix."""
    return (sum(i * t for i, t in enumerate(prefix, 1)) + 7 * len(prefix)) % 5


def reference_output(prompt: Sequence[int], max_tokens: int) -> list[int]:
    """What a request generates alone, with its K/V never shared, chunked or preempted."""
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


def req(rid: str, prompt: Sequence[int], max_tokens: int = 4, **params: int) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params))


def ids(reqs: Sequence[Request]) -> list[str]:
    return [r.id for r in reqs]


def pairs(batch: Batch) -> list[tuple[str, int]]:
    return [(r.id, n) for r, n in batch]


class Sim:
    """The engine's per-step bookkeeping around ``Scheduler.schedule``, checked every step."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        max_num_seqs: int,
        budget: int,
        prefix_caching: bool = True,
        chunk: int = 0,
    ) -> None:
        self.bm = BlockManager(num_blocks, block_size, prefix_caching)
        self.s = Scheduler(self.bm, max_num_seqs, budget, chunk)
        self.chunk = chunk
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> prefix
        self.seq: dict[str, int] = {}  # request id -> when it was last admitted
        self.first_admissions: list[str] = []
        self.arrivals: list[str] = []
        self.num_admissions = 0

    def add(self, *reqs: Request) -> None:
        for r in reqs:
            self.s.add(r)
            self.arrivals.append(r.id)

    def abort(self, r: Request) -> None:
        self.s.finish(r, "abort")
        check_invariants(self)

    def step(self) -> tuple[Batch, list[Request]]:
        s, bm = self.s, self.bm
        running, waiting = list(s.running), list(s.waiting)
        preemptions = {r.id: r.num_preemptions for r in running}
        batch, admitted = s.schedule()
        check_schedule(self, running, waiting, preemptions, batch, admitted)
        for r in admitted:
            if r.id not in self.seq:
                self.first_admissions.append(r.id)
            self.seq[r.id] = self.num_admissions
            self.num_admissions += 1
        for r, n in batch:  # the forward pass writes K/V for the whole batch
            self.write(r, n)
        for r, n in batch:
            r.num_computed += n
            bm.register(r)
            if r.num_computed == r.num_tokens:
                r.token_ids.append(self.sample(r))
                if r.num_output_tokens >= r.params.max_tokens:
                    s.finish(r, "length")
        check_invariants(self)
        return batch, admitted

    def write(self, r: Request, n: int) -> None:
        bs = self.bm.block_size
        for p in range(r.num_computed, r.num_computed + n):
            b = r.blocks[p // bs]
            assert self.bm.ref[b] == 1, f"{r.id} writes block {b}, which others read"
            assert self.bm.key[b] is None, f"{r.id} writes block {b}, which prompts can find"
            self.kv[b, p % bs] = tuple(r.token_ids[: p + 1])

    def sample(self, r: Request) -> int:
        """The next token from what the request's last position reads through its blocks."""
        p, bs = r.num_tokens - 1, self.bm.block_size
        return next_token(self.kv[r.blocks[p // bs], p % bs])

    def run(self, max_steps: int) -> int:
        for steps in range(max_steps):
            if not self.s.has_work():
                return steps
            self.step()
        raise AssertionError(f"still working after {max_steps} steps")


def check_schedule(
    sim: Sim,
    running: list[Request],
    waiting: list[Request],
    preemptions: dict[str, int],
    batch: Batch,
    admitted: list[Request],
) -> None:
    """One ``schedule()`` against its rules, given the running and waiting lists before it."""
    s, bm = sim.s, sim.bm
    bs = bm.block_size
    # victims are the most recently admitted (the tail of the running list), each at most once
    preempted = [r for r in running if r.num_preemptions > preemptions[r.id]]
    assert all(r.num_preemptions == preemptions[r.id] + 1 for r in preempted)
    assert ids(preempted) == ids(running[len(running) - len(preempted) :])
    survivors = running[: len(running) - len(preempted)]
    # running requests first, in order, until the budget runs out; then admissions
    served = [r for r, _ in batch[: len(batch) - len(admitted)]]
    assert ids([r for r, _ in batch[len(served) :]]) == ids(admitted)
    assert ids(served) == ids(survivors[: len(served)])
    left = s.budget
    for r, n in batch:  # each gets what it still needs, capped by what is left of the budget
        cap = sim.chunk or left  # and by the long-prefill threshold
        assert n == min(r.num_tokens - r.num_computed, left, cap) >= 1
        assert len(r.blocks) >= bm.blocks_for(r.num_computed + n)
        left -= n
    assert left >= 0
    if len(served) < len(survivors):
        assert left == 0 and not admitted
    # admission is FIFO from a queue whose head holds this step's victims, oldest first
    queue = preempted + waiting
    assert ids(admitted) == ids(queue[: len(admitted)])
    assert ids(s.waiting) == ids(queue[len(admitted) :])
    for r in admitted:  # each starts at the longest cached prefix, last token left to compute
        assert r.status is Status.RUNNING and 0 <= r.num_computed < r.num_tokens
        if not bm.prefix_caching or r.params.prompt_logprobs is not None:
            assert r.num_computed == 0
            continue
        hit, keys = r.num_computed // bs, oracle_keys(r.token_ids, bs)
        assert r.num_computed == hit * bs and hit <= (r.num_tokens - 1) // bs
        assert [bm.key[b] for b in r.blocks[:hit]] == keys[:hit]
        if hit < (r.num_tokens - 1) // bs:  # nothing is registered during schedule()
            assert keys[hit] not in bm.by_key
    # a request is left waiting only when budget, slots or free blocks rule it out
    if s.waiting and left > 0 and s.free_slots:
        assert not bm.can_admit(s.waiting[0])


def check_invariants(sim: Sim) -> None:
    """Bookkeeping between steps: ref counts, free list, keys, history slots, queue states, and
    that every computed position of a running request reads its own prefix's K/V."""
    s, bm = sim.s, sim.bm
    bs = bm.block_size
    for b in range(bm.num_blocks):
        assert bm.ref[b] == sum(r.blocks.count(b) for r in s.running), b
    assert set(bm.free) == {b for b in range(bm.num_blocks) if bm.ref[b] == 0}
    assert bm.num_free == sum(ref == 0 for ref in bm.ref)
    assert len(bm.by_key) == sum(k is not None for k in bm.key)
    for key, b in bm.by_key.items():  # a findable block holds the K/V of the prefix its key names
        prefix = sim.kv[b, bs - 1]
        assert bm.key[b] == key == oracle_keys(prefix, bs)[-1]
        assert bm.tokens[b] == prefix[-bs:]
        for j in range(bs):
            assert sim.kv[b, j] == prefix[: len(prefix) - bs + j + 1]

    slots = [r.slot for r in s.running]
    assert len(s.running) <= s.max_num_seqs and s.slots_in_use == len(s.running)
    assert len(set(slots)) == len(slots) and None not in slots
    assert sorted([*slots, *s.free_slots]) == list(range(s.max_num_seqs))
    assert len({r.id for r in [*s.running, *s.waiting]}) == len(s.running) + len(s.waiting)
    order = [sim.seq[r.id] for r in s.running]
    assert order == sorted(order), "running is not in admission order"
    for r in s.waiting:
        assert r.status is Status.WAITING and r.slot is None and r.blocks == []
        assert r.num_computed == 0
    for r in s.running:
        assert r.status is Status.RUNNING and len(set(r.blocks)) == len(r.blocks)
        assert bm.blocks_for(r.num_computed) <= len(r.blocks) <= bm.blocks_for(r.num_tokens)
        for p in range(r.num_computed):
            assert sim.kv[r.blocks[p // bs], p % bs] == tuple(r.token_ids[: p + 1]), (r.id, p)
        full = r.num_computed // bs if bm.prefix_caching else 0
        keys = oracle_keys(r.token_ids[: full * bs], bs)
        assert r.num_hashed_blocks == full
        assert r.prefix_key == (keys[-1] if keys else None)


def assert_idle(sim: Sim) -> None:
    """Nothing queued or running: every block free with ref 0, every history slot free."""
    s, bm = sim.s, sim.bm
    assert not s.running and not s.waiting and not s.has_work()
    assert bm.num_free == bm.num_blocks and set(bm.ref) == {0}
    assert sorted(s.free_slots) == list(range(s.max_num_seqs)) and s.slots_in_use == 0


def assert_finished(r: Request, reason: str = "length") -> None:
    assert r.status is Status.FINISHED and r.finish_reason == reason
    assert r.slot is None and r.blocks == []
    if reason == "length":
        assert r.output_ids == reference_output(r.prompt_ids, r.params.max_tokens)


# --- admission and budgets -----------------------------------------------------------------------


@pytest.mark.parametrize(("budget", "prompt_len"), [(1, 5), (4, 17), (8, 8), (16, 3), (5, 23)])
def test_budget_is_the_chunk_size_of_a_long_prompt(budget: int, prompt_len: int) -> None:
    """A prompt is computed in chunks of the token budget (the last one shorter), then one token
    per step; the batch never exceeds the budget."""
    sim = Sim(64, 4, 4, budget)
    r = req("r", [i % 5 for i in range(prompt_len)], max_tokens=3)
    sim.add(r)
    sizes = []
    while sim.s.has_work():
        batch, _ = sim.step()
        sizes.append(sum(n for _, n in batch))
    full, rest = divmod(prompt_len, budget)
    assert sizes == [budget] * full + [rest] * (rest > 0) + [1] * (r.params.max_tokens - 1)
    assert_finished(r)
    assert_idle(sim)


@pytest.mark.parametrize("seed", range(6))
def test_long_prefill_threshold_caps_each_prompts_tokens_per_step(seed: int) -> None:
    """Random prompts arriving over time: no run computes more than the threshold, steps stay
    within the budget, and everything still finishes with the reference output; with prompts
    waiting, a step fills the budget up to what the threshold lets each prompt take."""
    rng = random.Random(seed)
    chunk, budget = rng.choice([1, 3, 5, 8]), rng.choice([8, 12, 16])
    sim = Sim(256, 4, 4, budget, chunk=chunk)
    reqs = [
        req(
            str(i),
            [rng.randrange(5) for _ in range(rng.randint(1, 30))],
            max_tokens=rng.randint(1, 5),
        )
        for i in range(10)
    ]
    steps = 0
    while reqs or sim.s.has_work():
        if reqs and rng.random() < 0.4:
            sim.add(reqs.pop())
        batch, _ = sim.step()
        assert all(n <= chunk for _, n in batch) and sum(n for _, n in batch) <= budget
        steps += 1
        assert steps < 2000
    assert_idle(sim)


def test_a_negative_threshold_is_refused() -> None:
    with pytest.raises(ValueError, match="long_prefill_token_threshold must be >= 0"):
        Scheduler(BlockManager(8, 4), 2, 16, -1)


def test_running_requests_are_served_before_waiting_ones() -> None:
    """A waiting request gets only what the running ones leave of the budget, and nothing while
    a running prompt still takes all of it."""
    sim = Sim(64, 4, 4, budget=8)
    a = req("a", [1] * 20)
    sim.add(a)
    assert pairs(sim.step()[0]) == [("a", 8)]
    b = req("b", [2] * 10)
    sim.add(b)
    batch, admitted = sim.step()
    assert pairs(batch) == [("a", 8)] and admitted == [] and ids(sim.s.waiting) == ["b"]
    batch, admitted = sim.step()
    assert pairs(batch) == [("a", 4), ("b", 4)] and ids(admitted) == ["b"]
    assert pairs(sim.step()[0]) == [("a", 1), ("b", 6)]
    sim.run(50)
    assert_finished(a)
    assert_finished(b)
    assert_idle(sim)


def test_max_num_seqs_and_history_slots_bound_the_running_set() -> None:
    """At most ``max_num_seqs`` requests run, each on its own history slot; the rest are admitted
    in arrival order as slots free up, reusing the freed slots."""
    sim = Sim(64, 2, max_num_seqs=2, budget=64)
    reqs = [req(f"r{i}", [i, i + 1, i + 2], max_tokens=2 + i) for i in range(5)]
    sim.add(*reqs)
    peak = 0
    while sim.s.has_work():
        sim.step()
        peak = max(peak, len(sim.s.running))
        assert {r.slot for r in sim.s.running} <= {0, 1}
    assert peak == 2
    assert sim.first_admissions == ids(reqs)
    for r in reqs:
        assert_finished(r)
    assert_idle(sim)


def test_request_waits_for_free_blocks_in_fifo_order() -> None:
    """A request whose blocks do not fit waits, and a smaller one behind it waits too (strict
    FIFO); both are admitted, in order, once the blocks are freed."""
    sim = Sim(4, 4, max_num_seqs=4, budget=64, prefix_caching=False)
    a, b, c = req("a", range(9), max_tokens=2), req("b", range(8)), req("c", [0])
    sim.add(a, b, c)
    _, admitted = sim.step()
    assert ids(admitted) == ["a"] and ids(sim.s.waiting) == ["b", "c"]
    assert sim.bm.num_free == 1 and sim.bm.can_admit(c) and not sim.bm.can_admit(b)
    _, admitted = sim.step()  # a finishes this step; b and c wait until the next
    assert admitted == [] and a.status is Status.FINISHED
    _, admitted = sim.step()
    assert ids(admitted) == ["b", "c"]
    sim.run(50)
    for r in (a, b, c):
        assert_finished(r)
    assert_idle(sim)


# --- preemption ----------------------------------------------------------------------------------


def test_growth_preempts_the_most_recently_admitted() -> None:
    """Four decoding requests fill the cache; the first two each need a block, so the last two
    are preempted, newest first: blocks and slots freed, ``num_computed`` back to 0, queued at the
    head in admission order. Later they are re-admitted and recompute everything."""
    sim = Sim(4, 2, max_num_seqs=4, budget=64, prefix_caching=False)
    a, b, c, d = (req(x, [i, i]) for i, x in enumerate("abcd"))
    sim.add(a, b, c, d)
    sim.step()
    assert sim.bm.num_free == 0 and all(r.num_tokens == 3 for r in (a, b, c, d))
    slots = {r.id: r.slot for r in (c, d)}
    batch, admitted = sim.step()
    assert pairs(batch) == [("a", 1), ("b", 1)] and admitted == []
    assert ids(sim.s.waiting) == ["c", "d"] and sim.s.num_preemptions == 2
    for r in (c, d):
        assert r.status is Status.WAITING and r.num_preemptions == 1
        assert r.num_computed == 0 and r.blocks == [] and r.slot is None
        assert slots[r.id] in sim.s.free_slots
    recompute: dict[str, int] = {}  # the first chunk of each request's first re-admission
    while sim.s.has_work():
        batch, admitted = sim.step()
        for r, n in batch:
            if r.id in "cd" and any(r is x for x in admitted):
                recompute.setdefault(r.id, n)
    assert recompute == {"c": 3, "d": 3}  # prompt and the token sampled before preemption
    for r in (a, b, c, d):
        assert_finished(r)
    assert_idle(sim)


def test_request_preempts_itself_when_it_is_the_newest() -> None:
    """When the request that cannot grow is the most recently admitted, it is the victim: it is
    dropped from this step's batch and queued first."""
    sim = Sim(3, 2, max_num_seqs=4, budget=64, prefix_caching=False)
    a, b = req("a", [1, 2, 3]), req("b", [4, 5])
    sim.add(a, b)
    sim.step()
    assert sim.bm.num_free == 0
    batch, admitted = sim.step()  # a has room for its 4th token; b needs a block for its 3rd
    assert pairs(batch) == [("a", 1)] and admitted == []
    assert ids(sim.s.waiting) == ["b"] and b.num_preemptions == 1 and b.blocks == []
    sim.run(50)
    assert_finished(a)
    assert_finished(b)
    assert_idle(sim)


def test_preempted_request_resumes_from_its_cached_blocks() -> None:
    """With prefix caching, a preempted request's registered blocks stay cached: when it is
    re-admitted it revives them and computes only the rest (``check_schedule`` proves the hit is
    the longest cached prefix)."""
    bs = 2
    sim = Sim(6, bs, max_num_seqs=2, budget=64)
    a, b = req("a", [1, 2, 3, 4, 0], max_tokens=6), req("b", [3, 3, 3, 3, 3], max_tokens=6)
    sim.add(a, b)
    held: list[int] = []
    while b.num_preemptions == 0:
        held = list(b.blocks)
        sim.step()
    assert b.status is Status.WAITING
    while True:
        total = b.num_tokens
        batch, admitted = sim.step()
        if any(r is b for r in admitted):
            break
    n = next(n for r, n in batch if r is b)
    hit = (total - n) // bs
    assert hit > 0 and total - n == hit * bs
    assert b.blocks[:hit] == held[:hit]
    sim.run(50)
    assert_finished(a)
    assert_finished(b)
    assert_idle(sim)


# --- prefix hits through the scheduler -----------------------------------------------------------


def test_admitted_request_starts_at_its_prefix_hit() -> None:
    """A request sharing a running one's prompt prefix shares its full blocks (ref 2) and its
    first chunk is only what is not cached; a prompt-logprobs twin computes everything."""
    bs = 4
    sim = Sim(32, bs, max_num_seqs=4, budget=64)
    prompt = [1, 2, 3, 4, 1, 2, 3, 4, 0, 1]
    a = req("a", prompt, max_tokens=8)
    sim.add(a)
    sim.step()
    b, p = req("b", [*prompt, 4]), req("p", prompt, prompt_logprobs=1)
    sim.add(b, p)
    sizes = {r.id: r.num_tokens for r in (b, p)}
    batch, admitted = sim.step()
    assert ids(admitted) == ["b", "p"]
    assert [(r.id, n) for r, n in batch[1:]] == [("b", sizes["b"] - 2 * bs), ("p", sizes["p"])]
    assert b.blocks[:2] == a.blocks[:2] and [sim.bm.ref[x] for x in a.blocks[:2]] == [2, 2]
    assert not set(p.blocks) & set(a.blocks)
    sim.run(50)
    for r in (a, b, p):
        assert_finished(r)
    assert_idle(sim)


# --- freeing on every exit path ------------------------------------------------------------------


@pytest.mark.parametrize(
    "path", ["finish", "abort_waiting", "abort_running", "abort_mid_prompt", "abort_preempted"]
)
def test_every_exit_path_frees_everything(path: str) -> None:
    """Finishing, aborting a waiting, running, half-prefilled or preempted request: once all are
    gone, blocks, ref counts and history slots are back to the idle state."""
    bs = 2
    sim = Sim(6, bs, max_num_seqs=2, budget=4)
    a = req("a", [1, 2, 3, 4, 1], max_tokens=6)
    b = req("b", [1, 2, 3, 4, 2], max_tokens=6)  # shares a's first two blocks, later preempted
    c = req("c", [4, 4], max_tokens=2)
    sim.add(a, b, c)
    aborted = None
    if path == "abort_waiting":
        sim.step()
        aborted = c
    elif path == "abort_running":
        while a.num_output_tokens == 0:
            sim.step()
        aborted = a
    elif path == "abort_mid_prompt":
        sim.step()
        assert 0 < a.num_computed < a.num_prompt_tokens
        aborted = a
    elif path == "abort_preempted":
        while a.num_preemptions + b.num_preemptions == 0:
            sim.step()
        aborted = b if b.num_preemptions else a
        assert aborted.status is Status.WAITING
    if aborted is not None:
        sim.abort(aborted)
        assert_finished(aborted, "abort")
        assert all(r is not aborted for r in [*sim.s.running, *sim.s.waiting])
    sim.run(100)
    for r in (a, b, c):
        if r is not aborted:
            assert_finished(r)
    assert_idle(sim)


# --- randomized ----------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(24))
def test_random_workload_keeps_invariants_and_finishes_everything(seed: int) -> None:
    """Random arrivals, prompts with shared prefixes, block sizes, cache sizes, budgets, slot
    limits, prompt-logprobs requests and aborts for a few hundred steps, every step checked; then
    every request finishes with the output it would have had alone."""
    rng = random.Random(seed)
    bs = rng.choice([1, 2, 3, 4, 8])
    max_prompt, max_out = 24, 10
    need = -(-(max_prompt + max_out) // bs)  # the engine refuses requests that never fit
    sim = Sim(
        num_blocks=need + rng.choice([0, rng.randint(0, need), rng.randint(0, 3 * need)]),
        block_size=bs,
        max_num_seqs=rng.randint(1, 6),
        budget=rng.randint(1, 40),
        prefix_caching=rng.random() < 0.8,
    )
    bases = [[rng.randrange(5) for _ in range(max_prompt)] for _ in range(3)]
    reqs: list[Request] = []
    aborted: set[str] = set()
    for _step in range(300):
        if len(reqs) < 60 and rng.random() < 0.4:
            for _ in range(rng.randint(1, 3)):
                cut = rng.randint(0, max_prompt)
                prompt = rng.choice(bases)[:cut]
                prompt += [rng.randrange(5) for _ in range(rng.randint(1, max_prompt - cut + 1))]
                prompt = prompt[:max_prompt]
                r = req(
                    f"r{len(reqs)}",
                    prompt,
                    max_tokens=rng.randint(1, max_out),
                    prompt_logprobs=0 if rng.random() < 0.1 else None,
                )
                reqs.append(r)
                sim.add(r)
        live = [*sim.s.running, *sim.s.waiting]
        if live and rng.random() < 0.04:
            victim = rng.choice(live)
            aborted.add(victim.id)
            sim.abort(victim)
        sim.step()
    sim.run(2000)
    assert_idle(sim)
    assert set(sim.first_admissions) <= set(sim.arrivals)
    admitted_order = [x for x in sim.arrivals if x in set(sim.first_admissions)]
    assert sim.first_admissions == admitted_order, "first admissions are not FIFO"
    for r in reqs:
        assert_finished(r, "abort" if r.id in aborted else "length")
    assert reqs and len(aborted) < len(reqs)


def test_pending_tokens_count_as_present() -> None:
    """Overlap scheduling: a running request's token that the host has not read is computed
    from the device (one more position), a request whose pending tokens reach max_tokens is not
    scheduled again, and a preempted request with a token in flight waits until it is known."""
    bm = BlockManager(8, 4)
    s = Scheduler(bm, 4, 64)
    a = req("a", [1, 2, 3], max_tokens=2)
    s.add(a)
    batch, admitted = s.schedule()
    assert pairs(batch) == [("a", 3)] and admitted == [a]
    a.num_computed, a.unread = 3, 1  # launched; its token not read yet
    assert pairs(s.schedule()[0]) == [("a", 1)]  # the pending token, from the device
    a.token_ids.append(4)
    a.num_computed, a.unread = 4, 1  # the second output on the way: max_tokens is reached
    assert s.schedule() == ([], [])
    s.preempt(a)
    assert s.schedule() == ([], [])  # not admitted while its token is in flight
    a.token_ids.append(5)
    a.unread = 0
    batch, admitted = s.schedule()
    assert admitted == [a] and pairs(batch) == [("a", 5)]


def test_a_verify_run_in_flight_is_sure_of_one_token() -> None:
    """Overlap with speculation: a verify run of two drafts in flight counts all three of its
    tokens for positions (its next run starts after them) but only one for max_tokens, and a
    request whose counted position reaches the context's end waits."""
    for max_tokens, max_len, scheduled in ((2, 64, False), (3, 64, True), (3, 6, False)):
        s = Scheduler(BlockManager(8, 4), 4, 64, max_len=max_len)
        a = req("a", [1, 2, 3], max_tokens=max_tokens)
        s.add(a)
        s.schedule()
        a.token_ids.append(4)  # the prompt's sample, read
        a.num_computed, a.unread = 6, 3  # the anchor at 3 and two drafts, in flight
        want = [("a", 1)] if scheduled else []
        assert pairs(s.schedule()[0]) == want, (max_tokens, max_len)
