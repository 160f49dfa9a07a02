"""Vectorised Engram hashing over one flat batch of many requests.

Every mode reduces to one core: for each token, its in-run offset, absolute position and history
slot. Shifts up to the offset read earlier tokens of the batch, older shifts read the request's
history row. Modes differ only in how they derive those three values and in when they commit.
"""

from __future__ import annotations

import numpy as np
import torch

from engramrt.engram.history import NgramHistory
from engramrt.engram.layout import EngramLayout
from engramrt.kernels import use_triton

DECODE, EXTEND, VERIFY = 0, 1, 2  # kernel modes (engramrt.kernels.engram_hash)

Count = int | torch.Tensor


class EngramHasher:
    """Hash ids ``[T, L, (N-1)*H]`` int64 plus the n-gram history they read and advance.

    ``vocab_size`` is the tokenizer length (ids at or beyond it are rejected unless they are
    image ids). ``mm_pad_start``: ids at or above it are multimodal pads and count as images.
    """

    def __init__(
        self,
        layout: EngramLayout,
        token_map: torch.Tensor,
        num_slots: int,
        device: torch.device | str = "cpu",
        mm_pad_start: int | None = None,
        kernels: bool | None = None,
    ):
        """``kernels``: use the Triton kernels (default: on CUDA, see ``engramrt.kernels``)."""
        cfg = layout.config
        self.layout = layout
        self.n = cfg.max_ngram_size
        self.vocab_size = token_map.numel()
        if not 0 <= cfg.pad_token_id < self.vocab_size:
            raise ValueError(
                f"engram_pad_token_id {cfg.pad_token_id} is outside the tokenizer (size "
                f"{self.vocab_size})"
            )
        self.image_token_id = cfg.image_token_id
        self.mm_pad_start = mm_pad_start
        self.token_map = token_map.to(device=device, dtype=torch.int64)
        n_layers, heads = cfg.num_layers, cfg.n_heads
        self.primes = layout.primes_tensor.view(n_layers, self.n - 1, heads).to(device)
        self.offsets = layout.offsets_tensor.view(n_layers, self.n - 1, heads).to(device)
        self.mults = layout.multipliers_tensor.to(device)
        self.history = NgramHistory(num_slots, self.n, device)
        self.device = torch.device(device)
        self.ops = None
        if use_triton(device) if kernels is None else kernels:
            from engramrt.kernels.engram_hash import TritonHashOps

            self.ops = TritonHashOps(self)

    # --- modes -------------------------------------------------------------------------------

    def extend(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        run_lens: torch.Tensor,
        start_pos: torch.Tensor,
        check: bool = True,
        commit: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Prefill or prefill chunks: request b owns the next ``run_lens[b]`` tokens, starting at
        absolute position ``start_pos[b]``. Tokens past ``sum(run_lens)`` are padding. History is
        committed after all hashes are computed; zero-length runs commit nowhere, and neither do
        runs where ``commit`` is 0 (speculative verify runs: ``commit_verify`` follows)."""
        tokens = tokens.long()
        bsz = slots.numel()
        if bsz == 0:
            raise ValueError("extend needs at least one request")
        lens = run_lens.long()
        if check:
            t = torch.arange(tokens.numel(), device=tokens.device)
            self._check(tokens, t < lens.sum(), slots)
            self._check_runs(tokens.numel(), slots, lens)
        if self.ops is not None:  # two launches: the hash (which finds the runs), the commit
            s, p = slots.long(), start_pos.long()
            starts = torch.empty_like(lens)
            ids = self.ops.hash(EXTEND, tokens, s, p, lens=lens, starts_out=starts)
            committed = lens if commit is None else lens * commit.long()
            self.ops.commit(tokens, s, starts, committed, p)  # after every program has read
            return ids
        ends = torch.cumsum(lens, 0)
        t = torch.arange(tokens.numel(), device=tokens.device)
        req = torch.searchsorted(ends, t, right=True)
        real = req < bsz
        req = req.clamp(max=bsz - 1)
        off = t - (ends - lens)[req]
        pos = start_pos.long()[req] + off
        slot = torch.where(real, slots.long()[req], self.history.pad_row)
        src = self._sources(tokens, slot, off)
        ids = self._hash(src, pos, real)
        if tokens.numel() == 0:  # nothing hashed, so nothing to commit
            return ids
        last = (ends - 1).clamp(min=0)
        keep = lens > 0 if commit is None else (lens > 0) & commit.bool()
        self.history.write(slots, self._commit_rows(src[last], pos[last]), keep)
        return ids

    def decode(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        num_real: Count | None = None,
        check: bool = True,
    ) -> torch.Tensor:
        """One token per request; hashes from the old row and commits in the same call.
        Rows at or past ``num_real`` are padding: all-pad ids, and they never commit."""
        tokens = tokens.long()
        if check:
            live = self._real_rows(tokens.numel(), num_real, tokens.device)
            self._check(tokens, live, slots[live])
        if self.ops is not None:  # one launch: nothing else runs on this path
            return self.ops.hash(DECODE, tokens, slots.long(), positions.long(), num_real=num_real)
        real = self._real_rows(tokens.numel(), num_real, tokens.device)
        slot = torch.where(real, slots.long(), self.history.pad_row)
        src = self._sources(tokens, slot, torch.zeros_like(tokens))
        pos = positions.long()
        ids = self._hash(src, pos, real)
        self.history.write(slot, self._commit_rows(src, pos), real)
        return ids

    def verify(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        positions: torch.Tensor,
        num_real: Count | None = None,
        check: bool = True,
    ) -> torch.Tensor:
        """Equal speculative blocks (anchor + drafts) per request, request-major; ``positions``
        is each anchor's absolute position. Reads history only: commit with ``commit_verify``
        after acceptance."""
        tokens = tokens.long()
        bsz = slots.numel()
        if bsz == 0 or tokens.numel() % bsz:
            raise ValueError(f"verify needs equal blocks: {tokens.numel()} tokens, {bsz} requests")
        block = tokens.numel() // bsz
        t = torch.arange(tokens.numel(), device=tokens.device)
        req, off = t // block, t % block
        real_req = self._real_rows(bsz, num_real, tokens.device)
        real = real_req[req]
        slot = torch.where(real, slots.long()[req], self.history.pad_row)
        if check:
            self._check(tokens, real, slots[real_req])
        if self.ops is not None:
            return self.ops.hash(
                VERIFY,
                tokens,
                slots.long(),
                positions.long(),
                num_real=num_real,
                verify_block=block,
            )
        pos = positions.long()[req] + off
        return self._hash(self._sources(tokens, slot, off), pos, real)

    def commit_verify(
        self,
        tokens: torch.Tensor,
        slots: torch.Tensor,
        num_accepted: torch.Tensor,
        num_real: Count | None = None,
        check: bool = True,
    ) -> None:
        """After acceptance: commit each block's anchor plus its ``num_accepted`` drafts
        (``check=False``: counts from the device, not read back to be checked)."""
        blocks = tokens.view(slots.numel(), -1)
        if self.ops is None:
            self.history.commit_verify(blocks, slots, num_accepted, num_real, check)
            return
        n_acc = self.history.check_verify(blocks, slots, num_accepted, num_real, check)
        bsz, block = blocks.shape
        starts = torch.arange(bsz, device=tokens.device) * block
        no_zeroing = torch.full((bsz,), self.n, device=tokens.device)  # rows are canonical
        self.ops.commit(tokens.long(), slots.long(), starts, 1 + n_acc, no_zeroing, num_real)

    def rebuild(self, slot: int, tokens_before: torch.Tensor | list[int]) -> None:
        tail = torch.as_tensor(tokens_before[-(self.n - 1) :], dtype=torch.int64).flatten()
        self._check(tail, torch.ones_like(tail, dtype=torch.bool), torch.tensor([slot]))
        self.history.rebuild(slot, tail)

    # --- core --------------------------------------------------------------------------------

    def is_dead(self, ids: torch.Tensor) -> torch.Tensor:
        """Image and multimodal-pad ids: they block their own shift and every older one."""
        dead = torch.zeros_like(ids, dtype=torch.bool)
        if self.image_token_id is not None:
            dead |= ids == self.image_token_id
        if self.mm_pad_start is not None:
            dead |= ids >= self.mm_pad_start
        return dead

    def _sources(self, tokens: torch.Tensor, slot: torch.Tensor, off: torch.Tensor) -> torch.Tensor:
        """Raw ids ``[T, N]`` at shifts 0..N-1 of every token."""
        shifts = torch.arange(1, self.n, device=tokens.device)
        t = torch.arange(tokens.numel(), device=tokens.device)
        in_batch = shifts <= off[:, None]
        earlier = tokens[(t[:, None] - shifts).clamp(min=0)]
        col = (self.n - 1 - shifts + off[:, None]).clamp(0, self.n - 2)
        stored = self.history.table[slot[:, None], col].long()
        return torch.cat([tokens[:, None], torch.where(in_batch, earlier, stored)], dim=1)

    def _hash(self, src: torch.Tensor, pos: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
        shifts = torch.arange(self.n, device=src.device)
        blocked = (pos[:, None] < shifts) | self.is_dead(src) | ~real[:, None]
        blocked = torch.cumsum(blocked, dim=1) > 0
        pad = self.layout.config.pad_token_id
        comp = self.token_map[torch.where(blocked, pad, src)]  # [T, N]
        prod = comp[:, None, :] * self.mults  # [T, L, N]; every product < 2**63
        grams = []
        acc = prod[..., 0]
        for s in range(1, self.n):
            acc = acc ^ prod[..., s]
            grams.append(acc)
        r = torch.stack(grams, dim=-1)[..., None]  # [T, L, N-1, 1]
        ids = r % self.primes + self.offsets
        return ids.flatten(2)

    def _commit_rows(self, src: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """New history rows (oldest first) after the token whose sources are ``src``."""
        rows = src[:, : self.n - 1].flip(1)  # shifts N-2 .. 0
        before_start = pos[:, None] < torch.arange(self.n - 2, -1, -1, device=src.device)
        return rows.masked_fill(before_start, 0)

    def _real_rows(self, rows: int, num_real: Count | None, device: torch.device) -> torch.Tensor:
        idx = torch.arange(rows, device=device)
        return idx < (rows if num_real is None else num_real)

    def validate(self, tokens: list[int]) -> None:
        """The token check of ``check=True`` on a host list, where tokens enter a stage (its
        token rows), so a device step never synchronises: ids inside the tokenizer plainly pass
        after one numpy reduction; anything else (image ids, errors) goes through the check."""
        t = np.asarray(tokens, dtype=np.int64)
        if t.size == 0 or (t.min() >= 0 and t.max() < self.vocab_size):
            return
        t = torch.from_numpy(t)
        self._check(t, torch.ones_like(t, dtype=torch.bool), torch.zeros(0, dtype=torch.int64))

    def _check_runs(self, num_tokens: int, slots: torch.Tensor, lens: torch.Tensor) -> None:
        if bool((lens < 0).any()) or int(lens.sum()) > num_tokens:
            raise ValueError(
                f"run lengths {lens.tolist()} must be >= 0 and sum to at most the {num_tokens} "
                "tokens given"
            )
        live = slots.long()[lens > 0].tolist()
        if len(set(live)) != len(live):
            raise ValueError(f"two runs in one extend share a slot: {live}")

    def _check(self, tokens: torch.Tensor, real: torch.Tensor, live_slots: torch.Tensor) -> None:
        """Host-synchronising input validation; graph-captured callers pass ``check=False``."""
        bad = real & ~self.is_dead(tokens) & ((tokens < 0) | (tokens >= self.vocab_size))
        if bool(bad.any()):
            raise ValueError(
                f"token ids {tokens[bad].unique().tolist()[:8]} are outside the tokenizer "
                f"[0, {self.vocab_size})"
            )
        s = live_slots.long()
        if bool(((s < 0) | (s >= self.history.num_slots)).any()):
            raise ValueError(f"slots must lie in [0, {self.history.num_slots}), got {s.tolist()}")
