"""Triton Engram kernels against the torch reference on one GPU, with launch and byte floors.

    python benchmarks/engram_kernels.py [--out results.json] [--sweep]

Decode hash+commit: the average over 64 calls captured in one CUDA graph (and an empty Triton
kernel measured the same way: the launch floor), plus eager launch-to-completion time. Extend:
effective GB/s over the bytes the hash must move. Gather and gate at DeepSeek-V4.1-Flash sizes
(24 columns x 256, hidden 5120, hc 4): time against their byte floor at the measured copy rate;
the gather also from a registered host mapping, against the rows' bytes at the pinned copy rate.
``--sweep`` times every launch shape of the extend hash and the gather (the defaults come from
such a sweep).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics

import torch
import triton

from benchmarks.hash_bench import copy_bandwidth_gbs, median_us
from engramrt.bundled import FLASH_CONFIG
from engramrt.config import engram_config
from engramrt.engram import EngramHasher, EngramLayout
from engramrt.engram.host_memory import HostMapping
from engramrt.engram.module import engram_gate
from engramrt.engram.table import EngramTable
from engramrt.kernels import FORCE_TORCH_ENV, engram_gather, engram_hash
from engramrt.kernels.engram_gate import gate
from engramrt.kernels.engram_gather import GatherConfig, gather
from engramrt.kernels.engram_hash import EXTEND

VOCAB, GRAPH_CALLS = 128815, 64


@triton.jit
def _empty(x_ptr):
    pass


def events_us(fn, reps: int = 50) -> float:
    return median_us(fn, "cuda", reps)


def graph_us(fn) -> float:
    """Average per call of GRAPH_CALLS calls captured in one graph."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(GRAPH_CALLS):
            fn()
    return events_us(g.replay, 20) / GRAPH_CALLS


def beside(work, side, reps: int = 10) -> tuple[float, float]:
    """Medians (us) of: the main stream's time for ``work`` while ``side`` runs on another
    stream, and the time until both are done."""
    stream, main, both = torch.cuda.Stream(), [], []
    for _ in range(reps + 2):
        start, work_done, all_done = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        torch.cuda.synchronize()
        start.record()
        stream.wait_event(start)
        with torch.cuda.stream(stream):
            side()
        work()
        work_done.record()
        torch.cuda.current_stream().wait_stream(stream)
        all_done.record()
        torch.cuda.synchronize()
        main.append(start.elapsed_time(work_done) * 1e3)
        both.append(start.elapsed_time(all_done) * 1e3)
    return statistics.median(main[2:]), statistics.median(both[2:])


def h2d_gbs(nbytes: int = 2**30) -> float:
    """Pinned host -> device copy rate: the host tables' floor."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return nbytes / (events_us(lambda: dst.copy_(src, non_blocking=True), 10) * 1e3)


@contextlib.contextmanager
def patched(table: dict, key, value):
    old = table[key]
    table[key] = value
    try:
        yield
    finally:
        table[key] = old


DEVICE_GATHERS = [GatherConfig(p, w, n) for p in (2, 4) for w in (2, 4) for n in (2048, 0)]
HOST_GATHERS = [GatherConfig(p, 4, n) for p in (4, 8, 16, 32) for n in (32, 64, 128, 512)]
EXTEND_LAUNCHES = [(16, 4), (32, 2), (32, 4), (64, 4), (64, 8), (128, 8)]


def hashers(slots: int):
    layout = EngramLayout.from_config(engram_config(json.loads(FLASH_CONFIG.read_text())))
    tmap = torch.randint(0, 99092, (VOCAB,), generator=torch.Generator().manual_seed(0))
    return (
        EngramHasher(layout, tmap, slots, "cuda", kernels=True),
        EngramHasher(layout, tmap, slots, "cuda", kernels=False),
    )


@contextlib.contextmanager
def torch_reference():
    os.environ[FORCE_TORCH_ENV] = "1"
    try:
        yield
    finally:
        del os.environ[FORCE_TORCH_ENV]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--sweep", action="store_true", help="every launch shape, not the defaults")
    args = ap.parse_args()
    bw = copy_bandwidth_gbs("cuda")
    res: dict = {"device": torch.cuda.get_device_name(), "copy_gbs": bw, "rows": []}
    x = torch.zeros(1, device="cuda")
    floor_graph = graph_us(lambda: _empty[(1,)](x))
    floor_eager = events_us(lambda: _empty[(1,)](x))
    res["empty_kernel_us"] = {"graph": floor_graph, "eager": floor_eager}
    print(
        f"copy {bw:.0f} GB/s; empty Triton kernel {floor_graph:.2f} us/graph call, "
        f"{floor_eager:.2f} us eager"
    )
    print(
        f"{'what':28} {'size':>8} {'triton us':>10} {'torch us':>10} {'floor us':>9} "
        f"{'GB/s':>7} {'equal':>6}"
    )

    def row(what, size, tri, ref, nbytes, equal):
        floor = nbytes / (bw * 1e3)
        r = {
            "what": what,
            "size": size,
            "triton_us": tri,
            "torch_us": ref,
            "floor_us": floor,
            "gbs": nbytes / (tri * 1e3),
            "equal": equal,
        }
        res["rows"].append(r)
        print(
            f"{what:28} {size:>8} {tri:>10.2f} {ref:>10.2f} {floor:>9.3f} {r['gbs']:>7.0f} "
            f"{str(equal):>6}"
        )

    per_tok = 8 + 12 + 4 * 8 + 2 * 24 * 8 + 12  # token, row, map reads, ids, row write
    for bs in (1, 16, 64, 256, 1024, 4096):
        tri, ref = hashers(bs)
        toks = torch.randint(0, VOCAB, (bs,), device="cuda")
        slots = torch.randperm(bs, device="cuda")
        pos = torch.randint(3, 4000, (bs,), device="cuda")
        equal = torch.equal(tri.decode(toks, slots, pos), ref.decode(toks, slots, pos))
        equal &= torch.equal(tri.history.table[:bs], ref.history.table[:bs])
        t_g = graph_us(lambda: tri.decode(toks, slots, pos, check=False))
        r_g = graph_us(lambda: ref.decode(toks, slots, pos, check=False))
        row("decode hash+commit (graph)", bs, t_g, r_g, bs * per_tok, equal)
        t_e = events_us(lambda: tri.decode(toks, slots, pos, check=False))
        r_e = events_us(lambda: ref.decode(toks, slots, pos, check=False))
        row("decode hash+commit (eager)", bs, t_e, r_e, bs * per_tok, equal)
    for t_total, nreq in ((8192, 1), (32768, 16), (131072, 64)):
        tri, ref = hashers(nreq)
        toks = torch.randint(0, VOCAB, (t_total,), device="cuda")
        slots = torch.arange(nreq, device="cuda")
        lens = torch.full((nreq,), t_total // nreq, device="cuda")
        start = torch.randint(0, 100, (nreq,), device="cuda")
        equal = torch.equal(
            tri.extend(toks, slots, lens, start), ref.extend(toks, slots, lens, start)
        )
        r_g = graph_us(lambda: ref.extend(toks, slots, lens, start, check=False))
        for launch in EXTEND_LAUNCHES if args.sweep else [engram_hash.LAUNCH[EXTEND]]:
            with patched(engram_hash.LAUNCH, EXTEND, launch):
                t_g = graph_us(lambda: tri.extend(toks, slots, lens, start, check=False))
                starts = torch.empty_like(lens)
                t_k = graph_us(lambda: tri.ops.hash(EXTEND, toks, slots, start, lens, starts))
            tag = f"{launch[0]} tok/prog, {launch[1]} warps"
            row(
                f"extend hash ({nreq} req, graph; {tag})",
                t_total,
                t_g,
                r_g,
                t_total * per_tok,
                equal,
            )
            row(f"  hash kernel alone ({tag})", t_total, t_k, r_g, t_total * per_tok, equal)
    g = torch.Generator(device="cuda").manual_seed(0)
    rows_n = 2**22  # a 1 GiB slice of a table: row ids spread beyond L2
    wb = torch.randint(0, 126, (rows_n, 256), device="cuda", dtype=torch.uint8, generator=g)
    sb = torch.randint(100, 140, (rows_n, 8), device="cuda", dtype=torch.uint8, generator=g)
    host = HostMapping(rows_n * (256 + 8) + 2 * 2**21, register=True)
    hw, hs = host.tensor([rows_n, 256], torch.uint8), host.tensor([rows_n, 8], torch.uint8)
    hw.copy_(wb)
    hs.copy_(sb)
    h2d = h2d_gbs()
    res["h2d_gbs"] = h2d
    print(f"pinned host -> device copy {h2d:.1f} GB/s; host huge pages {host.huge_page_share()}")
    tables = {
        "device": EngramTable(wb.view(torch.float8_e4m3fn), sb.view(torch.float8_e8m0fnu)),
        "host": EngramTable(hw.view(torch.float8_e4m3fn), hs.view(torch.float8_e8m0fnu)),
    }
    for where, table in tables.items():
        for t in (1, 64, 256, 4096):
            ids = torch.randint(0, rows_n, (t, 24), device="cuda", generator=g)
            with torch_reference():
                want = tables["device"].lookup(ids)
                r_e = graph_us(lambda: tables["device"].lookup(ids))
            sweep = HOST_GATHERS if where == "host" else DEVICE_GATHERS
            for cfg in sweep if args.sweep else [engram_gather.default_config(table.weight, ids)]:
                got = gather(ids, table.weight, table.scale, config=cfg)
                equal = torch.equal(got.view(torch.int16), want.view(torch.int16))
                t_e = graph_us(lambda: gather(ids, table.weight, table.scale, config=cfg))
                nbytes = t * 24 * (8 + 256 + 8 + 256 * 2)  # id, fp8 row, scales, bf16 out
                tag = f"{cfg.pairs} pairs, {cfg.num_warps} warps, {cfg.max_programs} programs"
                row(f"gather fp8 ({where}; {tag})", t, t_e, r_e, nbytes, equal)
                if where == "host":  # the host floor: the rows' bytes at the copy rate
                    res["rows"][-1]["host_floor_us"] = t * 24 * (256 + 8) / (h2d * 1e3)
    # a read-ahead runs beside the layers: what a host gather takes from a GEMM and from a copy
    # running at the same time (the main stream's time with the gather beside it, against alone)
    a = torch.randn(4096, 3072, device="cuda").bfloat16()
    w = torch.randn(3072, 9216, device="cuda").bfloat16()
    big = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    work = {"gemm": lambda: [a @ w for _ in range(5)], "copy": lambda: big.clone()}
    table = tables["host"]
    for t in (256, 4096):
        ids = torch.randint(0, rows_n, (t, 24), device="cuda", generator=g)
        for name, fn in work.items():
            alone = events_us(fn, 10)
            sweep = (
                HOST_GATHERS if args.sweep else [engram_gather.default_config(table.weight, ids)]
            )
            for cfg in sweep:
                main_us, total_us = beside(
                    fn, lambda: gather(ids, table.weight, table.scale, config=cfg)
                )
                r = {
                    "what": f"host gather T={t} beside {name}",
                    "pairs": cfg.pairs,
                    "max_programs": cfg.max_programs,
                    "work_alone_us": alone,
                    "work_beside_us": main_us,
                    "total_us": total_us,
                }
                res.setdefault("beside", []).append(r)
                print(
                    f"{r['what']:34} {cfg.pairs:>3} pairs {cfg.max_programs:>4} programs: "
                    f"{name} {alone:.1f} us alone, {main_us:.1f} beside, both done "
                    f"{total_us:.1f}"
                )
    hc, d = 4, 5120
    q, k = (torch.randn(hc, d, device="cuda").bfloat16() for _ in range(2))
    for t in (1, 64, 256, 4096):
        x = torch.randn(t, hc, d, device="cuda").bfloat16()
        kv = torch.randn(t, (hc + 1) * d, device="cuda").bfloat16()
        got = gate(x, kv, q, k, 1e-20)
        with torch_reference():
            want = engram_gate(x, kv, q, k, 1e-20)
            r_e = graph_us(lambda: engram_gate(x, kv, q, k, 1e-20))
        close = bool(torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2))
        t_e = graph_us(lambda: gate(x, kv, q, k, 1e-20))
        nbytes = t * (hc * d * 2 + (hc + 1) * d * 2 + hc * d * 2)  # x, kv in; out
        row("gate (Flash, graph)", t, t_e, r_e, nbytes, close)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
