"""Compile the stored-format kernel for Hopper (sm_90) without a GPU, each mode given on the
command line as JSON, and print one JSON line a mode: registers, local memory, wgmma count.
Run in its own process (``tests/kernels/test_hopper_compile.py``): under the interpreter,
which the tests turn on, ``triton.jit`` gives a function Triton cannot compile."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import mangle_type
from triton.tools.tensor_descriptor import TensorDescriptor

from engramrt.kernels import stored_linear as sl

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")


def _args(mode: dict, bn: int) -> dict:
    """Placeholder tensors of the launch's types (only their types and the descriptor's block
    shape reach the compiler) and its integers."""
    n, k, groups, fp4 = mode["n"], mode["k"], mode.get("groups", 1), mode["fp4"]
    values = fp4 or mode.get("values", False)
    w = torch.zeros(n, k // 2 if fp4 else k, dtype=torch.uint8)
    grouped = mode.get("grouped", False)
    desc = TensorDescriptor.from_tensor(
        w[None] if grouped else w, [1, bn, 32] if grouped else [bn, 32]
    )
    a = torch.zeros(4, k * groups, dtype=torch.bfloat16 if values else torch.float8_e4m3fn)
    f32, i64, i32 = (torch.zeros(4, dtype=t) for t in (torch.float32, torch.int64, torch.int32))
    bf16, u8 = torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.uint8)
    scales = f32 if not values or fp4 else a  # as ``_launch`` passes them
    return {
        "a_ptr": a,
        "sa_ptr": scales,
        "w_desc": desc,
        "sw_ptr": u8,
        "out_ptr": bf16,
        "part_ptr": f32,
        "count_ptr": i32,
        "rows_ptr": i64 if grouped else scales,
        "tiles_ptr": i64 if grouped else scales,
        "add_ptr": bf16 if mode.get("add") else scales,
        "by_id_ptr": i64 if mode.get("add") else scales,
        "M": 5,
        "R": 5,
        "N": n,
        "K": k,
        "A_STRIDE": k * groups,
        "GROUP_N": n // groups,
        "BLOCKS_SPLIT": 7,
        "S_STRIDE": 3,
        "SPLITS": 5,
        "PROGRAMS": 5,
        "TOP_K": 1,
    }


def compile_mode(mode: dict) -> dict:
    bn, g, warps, stages, _ = sl.settings(mode["fp4"], mode["n"], mode["k"])
    while mode.get("groups", 1) > 1 and (mode["n"] // mode["groups"]) % bn:
        bn //= 2
    args = _args(mode, bn)
    consts = {
        "FP4": mode["fp4"],
        "VALUES": mode["fp4"] or mode.get("values", False),
        "GROUPED": mode.get("grouped", False),
        "GATHER": mode.get("grouped", False),
        "ADD": mode.get("add", False),
        "BM": mode.get("bm", 16),
        "BN": bn,
        "G": g,
        "ASM": True,
    }
    names = list(inspect.signature(sl._stored_linear_kernel.fn).parameters)
    sig = {p: "constexpr" if p in consts else mangle_type(args[p]) for p in names}
    src = ASTSource(
        sl._stored_linear_kernel, sig, {(names.index(c),): v for c, v in consts.items()}
    )
    out = triton.compile(
        src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages}
    )
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(out.asm["cubin"])
        f.flush()
        usage = subprocess.run(
            [os.path.join(BIN, "cuobjdump"), "-res-usage", f.name],
            capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    found = re.search(r"REG:(\d+).*LOCAL:(\d+)", usage)
    return {
        "registers": int(found.group(1)),
        "local": int(found.group(2)),
        "wgmma": out.asm["ptx"].count("wgmma.mma_async"),
    }


if __name__ == "__main__":
    for raw in sys.argv[1:]:
        print(json.dumps(compile_mode(json.loads(raw))), flush=True)
