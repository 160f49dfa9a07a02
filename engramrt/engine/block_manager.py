"""Paged KV blocks with reference counts and prefix caching of full blocks.

A full block is keyed by a SHA-256 chain over its tokens and every token before it; a new
request whose prompt starts with cached blocks shares them (its own tokens compared too). Freed
blocks keep their key until reused, so a finished request's prefix can still be hit. A request
remembers the key of its last registered block, so registering extends the chain by the new
blocks only: the work per step does not grow with the context.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

from engramrt.engine.request import Request


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, prefix_caching: bool = True, snapshots: int = 0
    ):
        self.num_blocks, self.block_size = num_blocks, block_size
        self.prefix_caching = prefix_caching
        self.snapshots = snapshots if prefix_caching else 0
        self.snapshot_of: dict[int, int] = {}  # block -> its snapshot
        # snapshot -> its block, least recently used first
        self.snapshot_lru: OrderedDict[int, int] = OrderedDict()
        self.free_snapshots = list(range(self.snapshots))
        self.ref = [0] * num_blocks
        self.key: list[bytes | None] = [None] * num_blocks
        self.tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.by_key: dict[bytes, int] = {}
        # free blocks, least recently freed first; an OrderedDict so a cached block can be
        # revived from the middle in O(1)
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.queries = self.hits = 0  # prefix-cache counters, in tokens

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _take(self) -> int:
        block, _ = self.free.popitem(last=False)
        if self.key[block] is not None:  # reused: its old prefix can no longer be hit
            self.by_key.pop(self.key[block], None)
            self.key[block] = self.tokens[block] = None
        snapshot = self.snapshot_of.pop(block, None)
        if snapshot is not None:
            del self.snapshot_lru[snapshot]
            self.free_snapshots.append(snapshot)
        self.ref[block] = 1
        return block

    @staticmethod
    def _chain(prev: bytes | None, toks: tuple[int, ...]) -> bytes:
        """SHA-256 over the previous key and this block's tokens: a prefix's identity, with no
        practical collisions (Python's ``hash`` would let two prefixes share cached K/V)."""
        h = hashlib.sha256(prev or b"")
        h.update(array("q", toks).tobytes())
        return h.digest()

    def _block_tokens(self, req: Request, i: int) -> tuple[int, ...]:
        return tuple(req.token_ids[i * self.block_size : (i + 1) * self.block_size])

    def can_admit(self, req: Request) -> bool:
        return self.blocks_for(req.num_tokens) <= self.num_free

    def admit(self, req: Request) -> None:
        """Blocks for every known token; reuse cached full blocks of the prefix (with snapshots:
        up to the last one that has a snapshot). At least the last token is always left to
        compute, so the request produces logits."""
        req.blocks, req.num_computed, req.prefix_key = [], 0, None
        req.snapshot = req.window_snapshot = None
        # prompt logprobs must score every prompt token, so such requests compute them all
        use_cache = self.prefix_caching and req.params.prompt_logprobs is None
        cacheable = (req.num_tokens - 1) // self.block_size if use_cache else 0
        self.queries += req.num_tokens
        hits, key = [], None
        for i in range(cacheable):
            toks = self._block_tokens(req, i)
            key = self._chain(key, toks)
            block = self.by_key.get(key)
            if block is None or self.tokens[block] != toks:  # a miss, or a collision
                break
            hits.append((block, key))
        while self.snapshots and hits and hits[-1][0] not in self.snapshot_of:
            hits.pop()
        if hits and self.snapshots:
            req.snapshot = self.snapshot_of[hits[-1][0]]
            self.snapshot_lru.move_to_end(req.snapshot)
        for block, key in hits:
            if self.ref[block] == 0:
                del self.free[block]
            self.ref[block] += 1
            req.blocks.append(block)
            req.num_computed += self.block_size
            req.prefix_key = key
        req.num_hashed_blocks = len(req.blocks)
        self.hits += req.num_computed
        while len(req.blocks) < self.blocks_for(req.num_tokens):
            req.blocks.append(self._take())

    def _edge(self, req: Request) -> int:
        """The last full block boundary before the request's last token: where a repeat of
        its tokens would hit (a request always computes its last token)."""
        return (req.num_tokens - 1) // self.block_size * self.block_size

    def cut(self, req: Request, start: int, n: int) -> int:
        """A run of ``n`` tokens from ``start``, shortened with snapshots to end on ``_edge``
        if it would cross it, so that the whole prompt's prefix gets a snapshot."""
        if not self.snapshots or req.params.prompt_logprobs is not None:
            return n
        edge = self._edge(req)
        return edge - start if start < edge < start + n else n

    def keep_window(self, req: Request, end: int) -> int | None:
        """The snapshot that keeps the state a run of ``req`` leaves at ``end`` (a block
        boundary); None when there is none to keep. A request keeps two: its prompt's
        (``_edge``) and its latest, which moves on as it decodes (a request's every boundary
        would crowd out every other prefix). A new one takes a free snapshot or the least
        recently used."""
        if not self.snapshots or end % self.block_size or not end:
            return None
        block = req.blocks[end // self.block_size - 1]
        if block in self.snapshot_of:
            return None
        moving = end != self._edge(req)
        latest = req.window_snapshot
        if moving and latest is not None and self.snapshot_lru.get(latest[0]) == latest[1]:
            snapshot = latest[0]
            del self.snapshot_of[latest[1]]
        elif self.free_snapshots:
            snapshot = self.free_snapshots.pop()
        else:
            snapshot, old = self.snapshot_lru.popitem(last=False)
            del self.snapshot_of[old]
        if moving:
            req.window_snapshot = (snapshot, block)
        self.snapshot_of[block], self.snapshot_lru[snapshot] = snapshot, block
        self.snapshot_lru.move_to_end(snapshot)
        return snapshot

    def can_grow(self, req: Request, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(req.blocks) <= self.num_free

    def grow(self, req: Request, num_tokens: int) -> None:
        while len(req.blocks) < self.blocks_for(num_tokens):
            req.blocks.append(self._take())

    def shrink(self, req: Request, num_tokens: int) -> None:
        """Give back the blocks past ``num_tokens`` (a verify step's rejected drafts): fresh
        blocks, never registered, so they are simply free again."""
        while len(req.blocks) > max(self.blocks_for(num_tokens), req.num_hashed_blocks):
            block = req.blocks.pop()
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free[block] = None

    def register(self, req: Request) -> None:
        """Make the request's newly completed full blocks findable by later prompts: those
        whose tokens the host knows (a pending token is not; the K/V of a launched step may still
        be on the way, but every step that could read it runs after it on the stream)."""
        if not self.prefix_caching:
            return
        for i in range(
            req.num_hashed_blocks, min(req.num_computed, req.num_tokens) // self.block_size
        ):
            toks = self._block_tokens(req, i)
            req.prefix_key = key = self._chain(req.prefix_key, toks)
            block = req.blocks[i]
            if key not in self.by_key:
                self.by_key[key] = block
                self.key[block], self.tokens[block] = key, toks
            req.num_hashed_blocks = i + 1

    def release(self, req: Request) -> None:
        for block in reversed(req.blocks):
            self.ref[block] -= 1
            if self.ref[block] == 0:
                self.free[block] = None
        req.blocks, req.num_hashed_blocks, req.prefix_key = [], 0, None
