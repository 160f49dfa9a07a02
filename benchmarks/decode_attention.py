"""Paged decode attention on one GPU at the 4B preset's shapes (24 query heads, 8 KV heads, head
dim 128, bf16, block size 16), against the bytes a call must read.

    python benchmarks/decode_attention.py [--bs 1,16,64,256] [--ctx 512,2048,8192] [--out f.json]

Variants, timed in the same run: ``auto`` (the split-K kernel with ``decode_splits``), ``1
split`` (the same kernel, one split: no merge) and ``old`` (the kernel it replaced, one program
per (request, KV head) with broadcast products, kept here only for this comparison). Every
request holds ``ctx`` keys over shuffled blocks. A call must read each K and V row once:
``ctx * KVH * D * 2 (K and V) * 2 bytes`` per request; GB/s is that over the time per call.
Time per call: the median replay of one CUDA graph of many calls (as decode steps run them)
divided by the calls, rotating over enough caches (one per "layer") that they do not fit in L2.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from benchmarks.hash_bench import copy_bandwidth_gbs, median_us
from engramrt.kernels.paged_attention import decode_splits, paged_decode_attention

HEADS, KV_HEADS, DIM, BLOCK, DTYPE = 24, 8, 128, 16, torch.bfloat16
ROTATE_BYTES = 512 * 2**20  # K/V touched per graph replay, well over the H200's 60 MB of L2


@triton.jit
def _old_decode_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    width_ptr,
    lens_ptr,
    out_ptr,
    scale,
    H: tl.constexpr,
    KVH: tl.constexpr,
    G: tl.constexpr,
    BLOCK_G: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The replaced kernel (engramrt before split-K), unchanged: grid (request, KV head)."""
    b, kvh = tl.program_id(0), tl.program_id(1)
    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    gm, dm = g < G, d < D
    heads = kvh * G + g
    q = tl.load(
        q_ptr + (b * H + heads)[:, None] * D + d[None, :], mask=gm[:, None] & dm[None, :], other=0
    ).to(tl.float32)
    n = tl.load(lens_ptr + b)
    max_blocks = tl.load(width_ptr)
    m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_G,), tl.float32)
    acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
    for start in range(0, n, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        valid = pos < n
        block = tl.load(tables_ptr + b * max_blocks + pos // BS, mask=valid, other=0).to(tl.int64)
        rows = ((block * BS + pos % BS) * KVH + kvh)[:, None] * D + d[None, :]
        kv_mask = valid[:, None] & dm[None, :]
        k = tl.load(k_ptr + rows, mask=kv_mask, other=0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        p = tl.exp(scores - m_new[:, None])
        alpha = tl.exp(m_i - m_new)
        v = tl.load(v_ptr + rows, mask=kv_mask, other=0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(
        out_ptr + (b * H + heads)[:, None] * D + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=gm[:, None] & dm[None, :],
    )


def old_decode_attention(q, k_cache, v_cache, tables, lens, width) -> torch.Tensor:
    out = torch.empty_like(q)
    group = HEADS // KV_HEADS
    block_g, block_d = triton.next_power_of_2(group), triton.next_power_of_2(DIM)
    _old_decode_kernel[(q.shape[0], KV_HEADS)](
        q,
        k_cache,
        v_cache,
        tables,
        width,
        lens,
        out,
        DIM**-0.5,
        H=HEADS,
        KVH=KV_HEADS,
        G=group,
        BLOCK_G=block_g,
        D=DIM,
        BLOCK_D=block_d,
        BS=BLOCK,
        BLOCK_N=max(16, min(64, triton.next_power_of_2(max(1, 8192 // (block_g * block_d))))),
    )
    return out


def kv_bytes(bs: int, ctx: int) -> int:
    return bs * ctx * KV_HEADS * DIM * 2 * torch.finfo(DTYPE).bits // 8


def case(bs: int, ctx: int, gen: torch.Generator) -> dict:
    """Caches for enough layers to rotate past L2, each request's blocks shuffled."""
    blocks = bs * -(-ctx // BLOCK)
    layers = max(1, min(64, -(-ROTATE_BYTES // kv_bytes(bs, ctx))))
    shape = (blocks * BLOCK, KV_HEADS, DIM)
    caches = [
        tuple(torch.randn(shape, dtype=DTYPE, device="cuda") for _ in "kv") for _ in range(layers)
    ]
    tables = torch.randperm(blocks, generator=gen).view(bs, -1).cuda()
    return {
        "q": torch.randn(bs, HEADS, DIM, generator=gen).to(DTYPE).cuda(),
        "caches": caches,
        "tables": tables,
        "lens": torch.full((bs,), ctx, device="cuda"),
        "width": torch.tensor([tables.shape[1]], device="cuda"),
    }


def graph_us(call, layers: int) -> float:
    """Time per call: one graph of max(16, layers) calls over the rotating caches."""
    calls = max(16, layers)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(layers):
            call(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i % layers)
    return median_us(graph.replay, "cuda", reps=20) / calls


def bench(bs: int, ctx: int, gen: torch.Generator, copy: float) -> tuple[dict, str]:
    c = case(bs, ctx, gen)
    q, caches, tables, lens, width = c["q"], c["caches"], c["tables"], c["lens"], c["width"]
    splits = decode_splits(bs, KV_HEADS, "cuda")

    def auto(i):
        return paged_decode_attention(q, *caches[i], tables, lens, BLOCK, width)

    def one(i):
        return paged_decode_attention(q, *caches[i], tables, lens, BLOCK, width, splits=1)

    def old(i):
        return old_decode_attention(q, *caches[i], tables, lens, width)

    diff = max((f(0).float() - old(0).float()).abs().max().item() for f in (auto, one))
    mb = kv_bytes(bs, ctx) / 1e6
    row = {"bs": bs, "ctx": ctx, "splits": splits, "kv_mb": mb, "max_abs_diff_vs_old": diff}
    line = f"{bs:>4} {ctx:>5} {splits:>6} {mb:>8.1f}"
    for name, call in (("auto", auto), ("1 split", one), ("old", old)):
        us = graph_us(call, len(caches))
        gbs = mb * 1e6 / (us * 1e3)
        row[name] = {"us": us, "gbs": gbs, "pct_copy": 100 * gbs / copy}
        line += f" | {us:>10.1f} {gbs:>6.0f} {100 * gbs / copy:>5.0f}"
    return row, line + f" | {diff:.1e}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bs", default="1,16,64,256")
    ap.add_argument("--ctx", default="512,2048,8192")
    ap.add_argument("--out")
    args = ap.parse_args()
    props = torch.cuda.get_device_properties(0)
    copy = copy_bandwidth_gbs("cuda")
    results: dict = {
        "device": props.name,
        "sms": props.multi_processor_count,
        "copy_bandwidth_gbs": copy,
        "rows": [],
    }
    print(f"{props.name}, {props.multi_processor_count} SMs, copy {copy:.0f} GB/s")
    head = f"{'bs':>4} {'ctx':>5} {'splits':>6} {'KV MB':>8}"
    for name in ("auto", "1 split", "old"):
        head += f" | {name + ' us':>10} {'GB/s':>6} {'%copy':>5}"
    print(head + " | max|new-old|")
    gen = torch.Generator().manual_seed(0)
    for bs in map(int, args.bs.split(",")):
        for ctx in map(int, args.ctx.split(",")):
            row, line = bench(bs, ctx, gen, copy)
            print(line, flush=True)
            results["rows"].append(row)
            torch.cuda.empty_cache()
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
