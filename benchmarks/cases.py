"""Everything the benchmarks take from engramrt's internals, in this one module (the package's
module paths move; fix them here): the kernel cases (each Triton kernel on a named shape beside
its torch path, with the bytes and FLOPs its work must move) and the model-level pieces the
suites need (engines built from ``engramrt bench throughput``'s flags, decode-step floors,
prefill FLOPs, DSpark's held-out prompts, the preset models, the decode-step census's stage)."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import engramrt
from engramrt import kernels
from engramrt.bundled import DEFAULT_MODEL_DIR, FLASH_CONFIG, GQA_MODEL_DIR
from engramrt.bundled.prose import austen
from engramrt.commands import bench_throughput
from engramrt.config import engram_config
from engramrt.engine.build import build_stage
from engramrt.engine.request import SamplingParams
from engramrt.engram import EngramHasher, EngramLayout
from engramrt.engram.module import engram_gate
from engramrt.engram.table import EngramTable
from engramrt.kernels import FORCE_TORCH_ENV
from engramrt.model import mhc
from engramrt.model.layers import rms_norm, silu_mul
from engramrt.models.deepseek_v41 import quant
from engramrt.models.deepseek_v41.attention import sorted_picks
from engramrt.models.deepseek_v41.config import REINDEX, SOURCE, V41Config
from engramrt.prompts import PromptEncoder
from engramrt.runner.batch import NewRequest, SampleRow, StepBatch
from engramrt.runner.stage import StageRunner

if not torch.cuda.is_available():  # Triton's interpreter on a CPU (no kernel module loaded yet)
    os.environ.setdefault("TRITON_INTERPRET", "1")


@contextlib.contextmanager
def torch_path() -> Iterator[None]:
    """Inside: every op takes its torch reference (``engramrt.kernels.use_triton`` says no)."""
    old = os.environ.get(FORCE_TORCH_ENV)
    os.environ[FORCE_TORCH_ENV] = "1"
    try:
        yield
    finally:
        if old is None:
            del os.environ[FORCE_TORCH_ENV]
        else:
            os.environ[FORCE_TORCH_ENV] = old


@contextlib.contextmanager
def kernel_path() -> Iterator[None]:
    """Inside: every op takes its Triton kernel whatever the device (``use_triton`` says yes in
    every module that asks it): the CUDA code path, on a CPU in Triton's interpreter."""
    real = kernels.use_triton
    mods = [m for n, m in list(sys.modules.items()) if n.startswith("engramrt")]
    mods = [m for m in mods if getattr(m, "use_triton", None) is real]
    for m in mods:
        m.use_triton = lambda device: True
    try:
        yield
    finally:
        for m in mods:
            m.use_triton = real


# =========================================================================== kernel cases


@dataclass
class Built:
    """One kernel call on one shape's inputs, and what it is held against: ``reference``, the
    package's torch path on the same inputs (run inside ``torch_path``), equal bit for bit
    (``exact``) or within ``tol`` of relative L2 error; the bytes its work must move at least
    (each input read once, each output written once) and its FLOPs; ``baselines``, other ways
    to the same result timed in the same run (a library's kernel, another launch setting).
    ``ref_graph``: False where the torch path cannot be captured in a CUDA graph (it copies a
    constant to the device on each call): it is timed launched eagerly."""

    kernel: Callable[[], Any]
    reference: Callable[[], Any]
    bytes: int = 0
    flops: int = 0
    exact: bool = False
    tol: float = 1e-2
    baselines: dict[str, Callable[[], Any]] = field(default_factory=dict)
    ref_graph: bool = True


@dataclass(frozen=True)
class Shape:
    label: str
    params: dict[str, Any]
    headline: bool = False  # the shape BENCHMARKS.md's table shows


@dataclass(frozen=True)
class KernelCase:
    name: str
    source: str  # the kernel's module
    about: str
    build: Callable[[dict[str, Any], str], Built]
    shapes: tuple[Shape, ...]  # full size, on a GPU
    tiny: tuple[Shape, ...]  # ``--check``: Triton's interpreter on a CPU


def _dtype(device: str) -> torch.dtype:
    """bf16 on a GPU; fp32 in the interpreter (its bf16 dot products are not the GPU's)."""
    return torch.bfloat16 if device == "cuda" else torch.float32


def _gen(device: str, seed: int) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


# --- V4.1's FP8 / FP4 linears read as stored ------------------------------------------------


def _stored_linear(p: dict, dev: str) -> Built:
    from engramrt.kernels.stored_linear import stored_linear

    n, k, m, fp4 = p["n"], p["k"], p["m"], p["fp4"]
    if p.get("groups", 1) > 1:
        return _grouped_output(p, dev)
    g = _gen(dev, n + k + m)
    w = torch.randn(n, k, device=dev, generator=g) / k**0.5
    stored, scale = quant.fp4_weight(w) if fp4 else quant.fp8_weight(w)
    dequant = quant.dequant_fp4_weight if fp4 else quant.dequant_fp8_weight
    a = quant.act_roundtrip(torch.randn(m, k, device=dev, generator=g)).to(_dtype(dev))
    held = quant.pair_fp4(stored) if fp4 else stored  # FP4 paired, as the MoE holds it
    built = Built(
        kernel=lambda: stored_linear(a, held, scale, fp4),
        reference=lambda: quant.quantized_linear(a, dequant(stored, scale, a.dtype)),
        bytes=_nbytes(stored, scale, a) + m * n * a.element_size(),
        flops=2 * m * n * k,
        tol=1e-2 if dev == "cuda" else 1e-5,
        ref_graph=False,  # act_quant's scale constant goes to the device each call
    )
    if dev == "cuda":  # cuBLAS reading twice FP8's bytes (four times FP4's)
        w16 = dequant(stored, scale, torch.bfloat16)
        built.baselines["bf16 cuBLAS, weight dequantised beforehand"] = lambda: a @ w16.T
    return built


def _grouped_output(p: dict, dev: str) -> Built:
    """``wo_a``: bf16 rows as they are through each group's rows of an FP8 weight, against
    the reference's einsum over the weight dequantised (what the model ran before it read the
    weight as stored), which cuBLAS runs reading twice the bytes."""
    from engramrt.kernels.stored_linear import grouped_values_linear

    n, k, m, groups = p["n"], p["k"], p["m"], p["groups"]
    g = _gen(dev, n + k + m)
    stored, scale = quant.fp8_weight(torch.randn(n, k, device=dev, generator=g) / k**0.5)
    x = torch.randn(m, groups, k, device=dev, generator=g).to(_dtype(dev))
    w = quant.dequant_fp8_weight(stored, scale, x.dtype).unflatten(0, (groups, -1))
    return Built(
        kernel=lambda: grouped_values_linear(x, stored, scale, groups),
        reference=lambda: torch.einsum("mgk,gnk->mgn", x, w),
        bytes=_nbytes(stored, scale, x) + m * n * x.element_size(),
        flops=2 * m * n * k,
        tol=1e-2 if dev == "cuda" else 1e-5,
    )


def _grouped_experts(p: dict, dev: str) -> Built:
    """The routed experts' grouped FP4 w1|w3 launch at a decode step's routing: random top-k of
    ``e`` experts a token, the token rows gathered in the kernel; the torch path loops the
    touched experts over dequantised weights (random bytes: the kernel's paired ones, the
    torch path's the same unpaired)."""
    from engramrt.kernels.stored_linear import group_tile_rows, group_tiles, grouped_stored_linear

    e, k, t, n, kk = p["experts"], p["k"], p["tokens"], p["n"], p["kdim"]
    g = _gen(dev, e + t)
    codes = torch.randint(-128, 128, (e, n, kk // 2), device=dev, generator=g, dtype=torch.int8)
    scale = torch.randint(118, 124, (e, n, kk // 32), device=dev, generator=g, dtype=torch.uint8)
    scale = scale.view(torch.float8_e8m0fnu)
    ids = torch.rand(t, e, device=dev, generator=g).argsort(1)[:, :k]
    order = torch.sort(ids.flatten(), stable=True).indices
    counts = torch.bincount(ids.flatten(), minlength=e)
    tiles = group_tiles(counts, len(order), group_tile_rows(len(order), e))
    rows = order // k
    x = torch.randn(t, kk, device=dev, generator=g).to(_dtype(dev))
    sorted_ids = ids.flatten()[order]
    # the torch path reads the checkpoint's order: each touched expert's bytes unpaired once
    stored = {j: quant.unpair_fp4(codes[j]) for j in sorted_ids.unique().tolist()}

    def reference() -> torch.Tensor:
        out = torch.empty(len(order), n, dtype=x.dtype, device=dev)
        for j in sorted_ids.unique().tolist():
            at = (sorted_ids == j).nonzero().flatten()
            w = quant.dequant_fp4_weight(stored[j], scale[j], x.dtype)
            out[at] = quant.quantized_linear(x[rows[at]], w)
        return out

    touched = int((counts > 0).sum())
    return Built(
        kernel=lambda: grouped_stored_linear(x, codes, scale, True, tiles, rows, k),
        reference=reference,
        bytes=touched * (codes[0].numel() + scale[0].numel())
        + _nbytes(x)
        + len(order) * n * x.element_size(),
        flops=2 * len(order) * n * kk,
        tol=1e-2 if dev == "cuda" else 1e-5,
        ref_graph=False,
    )


def _route(p: dict, dev: str) -> Built:
    from engramrt.kernels.moe_routing import route
    from engramrt.models.deepseek_v41.moe import route_logits

    g = _gen(dev, p["tokens"])
    logits = torch.randn(p["tokens"], p["experts"], device=dev, generator=g)
    bias = torch.randn(p["experts"], device=dev, generator=g) * 0.1
    return Built(
        kernel=lambda: route(logits, bias, p["k"], 2.5),
        reference=lambda: route_logits(logits, bias, p["k"], 2.5),
        bytes=_nbytes(logits, bias) + p["tokens"] * p["k"] * 12,
        exact=dev == "cuda",  # the interpreter has no libdevice
        tol=1e-5,
    )


def _swiglu_codes(p: dict, dev: str) -> Built:
    from engramrt.kernels.moe_epilogues import swiglu_codes
    from engramrt.models.deepseek_v41.moe import clamped_swiglu

    g = _gen(dev, p["tokens"])
    gate_up = (torch.randn(p["tokens"], 2 * p["inter"], device=dev, generator=g) * 3).to(
        _dtype(dev)
    )
    w = torch.rand(p["tokens"], device=dev, generator=g)

    def reference() -> tuple[torch.Tensor, torch.Tensor]:
        gate, up = gate_up.chunk(2, dim=-1)
        codes, scale = quant.act_quant(clamped_swiglu(gate, up, 10.0, w[:, None]).to(x_dtype))
        return codes.view(torch.uint8), scale

    x_dtype = gate_up.dtype
    return Built(
        kernel=lambda: (lambda c, s, _: (c.view(torch.uint8), s))(*swiglu_codes(gate_up, 10.0, w)),
        reference=reference,
        bytes=_nbytes(gate_up, w) + p["tokens"] * p["inter"] * (1 + 4 / 32),
        exact=dev == "cuda",
        tol=1e-2,
        ref_graph=False,
    )


def stored_linear_sweep(
    fp4: bool, n: int, k: int, experts: int, top_k: int, m: int, dev: str, groups: int = 1
) -> tuple[Callable[[tuple], torch.Tensor], int, tuple]:
    """``benchmarks/linear_sweep.py``'s case: (a launch of the stored-format linear with given
    settings on ``m`` rows, the bytes its work must move, the settings it takes now); ``experts``:
    a stack that many deep, each row routed to ``top_k`` of them (0: one dense weight);
    ``groups``: FP8 features in groups over the activation's bf16 values (``wo_a``)."""
    from engramrt.kernels import stored_linear as sl

    g = torch.Generator(device=dev).manual_seed(n + k + m)
    make = quant.fp4_weight if fp4 else quant.fp8_weight
    if experts:
        ws = [make(torch.randn(n, k, device=dev, generator=g) / k**0.5) for _ in range(experts)]
        w, s = torch.stack([a for a, _ in ws]), torch.stack([b for _, b in ws])
        w = quant.pair_fp4(w) if fp4 else w
        ids = torch.rand(m, experts, device=dev, generator=g).argsort(1)[:, :top_k]
        order = torch.sort(ids.flatten(), stable=True).indices
        counts = torch.bincount(ids.flatten(), minlength=experts)
        rows = order // top_k
        bm = sl.group_tile_rows(len(rows), experts)
        tiles = sl.group_tiles(counts, len(rows), bm)
        touched = int((counts > 0).sum())
        bytes_ = (w[0].numel() + s[0].numel()) * touched
    else:
        w, s = make(torch.randn(n, k, device=dev, generator=g) / k**0.5)
        w = quant.pair_fp4(w) if fp4 else w
        rows = tiles = bm = None
        bytes_ = w.numel() + s.numel()
    x = torch.randn(m, k * groups, device=dev, generator=g).bfloat16()
    q = sl.quantize(x, values=fp4) if groups == 1 else sl.Codes(None, None, x.dtype, x)
    p = len(rows) if rows is not None else m
    read = q.codes.nbytes + q.scale.nbytes if q.codes is not None and not fp4 else x.nbytes
    bytes_ += read + p * n * 2

    def run(config):
        return sl._launch(q, w, s, fp4, p, config, rows, tiles, bm, groups=groups)

    return run, bytes_, sl.settings(fp4, n, k, top_k if experts else 1)


def save_stored_linear_settings(picks: dict[tuple[bool, int, int], tuple]) -> Path:
    """The sweep's picks where ``stored_linear`` reads them at import, beside the kept picks
    of shapes this sweep left out, each with the GPU it was picked on."""
    from engramrt.kernels import stored_linear as sl

    raw = json.loads(sl.TUNED_FILE.read_text()) if sl.TUNED_FILE.exists() else {"shapes": []}
    where = {(e["fp4"], e["n"], e["k"]): e.get("device", raw.get("device")) for e in raw["shapes"]}
    device = torch.cuda.get_device_name()
    where |= dict.fromkeys(picks, device)
    merged = {**sl.TUNED, **picks}
    shapes = [
        {"fp4": f, "n": n, "k": k, "config": list(c), "device": where.get((f, n, k), device)}
        for (f, n, k), c in merged.items()
    ]
    sl.TUNED_FILE.write_text(json.dumps({"shapes": shapes}, indent=1) + "\n")
    return sl.TUNED_FILE


# V4.1's decode linears at Flash's widths (v41-wide's): (name, FP4, N, K, experts in the stack,
# feature groups: ``wo_a``'s 8, each over its own K of the activation's bf16 values); the sweep
# (``benchmarks/linear_sweep.py``) tunes each, the kernels suite times each
FLASH_LINEARS = (
    ("wq_a", False, 1280, 5120, 0, 1),
    ("wq_b", False, 32768, 1280, 0, 1),
    ("wkv", False, 512, 5120, 0, 1),
    ("wq_a|wkv", False, 1792, 5120, 0, 1),  # the two stacked: one launch (``low_ranks``)
    ("wo_a", False, 8192, 4096, 0, 8),
    ("wo_b", False, 5120, 8192, 0, 1),
    ("index.wq_b", False, 4096, 1280, 0, 1),
    ("shared.w13", False, 4608, 5120, 0, 1),  # w1 above w3: one launch
    ("shared.w2", False, 5120, 2304, 0, 1),
    ("experts.w13", True, 4608, 5120, 16, 1),
    ("experts.w2", True, 5120, 2304, 16, 1),
)


def _linear_shapes() -> tuple[Shape, ...]:
    """Each of ``FLASH_LINEARS`` as one weight on one row; 16 and 64 rows for the widest FP8
    and the FP4 expert."""
    out = []
    for name, fp4, n, k, _, groups in FLASH_LINEARS:
        for m in (1, 16, 64) if name in ("wq_b", "experts.w13", "wo_a") else (1,):
            out.append(
                Shape(
                    f"{'FP4' if fp4 else 'FP8'} {name} {n}x{k}, {m} row{'s' * (m > 1)}",
                    {"n": n, "k": k, "m": m, "fp4": fp4, "groups": groups},
                    headline=m == 1 and name in ("wq_b", "experts.w13"),
                )
            )
    return tuple(out)


# --- Engram: hash, gather, gate --------------------------------------------------------------

HASH_BYTES_A_TOKEN = 8 + 12 + 4 * 8 + 2 * 24 * 8 + 12  # token, history row, map reads, ids, row


def _hashers(slots: int, dev: str) -> tuple[EngramHasher, EngramHasher]:
    """The released Flash layout (2 Engram layers x 24 columns, N = 4) over a random token map:
    the kernels' hasher and the torch path's."""
    layout = EngramLayout.from_config(engram_config(json.loads(FLASH_CONFIG.read_text())))
    tmap = torch.randint(0, 99092, (128815,), generator=torch.Generator().manual_seed(0))
    return (
        EngramHasher(layout, tmap, slots, dev, kernels=True),
        EngramHasher(layout, tmap, slots, dev, kernels=False),
    )


def _hash_decode(p: dict, dev: str) -> Built:
    bs = p["bs"]
    tri, ref = _hashers(bs, dev)
    g = torch.Generator().manual_seed(bs)
    toks = torch.randint(0, 128815, (bs,), generator=g).to(dev)
    slots = torch.randperm(bs, generator=g).to(dev)
    pos = torch.randint(3, 4000, (bs,), generator=g).to(dev)
    return Built(  # each call commits the history: ids and the slots' rows compared
        kernel=lambda: (tri.decode(toks, slots, pos, check=False), tri.history.table[:bs]),
        reference=lambda: (ref.decode(toks, slots, pos, check=False), ref.history.table[:bs]),
        bytes=bs * HASH_BYTES_A_TOKEN,
        exact=True,
    )


def _hash_extend(p: dict, dev: str) -> Built:
    tokens, nreq = p["tokens"], p["requests"]
    tri, ref = _hashers(nreq, dev)
    g = torch.Generator().manual_seed(tokens)
    toks = torch.randint(0, 128815, (tokens,), generator=g).to(dev)
    slots = torch.arange(nreq, device=dev)
    lens = torch.full((nreq,), tokens // nreq, device=dev)
    start = torch.randint(0, 100, (nreq,), generator=g).to(dev)
    return Built(
        kernel=lambda: tri.extend(toks, slots, lens, start, check=False),
        reference=lambda: ref.extend(toks, slots, lens, start, check=False),
        bytes=tokens * HASH_BYTES_A_TOKEN,
        exact=True,
    )


def _gather(p: dict, dev: str) -> Built:
    from engramrt.kernels import engram_gather

    t, rows, dim, cols = p["tokens"], p["rows"], p["dim"], p["cols"]
    g = _gen(dev, t)
    wb = torch.randint(0, 126, (rows, dim), device=dev, dtype=torch.uint8, generator=g)
    sb = torch.randint(100, 140, (rows, dim // 32), device=dev, dtype=torch.uint8, generator=g)
    table = EngramTable(wb.view(torch.float8_e4m3fn), sb.view(torch.float8_e8m0fnu))
    ids = torch.randint(0, rows, (t, cols), device=dev, generator=g)
    cfg = engram_gather.default_config(table.weight, ids)
    return Built(
        kernel=lambda: engram_gather.gather(ids, table.weight, table.scale, config=cfg),
        reference=lambda: table.lookup(ids),
        bytes=t * cols * (8 + dim + dim // 32 + 2 * dim),  # id, fp8 row, scales, bf16 out
        exact=True,
    )


def _gate(p: dict, dev: str) -> Built:
    from engramrt.kernels.engram_gate import gate

    t, hc, d = p["tokens"], p["hc"], p["dim"]
    g = _gen(dev, t)
    dt = _dtype(dev)
    x = torch.randn(t, hc, d, device=dev, generator=g).to(dt)
    kv = torch.randn(t, (hc + 1) * d, device=dev, generator=g).to(dt)
    q, k = (torch.randn(hc, d, device=dev, generator=g).to(dt) for _ in range(2))
    return Built(
        kernel=lambda: gate(x, kv, q, k, 1e-20),
        reference=lambda: engram_gate(x, kv, q, k, 1e-20),
        bytes=_nbytes(x, kv, x),  # x and kv in, x's shape out
        tol=1e-2 if dev == "cuda" else 1e-5,
    )


# --- mHC: the glue around each sublayer -------------------------------------------------------

MHC_ITERS, MHC_HC_EPS, MHC_NORM_EPS = 20, 1e-6, 1e-20


def _mhc_inputs(tokens: int, hc: int, dim: int, dev: str) -> dict[str, torch.Tensor]:
    g = _gen(dev, tokens * dim)
    mix = (2 + hc) * hc
    dt = _dtype(dev)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, generator=g)

    return {
        "x": randn(tokens, hc, dim).to(dt),
        "pre_prev": randn(tokens, hc).sigmoid(),
        "fn": randn(mix, hc * dim) * 0.02,
        "scale": randn(3).abs() + 0.5,
        "base": randn(mix),
        "weight": randn(dim).to(dt),
        "y": randn(tokens, dim).to(dt),
    }


def _mhc_pre(p: dict, dev: str) -> Built:
    from engramrt.kernels import mhc_fused

    t, hc, d = p["tokens"], p["hc"], p["dim"]
    a = _mhc_inputs(t, hc, d, dev)
    args = (a["x"], a["pre_prev"], a["fn"], a["scale"], a["base"], a["weight"])
    consts = (hc, MHC_ITERS, MHC_HC_EPS, MHC_NORM_EPS)
    mix = (2 + hc) * hc
    item = a["x"].element_size()
    return Built(  # (normed, pre, post, comb)
        kernel=lambda: mhc_fused.mhc_pre(*args, *consts)[:4],
        reference=lambda: tuple(mhc.mhc_pre(*args, *consts))[:4],
        # the stream and fn read once, the lagged pre, the norm weight; the normed row and the
        # mixing weights written
        bytes=t * hc * d * item
        + mix * hc * d * 4
        + t * hc * 4
        + d * item
        + t * d * item
        + t * mix * 4,
        flops=2 * t * hc * d * mix,
        tol=1e-2 if dev == "cuda" else 1e-4,
    )


def _mhc_post(p: dict, dev: str) -> Built:
    from engramrt.kernels import mhc_fused

    t, hc, d = p["tokens"], p["hc"], p["dim"]
    a = _mhc_inputs(t, hc, d, dev)
    with torch_path():
        pm = mhc.mhc_pre(
            a["x"],
            a["pre_prev"],
            a["fn"],
            a["scale"],
            a["base"],
            a["weight"],
            hc,
            MHC_ITERS,
            MHC_HC_EPS,
            MHC_NORM_EPS,
        )
    item = a["x"].element_size()
    return Built(
        kernel=lambda: mhc_fused.mhc_post(a["y"], a["x"], pm.post, pm.comb),
        reference=lambda: mhc.mhc_post(a["y"], a["x"], pm.post, pm.comb),
        # the sublayer's output, the stream read and written, post and comb
        bytes=t * d * item + 2 * t * hc * d * item + t * (hc + hc * hc) * 4,
        tol=1e-2 if dev == "cuda" else 1e-5,
    )


def _mhc_shapes(tokens: tuple[int, ...], head: int) -> tuple[Shape, ...]:
    return tuple(  # the 4B preset: hidden 3072, hc 4
        Shape(f"4B, {t} token{'s' * (t > 1)}", {"tokens": t, "hc": 4, "dim": 3072}, t == head)
        for t in tokens
    )


# --- GQA paged attention ----------------------------------------------------------------------

GQA = {"heads": 24, "kv_heads": 8, "dim": 128, "block": 16}  # the 4B preset


def _paged_cache(reqs: int, ctx: int, p: dict, dev: str, g: torch.Generator):
    per = -(-ctx // p["block"])
    blocks = reqs * per
    dt = _dtype(dev)
    shape = (blocks * p["block"], p["kv_heads"], p["dim"])
    k = torch.randn(shape, device=dev, generator=g).to(dt)
    v = torch.randn(shape, device=dev, generator=g).to(dt)
    tables = torch.randperm(blocks, device=dev, generator=g).view(reqs, per)
    return k, v, tables


def _gathered(cache: torch.Tensor, tables: torch.Tensor, ctx: int, block: int) -> torch.Tensor:
    """``[B, KVH, ctx, D]``: each request's rows in position order."""
    pos = torch.arange(ctx, device=cache.device)
    rows = tables[:, pos // block] * block + pos % block
    return cache[rows].transpose(1, 2)


def _paged_decode(p: dict, dev: str) -> Built:
    from engramrt.kernels.paged_attention import paged_decode_attention

    bs, ctx, bsz = p["bs"], p["ctx"], p["block"]
    g = _gen(dev, bs * ctx)
    k, v, tables = _paged_cache(bs, ctx, p, dev, g)
    q = torch.randn(bs, p["heads"], p["dim"], device=dev, generator=g).to(k.dtype)
    lens = torch.full((bs,), ctx, device=dev)
    width = torch.tensor([tables.shape[1]], device=dev)  # on the device, as graphs pass it

    def reference() -> torch.Tensor:  # attention.py's torch path: the rows gathered, then SDPA
        kk, vv = (_gathered(c, tables, ctx, bsz) for c in (k, v))
        return F.scaled_dot_product_attention(q[:, :, None], kk, vv, enable_gqa=True)[:, :, 0]

    built = Built(
        kernel=lambda: paged_decode_attention(q, k, v, tables, lens, bsz, width),
        reference=reference,
        bytes=2 * bs * ctx * p["kv_heads"] * p["dim"] * k.element_size() + 2 * _nbytes(q),
        flops=4 * bs * p["heads"] * p["dim"] * ctx,
        tol=2e-2 if dev == "cuda" else 1e-5,
    )
    if dev == "cuda":
        built.baselines["one split (no merge)"] = lambda: paged_decode_attention(
            q, k, v, tables, lens, bsz, width, splits=1
        )
    return built


def _paged_prefill(p: dict, dev: str) -> Built:
    from engramrt.kernels.paged_attention import paged_prefill_attention
    from engramrt.kernels.tiles import prefill_tiles

    reqs, tokens, bsz, h, d = p["requests"], p["tokens"], p["block"], p["heads"], p["dim"]
    g = _gen(dev, reqs * tokens)
    k, v, tables = _paged_cache(reqs, tokens, p, dev, g)
    q = torch.randn(reqs * tokens, h, d, device=dev, generator=g).to(k.dtype)
    qstart = torch.arange(reqs + 1, device=dev) * tokens
    pos0 = torch.zeros(reqs, dtype=torch.int64, device=dev)
    tiles = [torch.tensor(t, device=dev) for t in prefill_tiles([tokens] * reqs)]
    config = p.get("config")
    qq = q.view(reqs, tokens, h, d).transpose(1, 2)

    def reference() -> torch.Tensor:  # the rows gathered, then causal SDPA
        kk, vv = (_gathered(c, tables, tokens, bsz) for c in (k, v))
        out = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
        return out.transpose(1, 2).reshape(reqs * tokens, h, d)

    built = Built(
        kernel=lambda: paged_prefill_attention(
            q, k, v, tables, qstart, pos0, *tiles, bsz, config=config
        ),
        reference=reference,
        bytes=2 * _nbytes(q) + 2 * reqs * tokens * p["kv_heads"] * d * k.element_size(),
        flops=reqs * 4 * h * d * tokens * (tokens + 1) // 2,
        tol=2e-2 if dev == "cuda" else 1e-5,
    )
    if dev == "cuda":  # torch's flash kernel on the same rows laid out contiguous
        from torch.nn.attention import SDPBackend, sdpa_kernel

        kk, vv = (_gathered(c, tables, tokens, bsz).contiguous() for c in (k, v))
        qc = qq.contiguous()

        def flash() -> torch.Tensor:
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(qc, kk, vv, is_causal=True, enable_gqa=True)

        def repeated() -> torch.Tensor:  # the same FLOPs, K/V repeated to every query head
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(qc, kr, vr, is_causal=True)

        try:
            flash()
            built.baselines["torch SDPA (flash, GQA), contiguous K/V"] = flash
        except RuntimeError:  # this torch's flash path refuses GQA
            kr, vr = (t.repeat_interleave(h // p["kv_heads"], 1) for t in (kk, vv))
            built.baselines["torch SDPA (flash), contiguous K/V repeated"] = repeated
    return built


# --- V4.1's sparse attention, indexer scores and top-k selection -------------------------------

FLASH_ATTN = {"heads": 64, "dim": 512, "window": 128, "topk": 512, "ratio": 2, "context": 4096}
FLASH_INDEX = {"heads": 32, "dim": 128, "ratio": 2, "block": 16, "context": 4096}


def _runs(bs: int, run: int, context: int, dev: str):
    """``bs`` requests each with a run of ``run`` tokens ending at ``context``: each token's
    request, position and its run's first position and first row."""
    req = torch.arange(bs, device=dev).repeat_interleave(run)
    pos = (context - run + torch.arange(run, device=dev)).repeat(bs)
    return req, pos, torch.full_like(pos, context - run), req * run


def sparse_attention_torch(q, kv, ring, comp, picks, pos, p0, q0, slot, sink, scale, window):
    """``V41Attention.attend``'s torch path, restated for one chunk of tokens: each query over
    its window (this run's latents from ``kv``, earlier ones from its slot's ring) and its
    picked rows of ``comp``, fp32 scores, the sink's ``exp`` in the denominator only."""
    ring_len = window
    at = (pos[:, None] - window + 1).clamp_min(0) + torch.arange(window, device=q.device)
    seen = at <= pos[:, None]
    here = q0[:, None] + (at - p0[:, None])
    ring_rows = slot[:, None] * ring_len + at % ring_len
    rows = torch.where(
        (at >= p0[:, None]).unsqueeze(-1), kv[here.clamp(0, len(kv) - 1)], ring[ring_rows]
    )
    rows = torch.cat([rows, comp[picks.clamp_min(0)]], dim=1)
    seen = torch.cat([seen, picks >= 0], dim=1)
    s = torch.einsum("mhd,mrd->mhr", q.float(), rows.float()) * scale
    s = s.masked_fill(~seen[:, None, :], -math.inf)
    top = s.amax(-1, keepdim=True).clamp_min(-1e30)
    e = torch.exp(s - top)
    denom = e.sum(-1) + torch.exp(sink.float() - top.squeeze(-1))
    o = torch.einsum("mhr,mrd->mhd", e.to(q.dtype).float(), rows.float())
    return (o / denom.unsqueeze(-1)).to(q.dtype)


def _sparse_attention(p: dict, dev: str) -> Built:
    from engramrt.kernels.sparse_attention import sparse_attention

    bs, run, ctx = p["bs"], p["run"], p["context"]
    h, d, w, topk, r = p["heads"], p["dim"], p["window"], p["topk"], p["ratio"]
    g = _gen(dev, bs * 7 + run)
    t, dt = bs * run, _dtype(dev)
    q = torch.randn(t, h, d, device=dev, generator=g).to(dt)
    kv = torch.randn(t, d, device=dev, generator=g).to(dt)
    ring = torch.randn((bs + 1) * w, d, device=dev, generator=g).to(dt)
    comp = torch.randn(bs * ctx // r, d, device=dev, generator=g).to(dt)
    req, pos, p0, q0 = _runs(bs, run, ctx, dev)
    seen = (pos + 1) // r  # distinct picks among what each token sees, in its request's rows
    picks = torch.rand(t, ctx // r, device=dev, generator=g).argsort(-1)[:, :topk]
    picks = torch.where(picks < seen[:, None], picks + req[:, None] * (ctx // r), -1)
    sink = torch.randn(h, device=dev, generator=g)
    args = (q, kv, ring, comp, picks, pos, p0, q0, req, sink, d**-0.5, w)
    rows = bs * (run + w - 1 + min(ctx // r, topk * run))  # latents, earlier window, picks
    return Built(
        kernel=lambda: sparse_attention(*args),
        reference=lambda: sparse_attention_torch(*args),
        bytes=2 * _nbytes(q) + rows * d * q.element_size() + _nbytes(picks),
        flops=4 * t * h * d * (min(w, ctx) + topk),
        tol=2e-2 if dev == "cuda" else 1e-5,
    )


def index_scores_torch(q, w, keys, table, req, pos, ratio, block, count):
    """The indexer's torch path (``V41Attention._index`` without a kernel), restated: each
    token's entries read through its request's block table, ``relu(q . key)`` weighted by the
    head weights and summed, ``-inf`` past what the token sees."""
    entries = torch.arange(count, device=q.device)
    at = (entries * ratio // block).clamp_max(table.shape[1] - 1)
    rows = table[req[:, None], at] * (block // ratio) + (entries * ratio % block) // ratio
    s = torch.einsum("nhd,ncd->nhc", q, keys[rows]).relu()
    scores = (s * w.unsqueeze(-1)).sum(dim=1)
    return scores.masked_fill(entries >= ((pos + 1) // ratio)[:, None], -math.inf)


def _index_scores(p: dict, dev: str) -> Built:
    from engramrt.kernels.index_scores import index_scores

    bs, run, ctx = p["bs"], p["run"], p["context"]
    h, di, r, blk = p["heads"], p["dim"], p["ratio"], p["block"]
    g = _gen(dev, bs * 11 + run)
    t, count, per, dt = bs * run, ctx // r, -(-ctx // blk), _dtype(dev)
    q = torch.randn(t, h, di, device=dev, generator=g).to(dt)
    w = torch.rand(t, h, device=dev, generator=g).to(dt)
    keys = torch.randn(bs * per * blk // r, di, device=dev, generator=g).to(dt)
    table = torch.randperm(bs * per, device=dev, generator=g).view(bs, per)
    req, pos, _, _ = _runs(bs, run, ctx, dev)
    args = (q, w, keys, table, req, pos, r, blk, count)
    return Built(
        kernel=lambda: index_scores(*args),
        reference=lambda: index_scores_torch(*args),
        bytes=_nbytes(q, w) + (bs * count * di + t * count) * q.element_size(),
        flops=2 * t * h * di * count,
        tol=2e-2 if dev == "cuda" else 1e-5,
    )


def _top_select(p: dict, dev: str) -> Built:
    from engramrt.kernels.top_select import top_select

    bs, run, ctx, width, k, r = p["bs"], p["run"], p["context"], p["width"], p["topk"], 2
    g = _gen(dev, bs * 13 + run)
    scores = torch.randn(bs * run, width, device=dev, generator=g).to(_dtype(dev))
    _, pos, _, _ = _runs(bs, run, ctx, dev)
    seen = (pos + 1) // r
    k = min(k, width)
    return Built(
        kernel=lambda: top_select(scores, seen, k),
        reference=lambda: sorted_picks(scores, seen, k),
        bytes=scores.element_size() * int(seen.sum()) + bs * run * k * 8,  # seen scores; picks
        exact=True,
    )


def _attention_shapes(params: dict, head: int) -> tuple[Shape, ...]:
    out = [
        Shape(f"decode, bs {bs}", {**params, "bs": bs, "run": 1}, bs == head) for bs in (1, 16, 64)
    ]
    return (*out, Shape("one run of 2,048 tokens", {**params, "bs": 1, "run": 2048}))


def _top_select_shapes() -> tuple[Shape, ...]:
    base = {"context": 4096, "topk": 512}
    out = []
    for label, width in (("a graph's row (65,536 positions)", 32768), ("an eager row", 2048)):
        for bs, run in ((1, 1), (64, 1), (1, 2048)):
            what = f"decode, bs {bs}" if run == 1 else "one run of 2,048"
            out.append(
                Shape(
                    f"{what}, {label}",
                    {**base, "bs": bs, "run": run, "width": width},
                    headline=bs == 64 and width == 32768,
                )
            )
    return tuple(out)


# --- the small fused kernels -------------------------------------------------------------------


def _rms_norm(p: dict, dev: str) -> Built:
    from engramrt.kernels.rms_norm import rms_norm as kernel

    g = _gen(dev, p["tokens"])
    x = torch.randn(p["tokens"], p["dim"], device=dev, generator=g).to(_dtype(dev))
    w = torch.randn(p["dim"], device=dev, generator=g).to(x.dtype)
    return Built(
        kernel=lambda: kernel(x, w, 1e-6),
        reference=lambda: rms_norm(x, w, 1e-6),
        bytes=2 * _nbytes(x) + _nbytes(w),
        tol=1e-2 if dev == "cuda" else 1e-5,
    )


def _silu_mul(p: dict, dev: str) -> Built:
    from engramrt.kernels.swiglu import silu_mul as kernel

    g = _gen(dev, p["tokens"])
    gate_up = torch.randn(p["tokens"], 2 * p["inter"], device=dev, generator=g).to(_dtype(dev))
    return Built(
        kernel=lambda: kernel(gate_up),
        reference=lambda: silu_mul(gate_up),
        bytes=_nbytes(gate_up) * 3 // 2,
        tol=1e-2 if dev == "cuda" else 1e-5,
    )


def _act_roundtrip(p: dict, dev: str) -> Built:
    from engramrt.kernels.quant_roundtrip import ACT, roundtrip

    g = _gen(dev, p["tokens"])
    x = torch.randn(p["tokens"], p["dim"], device=dev, generator=g).to(_dtype(dev))
    return Built(
        kernel=lambda: roundtrip(x, ACT),
        reference=lambda: quant.act_roundtrip(x),
        bytes=2 * _nbytes(x),
        exact=True,
        ref_graph=False,  # act_quant's scale constant goes to the device each call
    )


def _rows(tokens: tuple[int, ...], head: int, **params: int) -> tuple[Shape, ...]:
    """Shapes of ``tokens`` rows each; ``head``: the one BENCHMARKS.md shows (0: none)."""
    return tuple(
        Shape(f"{t} row{'s' * (t > 1)}", {"tokens": t, **params}, t == head) for t in tokens
    )


KERNEL_CASES: tuple[KernelCase, ...] = (
    KernelCase(
        "stored_linear",
        "engramrt/kernels/stored_linear.py",
        "V4.1's FP8/FP4 linear reading weights as stored, at Flash's widths",
        _stored_linear,
        _linear_shapes(),
        (
            Shape("FP8 70x96, 1 row", {"n": 70, "k": 96, "m": 1, "fp4": False}),
            Shape("FP8 40x1024, 3 rows", {"n": 40, "k": 1024, "m": 3, "fp4": False}),
            Shape(
                "FP8 wo_a 2 groups 128x96, 3 rows",
                {"n": 128, "k": 96, "m": 3, "fp4": False, "groups": 2},
            ),
            Shape("FP4 48x128, 1 row", {"n": 48, "k": 128, "m": 1, "fp4": True}),
            Shape("FP4 64x1088, 2 rows", {"n": 64, "k": 1088, "m": 2, "fp4": True}),
        ),
    ),
    KernelCase(
        "stored_linear.grouped",
        "engramrt/kernels/stored_linear.py",
        "the routed experts' grouped FP4 w1|w3 at Flash's widths, top-6 of 384",
        _grouped_experts,
        tuple(
            Shape(
                f"{t} token{'s' * (t > 1)}",
                {"experts": 384, "k": 6, "tokens": t, "n": 4608, "kdim": 5120},
                t == 1,
            )
            for t in (1, 16, 64)
        ),
        (Shape("3 tokens", {"experts": 5, "k": 2, "tokens": 3, "n": 40, "kdim": 64}),),
    ),
    KernelCase(
        "moe_routing.route",
        "engramrt/kernels/moe_routing.py",
        "V4.1's router after its logits: sqrt-softplus, biased top-6 of 384, weights",
        _route,
        _rows((1, 64, 4096), 64, experts=384, k=6),
        (Shape("5 rows", {"tokens": 5, "experts": 16, "k": 3}),),
    ),
    KernelCase(
        "moe_epilogues.swiglu_codes",
        "engramrt/kernels/moe_epilogues.py",
        "the clamped SwiGLU, routing weight and act_quant between the expert projections",
        _swiglu_codes,
        _rows((6, 384), 0, inter=2304),
        (Shape("3 rows", {"tokens": 3, "inter": 96}),),
    ),
    KernelCase(
        "engram_hash.decode",
        "engramrt/kernels/engram_hash.py",
        "a decode step's Engram hash and history commit, Flash's layout",
        _hash_decode,
        tuple(Shape(f"bs {b}", {"bs": b}, b == 256) for b in (1, 256, 4096)),
        (Shape("bs 3", {"bs": 3}),),
    ),
    KernelCase(
        "engram_hash.extend",
        "engramrt/kernels/engram_hash.py",
        "a prefill's Engram hash and commit, Flash's layout",
        _hash_extend,
        (
            Shape("8,192 tokens, 1 request", {"tokens": 8192, "requests": 1}),
            Shape("131,072 tokens, 64 requests", {"tokens": 131072, "requests": 64}, True),
        ),
        (Shape("40 tokens, 2 requests", {"tokens": 40, "requests": 2}),),
    ),
    KernelCase(
        "engram_gather",
        "engramrt/kernels/engram_gather.py",
        "FP8 Engram rows (24 columns of 256) from a 1 GiB device table",
        _gather,
        _rows((1, 256, 4096), 4096, rows=2**22, dim=256, cols=24),
        (Shape("5 rows", {"tokens": 5, "rows": 40, "dim": 64, "cols": 3}),),
    ),
    KernelCase(
        "engram_gate",
        "engramrt/kernels/engram_gate.py",
        "the Engram's gate and add into the stream, Flash's hc 4 x 5120",
        _gate,
        _rows((1, 256, 4096), 4096, hc=4, dim=5120),
        (Shape("3 rows", {"tokens": 3, "hc": 4, "dim": 96}),),
    ),
    KernelCase(
        "mhc_pre",
        "engramrt/kernels/mhc_fused.py",
        "mHC before a sublayer: mixes, Sinkhorn split, lagged collapse, RMSNorm",
        _mhc_pre,
        _mhc_shapes((1, 64, 256), 1),
        (Shape("3 tokens", {"tokens": 3, "hc": 4, "dim": 48}),),
    ),
    KernelCase(
        "mhc_post",
        "engramrt/kernels/mhc_fused.py",
        "mHC after a sublayer: the expand into the hc copies",
        _mhc_post,
        _mhc_shapes((1, 64, 256), 256),
        (Shape("3 tokens", {"tokens": 3, "hc": 4, "dim": 48}),),
    ),
    KernelCase(
        "paged_attention.decode",
        "engramrt/kernels/paged_attention.py",
        "split-K paged decode attention, the 4B preset's heads (24 q, 8 kv, dim 128)",
        _paged_decode,
        tuple(
            Shape(
                f"bs {bs}, context {ctx:,}",
                {**GQA, "bs": bs, "ctx": ctx},
                (bs, ctx) in ((1, 8192), (64, 8192)),
            )
            for bs, ctx in ((1, 2048), (1, 8192), (16, 2048), (64, 8192), (256, 2048))
        ),
        (
            Shape(
                "2 requests of 37 keys",
                {**GQA, "heads": 4, "kv_heads": 2, "dim": 32, "bs": 2, "ctx": 37, "block": 8},
            ),
        ),
    ),
    KernelCase(
        "paged_attention.prefill",
        "engramrt/kernels/paged_attention.py",
        "paged causal prefill attention, the 4B preset's heads",
        _paged_prefill,
        (
            Shape("1 x 2,048 tokens", {**GQA, "requests": 1, "tokens": 2048}),
            Shape("1 x 8,192 tokens", {**GQA, "requests": 1, "tokens": 8192}, True),
            Shape("4 x 2,048 tokens", {**GQA, "requests": 4, "tokens": 2048}),
        ),
        (
            Shape(
                "2 x 20 tokens",
                {
                    "heads": 4,
                    "kv_heads": 2,
                    "dim": 32,
                    "block": 8,
                    "requests": 2,
                    "tokens": 20,
                    "config": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2},
                },
            ),
        ),
    ),
    KernelCase(
        "sparse_attention",
        "engramrt/kernels/sparse_attention.py",
        "V4.1's window + top-k attention, Flash's 64 heads of 512, context 4,096",
        _sparse_attention,
        _attention_shapes(FLASH_ATTN, 64),
        (
            Shape(
                "2 requests, a run of 3 tokens",
                {
                    "heads": 4,
                    "dim": 32,
                    "window": 8,
                    "topk": 6,
                    "ratio": 2,
                    "context": 40,
                    "bs": 2,
                    "run": 3,
                },
            ),
        ),
    ),
    KernelCase(
        "index_scores",
        "engramrt/kernels/index_scores.py",
        "V4.1's indexer scores, Flash's 32 heads of 128 at ratio 2, context 4,096",
        _index_scores,
        _attention_shapes(FLASH_INDEX, 64),
        (
            Shape(
                "2 requests, a run of 3 tokens",
                {"heads": 4, "dim": 32, "ratio": 2, "block": 8, "context": 40, "bs": 2, "run": 3},
            ),
        ),
    ),
    KernelCase(
        "top_select",
        "engramrt/kernels/top_select.py",
        "V4.1's top-512 selection without a sort (the torch path sorts every row)",
        _top_select,
        _top_select_shapes(),
        (Shape("2 rows of 70", {"context": 60, "topk": 5, "bs": 2, "run": 1, "width": 70}),),
    ),
    KernelCase(
        "rms_norm",
        "engramrt/kernels/rms_norm.py",
        "RMSNorm, one program a row, width 5120",
        _rms_norm,
        _rows((1, 64, 4096), 0, dim=5120),
        (Shape("3 rows", {"tokens": 3, "dim": 96}),),
    ),
    KernelCase(
        "silu_mul",
        "engramrt/kernels/swiglu.py",
        "SwiGLU's activation, the 4B preset's 8192",
        _silu_mul,
        _rows((1, 64, 4096), 0, inter=8192),
        (Shape("3 rows", {"tokens": 3, "inter": 80}),),
    ),
    KernelCase(
        "act_roundtrip",
        "engramrt/kernels/quant_roundtrip.py",
        "V4.1's FP8 activation round trip (blocks of 32), width 5120",
        _act_roundtrip,
        _rows((1, 64, 4096), 0, dim=5120),
        (Shape("3 rows", {"tokens": 3, "dim": 96}),),
    ),
)


# =========================================================================== engines


def engine_args(model: str | Path, device: str, *flags: str) -> argparse.Namespace:
    """``engramrt bench throughput``'s flags: an engine of a suite is the one that command
    builds from them."""
    p = argparse.ArgumentParser()
    bench_throughput.add_arguments(p)
    return p.parse_args(["--model", str(model), "--device", device, *flags])


def batch_invariant_off() -> None:
    """``--batch-invariant`` is process-wide (an engine's build sets it): off for what follows."""
    kernels.set_batch_invariant(False)


def engine(args: argparse.Namespace, max_len: int, engram: bool = True) -> Any:
    """The engine of ``args`` for requests of ``max_len`` tokens, every stage in this process;
    ``engram=False``: every Engram layer skipped (an ablation: what the Engram costs)."""
    opts = bench_throughput.options(args, max_len)
    if not engram:
        opts = dataclasses.replace(opts, engram=False)
    return build_stage(opts)[1]


def measure(engine: Any, prompts: list[list[int]], out_lens: list[int]) -> dict[str, float]:
    """``engramrt bench throughput``'s measurement: a warm-up request, then the timed run."""
    return bench_throughput.measure(engine, prompts, out_lens)


def random_prompts(seed: int, lens: list[int], vocab: int, kind: str = "random") -> list[list]:
    return bench_throughput.random_prompts(random.Random(seed), lens, vocab, kind)


def profile(engine: Any, prompts: list[list[int]], out_lens: list[int]) -> dict[str, Any]:
    """``engramrt bench throughput --profile``: the requests again under torch.profiler."""
    return bench_throughput.profile_run(engine, prompts, out_lens)


def model_of(engine: Any) -> torch.nn.Module:
    return engine.pipeline.runner.model


def decode_floor_bytes(engine: Any, batch: int, context: int) -> int:
    """The bytes a decode step of ``batch`` requests at ``context`` tokens must read:
    ``engramrt bench throughput``'s count (every weight but the Engram tables, the batch's
    K/V, its Engram rows), less the embedding rows no token of the batch reads and the routed
    experts none of its tokens can reach (``batch x top-k`` of them at most)."""
    model = model_of(engine)
    cfg = model.cfg
    total = bench_throughput.decode_bytes(engine, batch, context)
    state = dict(model.held_tensors())
    embed = state.get("embed.weight")
    if embed is not None:
        total -= (embed.shape[0] - min(batch, embed.shape[0])) * embed[0].nbytes
    routed, top_k = routed_experts(cfg)
    if routed:
        reached = min(routed, batch * top_k)
        experts = sum(t.numel() * t.element_size() for n, t in state.items() if ".experts." in n)
        total -= experts * (routed - reached) // routed
    return total


def routed_experts(cfg: Any) -> tuple[int, int]:
    """(routed experts, experts a token reaches) of either family's MoE; (0, 0) without one."""
    body = cfg.body
    top_k = getattr(body, "num_experts_per_tok", getattr(body, "n_activated_experts", 0))
    return getattr(body, "n_routed_experts", 0), top_k


def prefill_flops(engine: Any, tokens: int) -> float:
    """FLOPs of one prefill of ``tokens`` from position 0: 2 x inputs x outputs a linear and a
    token (a routed expert's times the share of tokens that reach it; the head only at the last
    token), and attention: causal over the run (GQA), or over each token's window and picks
    plus the indexer's scores over every entry it sees (V4.1)."""
    model = model_of(engine)
    cfg = model.cfg
    # GQA: every 2-D weight is a product's but the embedding's and the head's
    if not isinstance(cfg.body, V41Config):
        weights = sum(
            p.numel()
            for n, p in model.named_parameters()
            if p.dim() == 2 and not n.startswith(("embed.", "head."))
        )
        heads = cfg.body.num_heads * cfg.body.head_dim
        return 2 * weights * tokens + 4 * heads * len(model.layer_ids) * tokens * (tokens + 1) / 2
    v = cfg.body
    share = v.n_activated_experts / v.n_routed_experts
    total = 0.0
    for name, mod in model.named_modules():
        if isinstance(mod, quant.StoredLinear):
            out, inp = mod.weight.shape[0], mod.weight.shape[1] * (2 if mod.fp4 else 1)
        elif isinstance(mod, torch.nn.Linear):
            out, inp = mod.weight.shape
        else:
            continue
        if name == "head" or name.endswith(".head"):
            continue
        total += 2 * out * inp * tokens * (share if ".experts." in name else 1)
    roles = [v.roles[i] for i in model.layer_ids]
    attended = sum(
        min(v.window_size, p + 1) + (min(v.index_topk, (p + 1) // r.ratio) if r.ratio else 0)
        for r in roles
        for p in range(tokens)
    )
    total += 4 * v.head_dim * v.n_heads * attended
    scanned = sum(tokens * tokens / (2 * r.ratio) for r in roles if r.kind in (SOURCE, REINDEX))
    return total + 2 * v.index_n_heads * v.index_head_dim * scanned


def ensure_preset(name: str, models: Path, device: str) -> Path:
    """``benchmarks/make_models.py``'s preset ``name`` under ``models``, written once (into a
    folder renamed when complete: a run stopped halfway leaves no preset that looks whole)."""
    from benchmarks.make_models import preset_config, write_model

    out = Path(models) / name
    if not out.is_dir():
        partial = out.with_name(f"{name}.partial")
        shutil.rmtree(partial, ignore_errors=True)
        write_model(preset_config(name), partial, device, 4 * 2**30)
        partial.rename(out)
    return out


# --- DSpark on a trained model -----------------------------------------------------------------

BUNDLED_MODEL = DEFAULT_MODEL_DIR  # the trained tiny V4.1
GQA_MODEL = GQA_MODEL_DIR  # the tiny GQA fixture


def held_out_prompts(model_dir: Path, tokenizer: Any, per_kind: int) -> list[list[int]]:
    """The held-out items of the model's task files (as completions and as one-turn chats) and
    the openings of held-out prose paragraphs (``engramrt.bundled.prose``; none when its
    package is not installed)."""
    enc = PromptEncoder.load(model_dir, tokenizer)
    prompts = []
    for task in sorted((Path(model_dir) / "tasks").glob("*.jsonl")):
        items = [json.loads(line) for line in task.read_text().splitlines()][:per_kind]
        prompts += [enc.text(i["prompt"]) for i in items]
        prompts += [enc.chat([{"role": "user", "content": i["prompt"]}]) for i in items]
    prose = [" ".join(p.split()[:12]) for p in austen()[1][:per_kind]]
    return prompts + [enc.text(p) for p in prose]


def greedy(engine: Any, prompts: list[list[int]], max_tokens: int) -> tuple[list, float, int, int]:
    """Greedy outputs (to EOS or ``max_tokens``), the seconds from the step that gave every
    request its first token to the end, the tokens generated in that time and the engine steps
    that delivered them."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, params)
    outs: dict[str, list[int]] = {}
    start, counted, steps = None, 0, 0
    while engine.has_work():
        steps += start is not None
        for o in engine.step():
            outs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if start is not None:
                counted += len(o.new_token_ids)
        if start is None and len(outs) == len(prompts):
            start = time.perf_counter()
    secs = 0.0 if start is None else time.perf_counter() - start
    return [outs[str(i)] for i in range(len(prompts))], secs, counted, steps


# --- the decode-step census (benchmarks/step_kernels.py) ------------------------------------------

PACKAGE_DIR = Path(engramrt.__file__).parent  # call sites are paths below it


def census_stage(
    model: str | Path, device: str, slots: int, prompt: int, temperature: float, top_p: float
) -> Any:
    """A stage of every layer (hasher and sampler included) for the CUDA path's kernels, its
    ``slots`` requests prefilled with ``prompt`` random tokens each (sampling at ``temperature``
    and ``top_p``; 0: greedy) on the torch path (the same caches; the interpreter's kernels are
    slow), and what a first kernel step builds once (V4.1's stacked expert weights) built: its
    decode steps are steady ones."""
    with kernel_path():  # the hasher picks its kernels when it is built
        runner = StageRunner.load(model, num_slots=slots, max_len=prompt + 64, device=device)
    rng, vocab = random.Random(0), runner.tokenizer.get_vocab_size()
    toks = [[rng.randrange(6, vocab) for _ in range(prompt)] for _ in range(slots)]
    row = SampleRow(temperature, top_p)
    new = [NewRequest(s, t, prompt, 0, sampling=row) for s, t in enumerate(toks)]
    flat, every = [x for t in toks for x in t], list(range(slots))
    runner.run(StepBatch(flat, every, [prompt] * slots, [0] * slots, admitted=new))
    for m in runner.model.modules():
        if hasattr(m, "_stacked"):
            m._stacked()
    return runner


def census_decode(runner: Any, positions: list[int], n: int) -> None:
    """One decode step of the requests in slots ``0..n-1`` at ``positions`` (their samples kept
    in the token rows, as the engine's overlap scheduling runs them); advances those."""
    runner.run(StepBatch([], list(range(n)), [1] * n, positions[:n], token_counts=[0] * n))
    positions[:n] = [p + 1 for p in positions[:n]]
