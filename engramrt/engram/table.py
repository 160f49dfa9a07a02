"""Engram embedding tables: fp8 e4m3 rows with e8m0 scales per 32 elements, or plain bf16/fp32.

A table may hold only a contiguous range of rows (its shard). Lookups of rows it does not own
read as -0.0, the IEEE additive identity, so summing the partial lookups of all shards in any
order reproduces the full lookup bit for bit (x + -0.0 == x for every x, +0.0 included).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engramrt.engram.host_memory import HostMapping
from engramrt.kernels import use_triton

SCALE_BLOCK = 32  # elements per e8m0 scale, hard-coded in DeepSeek-V4.1
FP8_DTYPES = (torch.float8_e4m3fn,)


def dequantize_rows(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32(e4m3) * 2**(e - 127), rounded once to bf16. e8m0 byte 0 is 2**-127, not zero."""
    factor = scale.float().repeat_interleave(SCALE_BLOCK, dim=-1)
    return (weight.float() * factor).to(torch.bfloat16)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``[rows, dim]`` -> e4m3 weight and one power-of-two e8m0 scale per 32 elements,
    the smallest scale that keeps each block within e4m3's range (448)."""
    rows, dim = x.shape
    blocks = x.float().view(rows, dim // SCALE_BLOCK, SCALE_BLOCK)
    amax = blocks.abs().amax(-1).clamp(min=2.0**-127 * 448)
    exponent = torch.ceil(torch.log2(amax / 448)).clamp(-127, 127)
    weight = (blocks / torch.exp2(exponent)[..., None]).view(rows, dim).to(torch.float8_e4m3fn)
    scale = (exponent + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return weight, scale


def shard_row_range(
    num_rows: int, rank: int, world: int, column_bounds: list[int] | None = None
) -> tuple[int, int]:
    """Rows ``[lo, hi)`` owned by ``rank``: whole hash columns when the column count divides by
    ``world`` and ``column_bounds`` are given, else a floor split of the rows."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} out of range for world size {world}")
    if column_bounds is not None:
        cols = len(column_bounds) - 1
        if column_bounds[-1] != num_rows:
            raise ValueError(f"column bounds end at {column_bounds[-1]}, table has {num_rows} rows")
        if cols % world == 0:
            per = cols // world
            return column_bounds[rank * per], column_bounds[(rank + 1) * per]
    return num_rows * rank // world, num_rows * (rank + 1) // world


class EngramTable(nn.Module):
    """Rows ``[row_start, row_start + len(weight))`` of one Engram layer's table; its buffers
    carry the checkpoint names ``weight`` and ``scale``. ``host``: the rows live in that host
    mapping (``engramrt.engram.host_memory``) and stay there when the model moves to a GPU,
    whose gather reads them in place."""

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor | None = None,
        row_start: int = 0,
        host: HostMapping | None = None,
    ):
        super().__init__()
        self.host = host
        if weight.dim() != 2:
            raise ValueError(
                f"table weight must be 2-D [rows, dim], got shape {list(weight.shape)}"
            )
        if weight.dtype in FP8_DTYPES:
            rows, dim = weight.shape
            want = [rows, dim // SCALE_BLOCK]
            if scale is None or dim % SCALE_BLOCK or list(scale.shape) != want:
                got = None if scale is None else list(scale.shape)
                raise ValueError(f"fp8 table needs an e8m0 scale of shape {want}, got {got}")
            if scale.dtype != torch.float8_e8m0fnu:
                scale = scale.view(torch.float8_e8m0fnu)  # uint8 bytes as stored by some tools
        elif scale is not None:
            raise ValueError(f"a {weight.dtype} table takes no scale")
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.row_start = row_start

    def _apply(self, fn, recurse: bool = True):
        if self.host is not None:  # ``.to(device)`` and friends leave host rows where they are
            return self
        return super()._apply(fn, recurse)

    @property
    def num_rows(self) -> int:
        return self.weight.shape[0]

    @property
    def dim(self) -> int:
        return self.weight.shape[1]

    @property
    def out_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.scale is not None else self.weight.dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lookup(ids)

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        """``[T, cols]`` global row ids -> ``[T, cols * dim]``; unowned rows read as -0.0."""
        if use_triton(ids.device):
            from engramrt.kernels.engram_gather import gather

            return gather(ids, self.weight, self.scale, self.row_start)
        if self.num_rows == 0:  # an empty shard (more ranks than rows) owns nothing
            shape = (*ids.shape[:-1], ids.shape[-1] * self.dim)
            return torch.full(shape, -0.0, dtype=self.out_dtype, device=ids.device)
        local = ids.long().to(self.weight.device) - self.row_start  # host rows: read there
        owned = (local >= 0) & (local < self.num_rows)
        safe = torch.where(owned, local, 0)
        if self.scale is not None:
            rows = dequantize_rows(self.weight[safe], self.scale[safe])
        else:  # an fp32 table in training: an embedding lookup, whose backward sums the rows
            rows = F.embedding(safe, self.weight)  # repeated in a step by sorted segments
        rows = rows.masked_fill(~owned[..., None], -0.0)
        return rows.flatten(-2).to(ids.device)

    def shard(self, rank: int, world: int, column_bounds: list[int] | None = None) -> EngramTable:
        """A copy of the rows ``rank`` owns (the full table must start at row 0)."""
        if self.row_start != 0:
            raise ValueError("only a full table can be sharded")
        lo, hi = shard_row_range(self.num_rows, rank, world, column_bounds)
        scale = None if self.scale is None else self.scale[lo:hi].clone()
        return EngramTable(self.weight[lo:hi].clone(), scale, row_start=lo)
