"""Paged prefill attention on one GPU at the 4B preset's shapes (24 query heads, 8 KV heads, head
dim 128, bf16, block size 16), against causal FLOPs and the bf16 matmul rate. CUDA only.

    python benchmarks/prefill_attention.py [--out f.json] [--cases 1x2048,1x8192,4x2048]
        [--block-m 64,128] [--block-n 32,64,128] [--warps 4,8] [--stages 2,3]

Cases: ``RxT`` is R requests of T new tokens each, from position 0 (every key is the request's
own, already written to the cache over shuffled blocks). Variants, timed in the same run:
``default`` (``prefill_config``), a sweep of launch configs of the same kernel (a config that
does not compile, e.g. out of shared memory, is reported with its error), ``m32n32`` (the
kernel with the replaced kernel's tile sizes and Triton's default 4 warps, 3 stages), ``old``
(the replaced kernel itself, kept here only for this comparison) and ``sdpa`` (torch's
``scaled_dot_product_attention``, flash backend, ``is_causal``, ``enable_gqa``, on the same Q/K/V
gathered contiguous: the anchor). Time: ``triton.testing.do_bench`` median (L2 flushed between
calls). FLOPs: ``4 * H * D * T * (T + 1) / 2`` per request (QK^T and PV over the causal
triangle, diagonal included). ``max_abs_diff``: against the sdpa output.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from engramrt.kernels.paged_attention import paged_prefill_attention, prefill_config
from engramrt.kernels.tiles import prefill_tiles

HEADS, KV_HEADS, DIM, BLOCK, DTYPE = 24, 8, 128, 16, torch.bfloat16
DEV = "cuda"


@triton.jit
def _old_prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    qstart_ptr,
    pos0_ptr,
    tile_req_ptr,
    tile_m0_ptr,
    scale,
    max_blocks,
    H: tl.constexpr,
    KVH: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    """The replaced kernel (engramrt before this one), unchanged: grid (32-query tile, head)."""
    tile, h = tl.program_id(0), tl.program_id(1)
    kvh = h // (H // KVH)
    b = tl.load(tile_req_ptr + tile)
    m0 = tl.load(tile_m0_ptr + tile)
    q0 = tl.load(qstart_ptr + b)
    n = tl.load(qstart_ptr + b + 1) - q0
    p0 = tl.load(pos0_ptr + b)
    m = m0 + tl.arange(0, BLOCK_M)
    mvalid = m < n
    qpos = p0 + m
    d = tl.arange(0, BLOCK_D)
    dm = d < D
    q = tl.load(
        q_ptr + ((q0 + m).to(tl.int64)[:, None] * H + h) * D + d[None, :],
        mask=mvalid[:, None] & dm[None, :],
        other=0,
    )
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    hi = p0 + tl.minimum(m0 + BLOCK_M, n)  # keys up to the tile's last query
    for start in range(0, hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        kvalid = kpos < hi
        block = tl.load(tables_ptr + b * max_blocks + kpos // BS, mask=kvalid, other=0)
        rows = (block.to(tl.int64) * BS + kpos % BS) * KVH + kvh
        kt = tl.load(
            k_ptr + rows[None, :] * D + d[:, None], mask=kvalid[None, :] & dm[:, None], other=0
        )
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = s * scale
        causal = (kpos[None, :] <= qpos[:, None]) & kvalid[None, :]
        s = tl.where(causal, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows past the run see no key
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        v = tl.load(
            v_ptr + rows[:, None] * D + d[None, :], mask=kvalid[:, None] & dm[None, :], other=0
        )
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    tl.store(
        out_ptr + ((q0 + m).to(tl.int64)[:, None] * H + h) * D + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=mvalid[:, None] & dm[None, :],
    )


def old_prefill(c: dict) -> torch.Tensor:
    out = torch.zeros_like(c["q"])
    _old_prefill_kernel[(c["old_tiles"][0].numel(), HEADS)](
        c["q"],
        c["k_cache"],
        c["v_cache"],
        out,
        c["tables"],
        c["qstart"],
        c["pos0"],
        *c["old_tiles"],
        DIM**-0.5,
        c["tables"].shape[1],
        H=HEADS,
        KVH=KV_HEADS,
        D=DIM,
        BLOCK_D=DIM,
        BS=BLOCK,
        BLOCK_M=32,
        BLOCK_N=32,
        IEEE=False,
    )
    return out


def case(reqs: int, tokens: int, gen: torch.Generator) -> dict:
    """R requests of T tokens from position 0 over shuffled blocks; Q/K/V also gathered
    contiguous ``[R, heads, T, D]`` for sdpa."""
    blocks = reqs * -(-tokens // BLOCK)
    shape = (blocks * BLOCK, KV_HEADS, DIM)
    k_cache, v_cache = (torch.randn(shape, generator=gen).to(DTYPE).to(DEV) for _ in "kv")
    tables = torch.randperm(blocks, generator=gen).view(reqs, -1).to(DEV)
    q = torch.randn(reqs * tokens, HEADS, DIM, generator=gen).to(DTYPE).to(DEV)
    runs, starts = [tokens] * reqs, [0] * reqs
    pos = torch.arange(tokens, device=DEV)
    rows = tables[:, pos // BLOCK] * BLOCK + pos % BLOCK  # [R, T]

    def tiles(tile_req, tile_m0):
        return torch.tensor(tile_req).to(DEV), torch.tensor(tile_m0).to(DEV)

    old = [(b, m) for b in range(reqs) for m in range(0, tokens, 32)]  # 32 queries, in order
    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "tables": tables,
        "qstart": torch.arange(reqs + 1, device=DEV) * tokens,
        "pos0": torch.zeros(reqs, dtype=torch.int64, device=DEV),
        "tiles": tiles(*prefill_tiles(runs, starts)),
        "old_tiles": tiles([b for b, _ in old], [m for _, m in old]),
        "sdpa_q": q.view(reqs, tokens, HEADS, DIM).transpose(1, 2).contiguous(),
        "sdpa_k": k_cache[rows].transpose(1, 2).contiguous(),
        "sdpa_v": v_cache[rows].transpose(1, 2).contiguous(),
    }


def kernel(c: dict, config: dict | None):
    args = (c["q"], c["k_cache"], c["v_cache"], c["tables"], c["qstart"], c["pos0"], *c["tiles"])

    def call():
        return paged_prefill_attention(*args, BLOCK, config=config)

    return call


def sdpa(c: dict):
    """Flash backend with enable_gqa; where this torch's flash path refuses GQA, K/V repeated to
    every query head (the same FLOPs, more K/V bytes): ``gqa`` in the JSON says which ran."""
    q, k, v = c["sdpa_q"], c["sdpa_k"], c["sdpa_v"]
    group = HEADS // KV_HEADS

    def gqa():
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    try:
        gqa()
        return gqa, True
    except RuntimeError:
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)

        def repeated():
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        return repeated, False


def matmul_tflops(n: int = 8192) -> float:
    a, b = (torch.randn(n, n, device=DEV, dtype=DTYPE) for _ in range(2))
    return 2 * n**3 / do_bench(lambda: a @ b, return_mode="median") / 1e9


def name_of(cfg: dict) -> str:
    return f"m{cfg['BLOCK_M']}n{cfg['BLOCK_N']}w{cfg['num_warps']}s{cfg['num_stages']}"


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1x2048,1x8192,4x2048")
    ap.add_argument("--block-m", type=ints, default=[64, 128])
    ap.add_argument("--block-n", type=ints, default=[32, 64, 128])
    ap.add_argument("--warps", type=ints, default=[4, 8])
    ap.add_argument("--stages", type=ints, default=[2, 3])
    ap.add_argument("--out")
    args = ap.parse_args()
    t0 = time.perf_counter()
    props = torch.cuda.get_device_properties(0)
    peak = matmul_tflops()
    default = prefill_config(DIM, DTYPE)
    configs = {
        "default": None,
        "m32n32": {"BLOCK_M": 32, "BLOCK_N": 32, "num_warps": 4, "num_stages": 3},
    }
    for bm, bn, w, s in itertools.product(args.block_m, args.block_n, args.warps, args.stages):
        cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}
        if cfg != default:
            configs[name_of(cfg)] = cfg
    print(
        f"{props.name}, {props.multi_processor_count} SMs, bf16 matmul {peak:.0f} TFLOP/s; "
        f"default {name_of(default)}",
        flush=True,
    )
    results: dict = {"device": props.name, "matmul_tflops": peak, "default": default, "cases": []}
    gen = torch.Generator().manual_seed(0)
    failed: dict[str, str] = {}  # config -> error: it will not compile for the next case either
    for spec in args.cases.split(","):
        reqs, tokens = map(int, spec.split("x"))
        c = case(reqs, tokens, gen)
        flops = reqs * 4 * HEADS * DIM * tokens * (tokens + 1) / 2
        anchor, grouped = sdpa(c)
        want = anchor().transpose(1, 2).reshape(reqs * tokens, HEADS, DIM).float()
        variants = {name: kernel(c, cfg) for name, cfg in configs.items()}
        variants["old"] = functools.partial(old_prefill, c)
        variants["sdpa"] = anchor
        rows = []
        for name, fn in variants.items():
            row: dict = {"variant": name, "config": configs.get(name)}
            if name in failed:
                row["error"] = failed[name]
                rows.append(row)
                continue
            try:
                got = fn()
                torch.cuda.synchronize()
            except Exception as e:  # out of shared memory, other compile failures
                failed[name] = row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
                continue
            if name == "sdpa":
                got = got.transpose(1, 2).reshape(reqs * tokens, HEADS, DIM)
            row["max_abs_diff"] = (got.float() - want).abs().max().item()
            row["ms"] = do_bench(fn, warmup=10, rep=40, return_mode="median")
            row["tflops"] = flops / row["ms"] / 1e9
            row["pct_matmul"] = 100 * row["tflops"] / peak
            rows.append(row)
        results["cases"].append(
            {
                "case": spec,
                "requests": reqs,
                "tokens": tokens,
                "flops": flops,
                "sdpa_enable_gqa": grouped,
                "rows": rows,
            }
        )
        print(f"\n{spec}: {flops / 1e12:.2f} TFLOP causal; sdpa enable_gqa={grouped}")
        print(f"{'variant':>14} {'ms':>8} {'TFLOP/s':>8} {'%mm':>5} {'max|diff|':>9}")
        timed = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
        for r in timed:
            print(
                f"{r['variant']:>14} {r['ms']:>8.3f} {r['tflops']:>8.1f} {r['pct_matmul']:>5.1f}"
                f" {r['max_abs_diff']:>9.1e}"
            )
        for r in rows:
            if "error" in r:
                print(f"{r['variant']:>14} failed: {r['error'][:90]}")
        c = want = got = variants = anchor = None  # free this case's tensors before the next
        torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)
    results["wall_s"] = time.perf_counter() - t0
    print(f"\n{results['wall_s']:.0f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
