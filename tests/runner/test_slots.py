"""A stage's per-slot state (``SlotTable``): admission hands each piece to its keeper once, a
step's sampling rows are the admitted parameters with the step's index and final flag, and the
token rows and block tables follow admissions, deltas and kept samples as a plain list per slot
(the oracle) does."""

from __future__ import annotations

import random

import pytest
import torch

from engramrt.model.context import ForwardContext
from engramrt.models.gqa.cache import GQACache
from engramrt.runner.batch import NewRequest, SampleRow, StepBatch
from engramrt.runner.logit_controls import Controls
from engramrt.runner.slots import GREEDY, SlotTable


class Recording:
    def __init__(self):
        self.seen: list[NewRequest] = []

    def admit(self, new: NewRequest) -> None:
        self.seen.append(new)


class History:
    def __init__(self):
        self.rows: dict[int, list[int]] = {}

    def rebuild(self, slot: int, before) -> None:
        self.rows[slot] = list(before)


def test_admission_reaches_every_keeper_and_rows_carry_the_step() -> None:
    rng = random.Random(0)
    history, state = History(), Recording()
    table = SlotTable(torch.device("cpu"), history, samples=True)
    table.states.append(state)
    rows = {
        s: SampleRow(
            rng.uniform(0.1, 2),
            rng.uniform(0.5, 1),
            rng.randrange(5),
            rng.uniform(0, 0.2),
            rng.randrange(100),
        )
        for s in (0, 3, 9)
    }
    admitted = [
        NewRequest(
            s,
            [1, 2, 3, 4, 5],
            3,
            2 + s % 3,
            sampling=row,
            controls=Controls(presence_penalty=0.5) if s == 3 else None,
        )
        for s, row in rows.items()
    ]
    admitted.append(NewRequest(5, [7, 8], 2, 0))  # greedy: nothing kept
    table.admit(admitted, vocab=16)
    assert state.seen == admitted
    assert history.rows == {a.slot: a.tokens[: a.num_computed] for a in admitted}
    assert set(table.controls.live) == {3}
    batch = StepBatch(
        None,
        [9, 5, 0, 3, 7],
        [1] * 5,
        [0] * 5,
        sample_index=[4, 0, 1, 0, 2],
        final=[True, True, False, True, True],
    )
    got = table.rows(batch)
    for b, slot in enumerate(batch.slots):
        want = rows.get(slot, GREEDY)
        assert (got[b].temperature, got[b].top_p, got[b].top_k, got[b].min_p, got[b].seed) == (
            want.temperature,
            want.top_p,
            want.top_k,
            want.min_p,
            want.seed,
        )
        assert got[b].index == batch.sample_index[b] and got[b].final == batch.final[b]
    params = table.gather([9, 0, 3])  # the device rows, by slot, in one gather
    want = [[rows[s].temperature, rows[s].top_p, rows[s].min_p, rows[s].top_k] for s in (9, 0, 3)]
    assert torch.allclose(params, torch.tensor(want, dtype=torch.float32))
    table.admit([NewRequest(9, [1], 1, 0)], vocab=16)  # a new owner, greedy
    assert table.rows(StepBatch(None, [9], [1], [0]))[0] is GREEDY


def test_token_rows_and_block_tables_follow_a_list_oracle() -> None:
    """Random steps of admissions (whole tokens and blocks), deltas (a run's last tokens, new
    blocks from a start) and kept samples (final runs only): the rows gathered through a
    ``ForwardContext`` and the tables equal a per-slot list kept by hand."""
    rng = random.Random(1)
    slots_n, max_len, block = 6, 40, 4
    kv = GQACache([0], 80, block, 1, 2, torch.float32, "cpu", max_len, num_slots=slots_n)
    table = SlotTable(torch.device("cpu"), None, samples=False, first=True)
    table.size_for(kv)
    rows: dict[int, list[int]] = {}  # slot -> tokens the row holds (the oracle)
    blocks: dict[int, list[int]] = {}
    for _ in range(60):
        admitted, runs = [], []
        for slot in rng.sample(range(slots_n), rng.randint(1, 4)):
            if slot not in rows or rng.random() < 0.2:  # a new owner
                toks = [rng.randrange(1000) for _ in range(rng.randint(1, 20))]
                done = rng.randrange(len(toks))
                own = rng.sample(range(80), -(-max_len // block))
                admitted.append(NewRequest(slot, toks, len(toks), done, blocks=own))
                rows[slot], blocks[slot] = list(toks), list(own)
                runs.append((slot, done, len(toks) - done, 0))
            elif len(rows[slot]) < max_len:
                start = rng.randrange(len(rows[slot]))  # a verify rollback may rewrite
                n = rng.randint(1, min(4, max_len - start))
                fresh = max(0, start + n - len(rows[slot]))
                given = rng.randint(fresh, n)
                new = [rng.randrange(1000) for _ in range(given)]
                rows[slot] = rows[slot][: start + n - given] + new
                runs.append((slot, start, n, given))
        if not runs:
            continue
        slots, starts, lens, counts = (list(x) for x in zip(*runs, strict=True))
        flat = [t for s, p, n, c in runs for t in rows[s][p + n - c : p + n]]
        final = [rng.random() < 0.7 for _ in runs]
        grown = [0] * len(runs)
        new_blocks = [[] for _ in runs]
        for b, s in enumerate(slots):
            if s not in {a.slot for a in admitted} and rng.random() < 0.3:
                keep = rng.randint(0, len(blocks[s]))
                add = rng.sample(range(80), len(blocks[s]) - keep)  # the table stays whole
                blocks[s] = blocks[s][:keep] + add
                grown[b], new_blocks[b] = keep, add
            else:
                grown[b] = len(blocks[s])
        batch = StepBatch(
            flat,
            slots,
            lens,
            starts,
            new_blocks=new_blocks,
            block_starts=grown,
            admitted=admitted,
            token_counts=counts,
            final=final,
        )
        table.admit(admitted, vocab=1000)
        table.advance(batch)
        ctx = ForwardContext.for_runs(slots, lens, starts, kv, table.blocks, "cpu")
        want = [t for s, p, n, _ in runs for t in rows[s][p : p + n]]
        if lens == [1] * len(lens):  # a decode step reads by slot, a mixed one by token
            assert ctx.decode
        assert table.token_ids(ctx).tolist() == want
        for s, own in blocks.items():
            assert table.blocks.tables[s, : table.blocks.lens[s]].tolist() == own
        sampled = torch.tensor([rng.randrange(1000) for _ in runs])
        table.keep_samples(batch, sampled)
        for b, (s, p, n, _) in enumerate(runs):
            if final[b] and p + n <= max_len:
                rows[s] = rows[s][: p + n] + [int(sampled[b])]
        for s, held in rows.items():
            assert table.tokens[s, : len(held)].tolist() == held, s


def test_token_deltas_are_checked() -> None:
    kv = GQACache([0], 16, 4, 1, 2, torch.float32, "cpu", 16, num_slots=2)
    table = SlotTable(torch.device("cpu"), None, samples=False, first=True)
    table.size_for(kv)
    for batch, msg in [
        (StepBatch([1, 2], [0], [3], [0]), "need their tokens"),
        (StepBatch([1], [0], [1], [0], token_counts=[2]), "2 new tokens for a run of 1"),
        (StepBatch(None, [0], [1], [0], token_counts=[1]), "need 1 tokens"),
    ]:
        with pytest.raises(ValueError, match=msg):
            table.advance(batch)
