"""The compressed-cache rows of entries in one launch (``kernels.entry_rows``) against a
per-entry restatement of ``V41Cache.entry_rows``'s layout (position ``e * ratio``, its block
through the request's table, clamped to the table's last, the row within it), and the torch
path that serves off CUDA against the same."""

from __future__ import annotations

import pytest
import torch

from engramrt.kernels.entry_rows import entry_rows
from engramrt.models.deepseek_v41.cache import V41Cache

pytestmark = pytest.mark.triton
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def restated(tables, req, entries, ratio, block_size, none):
    out = torch.empty_like(entries)
    width = tables.shape[1]
    for i, e in enumerate(entries.flatten().tolist()):
        t = i // (entries.shape[-1] if entries.dim() > 1 else 1)
        if e < 0:
            out.view(-1)[i] = none
            continue
        pos = e * ratio
        block = int(tables[req[t], min(pos // block_size, width - 1)])
        out.view(-1)[i] = block * (block_size // ratio) + (pos % block_size) // ratio
    return out


@pytest.mark.parametrize(("ratio", "shape"), [(4, (7, 33)), (128, (5, 9)), (4, (11,))])
def test_entry_rows_are_the_layouts_rows(ratio: int, shape: tuple) -> None:
    g = torch.Generator().manual_seed(ratio + len(shape))
    block_size, batch, width = 256, 3, 6
    tables = torch.randperm(batch * width, generator=g).view(batch, width).int()
    req = torch.randint(0, batch, shape[:1], generator=g)
    per = block_size // ratio
    # entries in the table, past it (its last block), and none (-1)
    entries = torch.randint(-1, per * (width + 2), shape, generator=g)
    want = restated(tables, req, entries, ratio, block_size, none=-7)
    got = entry_rows(tables.to(DEVICE), req.to(DEVICE), entries.to(DEVICE), per, -7)
    assert torch.equal(got.cpu(), want)
    # the torch path (a CPU's): the same rows
    cache = V41Cache.__new__(V41Cache)
    cache.block_size = block_size
    assert torch.equal(cache.entry_rows(tables, req, entries, ratio, -7), want)
