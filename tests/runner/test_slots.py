"""A stage's per-slot state (``SlotTable``): admission hands each piece to its keeper once, and a
step's sampling rows are the admitted parameters with the step's index and final flag."""

from __future__ import annotations

import random

import torch

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
    rows = {s: SampleRow(rng.uniform(0.1, 2), rng.uniform(0.5, 1), rng.randrange(5),
                         rng.uniform(0, 0.2), rng.randrange(100)) for s in (0, 3, 9)}  # fmt: skip
    admitted = [NewRequest(s, [1, 2, 3, 4, 5], 3, 2 + s % 3, row,
                           Controls(presence_penalty=0.5) if s == 3 else None)
                for s, row in rows.items()]  # fmt: skip
    admitted.append(NewRequest(5, [7, 8], 2, 0))  # greedy: nothing kept
    table.admit(admitted, vocab=16)
    assert state.seen == admitted
    assert history.rows == {a.slot: a.tokens[: a.num_computed] for a in admitted}
    assert set(table.controls.live) == {3}
    batch = StepBatch(None, [9, 5, 0, 3, 7], [1] * 5, [0] * 5, sample_index=[4, 0, 1, 0, 2],
                      final=[True, True, False, True, True])  # fmt: skip
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
