"""V4.1's compressed-cache rows of entries (``V41Cache.entry_rows``) in one launch: the rows the
sparse attention reads for each token's picks were about a dozen small torch kernels a source
layer, each a CUDA-graph node of a microsecond or two however little it does."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024


# a step's counts vary: left unspecialised so that no count compiles a variant mid-run
@triton.jit(do_not_specialize=["n", "k", "width", "none"])
def _entry_rows_kernel(
    entries_ptr, req_ptr, tables_ptr, out_ptr, n, k, width, none, PER: tl.constexpr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < n
    e = tl.load(entries_ptr + i, mask=mask, other=0).to(tl.int64)
    req = tl.load(req_ptr + i // k, mask=mask, other=0).to(tl.int64)
    at = tl.minimum(tl.maximum(e, 0) // PER, width - 1)
    block = tl.load(tables_ptr + req * width + at, mask=mask, other=0).to(tl.int64)
    rows = block * PER + tl.maximum(e, 0) % PER
    tl.store(out_ptr + i, tl.where(e >= 0, rows, none), mask=mask)


def entry_rows(
    tables: torch.Tensor, req: torch.Tensor, entries: torch.Tensor, per: int, none: int
) -> torch.Tensor:
    """Rows (int64, ``entries``' shape) of ``entries`` [T] or [T, k] (-1: none), ``per`` a
    block, each of the request ``req`` [T] gives (an index into ``tables`` [B, W]); an entry
    past its table reads the table's last block; ``none`` where an entry is negative."""
    out = torch.empty(entries.shape, dtype=torch.int64, device=entries.device)
    n = entries.numel()
    if n:
        k = entries.shape[-1] if entries.dim() > 1 else 1
        _entry_rows_kernel[(triton.cdiv(n, BLOCK),)](
            entries.contiguous(), req.contiguous(), tables.contiguous(), out, n, k,
            tables.shape[-1], none, PER=per, BLOCK=BLOCK,
        )  # fmt: skip
    return out
