"""Per-request n-gram history: the N-1 raw token ids before each request's next token.

Rows are oldest first and addressed by request slot; the extra last row is a sink that padding
writes into, so a padded batch row can never disturb a live request even when it aliases its slot.
Entries that would lie before a request's first token are stored as 0, which makes a row a pure
function of the request's tokens: a rebuilt row equals the row the commits produced.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engramrt.transfer import to_device


class NgramHistory:
    def __init__(self, num_slots: int, max_ngram_size: int, device: torch.device | str = "cpu"):
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.width = max_ngram_size - 1
        self.table = torch.zeros(num_slots + 1, self.width, dtype=torch.int32, device=device)

    @property
    def pad_row(self) -> int:
        return self.num_slots

    def rows(self, slots: torch.Tensor) -> torch.Tensor:
        return self.table[slots].long()

    def write(self, slots: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> None:
        """Write ``rows[i]`` to ``slots[i]`` where ``keep[i]``; the rest go to the pad row."""
        target = torch.where(keep, slots.long(), self.pad_row)
        self.table[target] = rows.to(torch.int32)

    def commit_verify(
        self,
        block_tokens: torch.Tensor,
        slots: torch.Tensor,
        num_accepted: torch.Tensor,
        num_real: int | torch.Tensor | None = None,
        check: bool = True,
    ) -> None:
        """Advance by the anchor plus the accepted drafts of each speculative block.

        The bonus token sampled after the last accepted draft is not committed: it is the
        anchor of the next block and gets committed with it. ``check=False``: counts computed
        on the device, not checked (a check waits for the device).
        """
        bsz = block_tokens.shape[0]
        n_acc = self.check_verify(block_tokens, slots, num_accepted, num_real, check)
        keep = torch.arange(bsz, device=slots.device) < (bsz if num_real is None else num_real)
        target = torch.where(keep, slots.long(), self.pad_row)
        window = torch.cat([self.rows(target), block_tokens.long()], dim=1)
        take = (1 + n_acc)[:, None] + torch.arange(self.width, device=slots.device)
        self.write(target, window.gather(1, take), keep)

    def check_verify(
        self,
        block_tokens: torch.Tensor,
        slots: torch.Tensor,
        num_accepted: torch.Tensor,
        num_real: int | torch.Tensor | None = None,
        check: bool = True,
    ) -> torch.Tensor:
        """Accepted counts of live rows (0 for padding rows), after checking them and the slots
        (unless not ``check``)."""
        bsz, block = block_tokens.shape
        keep = torch.arange(bsz, device=slots.device) < (bsz if num_real is None else num_real)
        n_acc = torch.where(keep, num_accepted.long(), 0)  # padding rows may hold garbage
        if not check:
            return n_acc
        if bool(((n_acc < 0) | (n_acc >= block)).any()):
            raise ValueError(f"num_accepted must lie in [0, {block - 1}], got {n_acc.tolist()}")
        live = slots.long()[keep]
        if bool(((live < 0) | (live >= self.num_slots)).any()):
            raise ValueError(f"slots must lie in [0, {self.num_slots}), got {live.tolist()}")
        return n_acc

    def rebuild(self, slot: int, tokens_before: Sequence[int] | torch.Tensor) -> None:
        """Set a row from the tokens that precede the next forward (prefix hit, resume, chunk)."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.num_slots})")
        toks = torch.as_tensor(tokens_before, dtype=torch.int32).flatten()[-self.width :]
        row = torch.zeros(self.width, dtype=torch.int32)
        if toks.numel():
            row[self.width - toks.numel() :] = toks
        self.table[slot] = to_device(row, self.table.device)
