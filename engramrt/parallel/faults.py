"""Test-only fault injection, for the tools that must show they catch it (``check-pp``) and the
A/B runs that measure what it does to answers (``engramrt eval`` arms): with
``ENGRAMRT_CHECK_PP_FAULT=skip-entry-engram``, every stage after the first makes the Engram of
its first layer an identity while it still counts as run, i.e. vLLM's silent stage-entry skip.
Serving and checking stages load through this one hook, so what ``check-pp`` catches is what the
A/B arm measures."""

from __future__ import annotations

import os
import sys

FAULT_ENV = "ENGRAMRT_CHECK_PP_FAULT"


def inject_stage_faults(runner, rank: int) -> bool:
    """Apply the requested fault to this rank's stage; whether one was applied (said on
    stderr, so no run with it goes unnoticed)."""
    if os.environ.get(FAULT_ENV) != "skip-entry-engram" or rank == 0:
        return False
    first = runner.model.layers[str(runner.model.layer_ids[0])]
    if first.engram is None:
        return False
    first.engram.forward = lambda x, ids, dead=None, rows=None: x
    print(
        f"engramrt: FAULT INJECTED ({FAULT_ENV}): stage {rank} skips the Engram of its first "
        f"layer {runner.model.layer_ids[0]}",
        file=sys.stderr,
        flush=True,
    )
    return True
