"""Which requests run in the next step, and for how many tokens.

Running requests go first (decode, or the next chunk of a long prompt), then waiting ones are
admitted while the token budget, the sequence limit, history slots and KV blocks allow. A prompt
computes at most ``long_prefill_token_threshold`` tokens a step (vLLM's flag; 0: up to the
budget), which bounds how much longer a decode step that carries a prompt chunk takes than a
pure decode step (and, where the block manager keeps snapshots, a prompt's run ends on its last
full block boundary: ``BlockManager.cut``). A request that cannot get a block preempts the most
recently admitted running request, which gives back its blocks and slot and later recomputes
its tokens (its Engram history is rebuilt from them when it is admitted again).

With overlap scheduling a running request may have a sampled token the host has not read yet
(``Request.unread``): it counts as present (the next run computes it from the device), a request
whose sure pending tokens reach max_tokens is not scheduled again (a verify run in flight is sure
of one), and a preempted request waits until
its pending token is known before it is admitted again (its tokens are recomputed from the host).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from engramrt.engine.block_manager import BlockManager
from engramrt.engine.request import Request, Status


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        long_prefill_token_threshold: int = 0,
        propose: Callable[[Request, int], list[int]] | None = None,
        max_len: int | None = None,
    ):
        if long_prefill_token_threshold < 0:
            raise ValueError(
                f"long_prefill_token_threshold must be >= 0 (0: off), got "
                f"{long_prefill_token_threshold}"
            )
        self.blocks = blocks
        self.max_num_seqs, self.budget = max_num_seqs, max_num_batched_tokens
        self.chunk = long_prefill_token_threshold or max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.free_slots: list[int] = list(range(max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0
        # speculative drafts for a decoding request (at most the int given), or None: off
        self.propose = propose
        self.max_len = max_len  # positions a request may reach (the context length)

    @property
    def slots_in_use(self) -> int:
        return self.max_num_seqs - len(self.free_slots)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self) -> tuple[list[tuple[Request, int]], list[Request]]:
        """``(request, tokens to compute)`` pairs, and the requests admitted this step (their
        history rows must be rebuilt from the tokens already in the cache)."""
        budget, batch, admitted = self.budget, [], []
        for req in list(self.running):
            if budget == 0:
                break
            if req.status is not Status.RUNNING:  # preempted by an earlier request this step
                continue
            if req.length_capped:  # its last token is on the way: it finishes when applied
                continue
            if self.max_len is not None and req.num_computed >= self.max_len:
                continue  # a verify run in flight counted as accepted reaches the context's end
            n = min(req.num_tokens + req.unread - req.num_computed, budget, self.chunk)
            n = self.blocks.cut(req, req.num_computed, n)
            while not self.blocks.can_grow(req, req.num_computed + n):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is req:
                    break
            if req.status is not Status.RUNNING:
                continue
            req.drafts = []
            # a decoding run (its token the last one, known or pending) may carry drafts
            last = req.num_tokens + req.unread - req.num_computed
            if self.propose is not None and n == 1 == last:
                drafts = self.propose(req, budget - 1)  # KV for them only from free blocks
                if drafts and self.blocks.can_grow(req, req.num_computed + 1 + len(drafts)):
                    req.drafts, n = drafts, 1 + len(drafts)
            self.blocks.grow(req, req.num_computed + n)
            batch.append((req, n))
            budget -= n
        while self.waiting and budget > 0 and self.free_slots:
            req = self.waiting[0]
            if req.unread:  # preempted with a token in flight: admitted once it is known
                break
            if len(self.running) >= self.max_num_seqs or not self.blocks.can_admit(req):
                break
            self.waiting.popleft()
            self.blocks.admit(req)
            req.slot, req.status = self.free_slots.pop(), Status.RUNNING
            self.running.append(req)
            admitted.append(req)
            n = self.blocks.cut(
                req, req.num_computed, min(req.num_tokens - req.num_computed, budget, self.chunk)
            )
            batch.append((req, n))
            budget -= n
        return batch, admitted

    def preempt(self, req: Request) -> None:
        self._release(req)
        req.status, req.num_computed = Status.WAITING, 0
        req.drafts = []  # its last verify run's: none when it is admitted again
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str) -> None:
        if req.status is Status.WAITING and req in self.waiting:
            self.waiting.remove(req)
        elif req.status is Status.RUNNING:
            self._release(req)
        req.status, req.finish_reason = Status.FINISHED, reason

    def _release(self, req: Request) -> None:
        self.running.remove(req)
        self.blocks.release(req)
        self.free_slots.append(req.slot)
        req.slot = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
