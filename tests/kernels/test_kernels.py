"""Triton gather and gate kernels against the torch reference on random inputs (the hash kernel
runs the whole oracle suite in tests/engram/test_hashing.py). On a CPU they run in Triton's
interpreter; on a GPU natively (``pytest -m triton`` selects the kernel tests)."""

from __future__ import annotations

import functools
import operator

import pytest
import torch

from engramrt.engram.module import engram_gate, gate_from_dot
from engramrt.engram.table import EngramTable
from engramrt.kernels import FORCE_TORCH_ENV
from tests.support.kernel_env import kernel_device, triton_runs

pytestmark = [
    pytest.mark.triton,
    pytest.mark.skipif(not triton_runs(), reason="Triton cannot run here"),
]
DEV = kernel_device()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _fp8_table(rows: int, dim: int, seed: int) -> EngramTable:
    g = torch.Generator().manual_seed(seed)
    wb = torch.randint(0, 256, (rows, dim), generator=g, dtype=torch.uint8)
    wb[(wb == 0x7F) | (wb == 0xFF)] = 0x80  # no NaN; -0.0 on purpose
    sb = torch.randint(0, 200, (rows, dim // 32), generator=g, dtype=torch.uint8)
    sb[0] = 0  # e8m0 byte 0 means 2**-127
    sb[1] = 1  # subnormal products
    return EngramTable(wb.view(torch.float8_e4m3fn), sb.view(torch.float8_e8m0fnu))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("kind", ["fp8", "bf16", "fp32"])
def test_gather_equals_reference_bitwise(kind: str, seed: int) -> None:
    from engramrt.kernels.engram_gather import gather

    g = torch.Generator().manual_seed(seed)
    if kind == "fp8":
        table = _fp8_table(40, 64, seed)
    else:
        dtype = torch.bfloat16 if kind == "bf16" else torch.float32
        table = EngramTable(torch.randn(40, 64, generator=g).to(dtype))
    ids = torch.randint(0, 40, (9, 5), generator=g)
    ids[0, :2] = torch.tensor([0, 1])
    want = table.lookup(ids)  # CPU torch reference
    scale = None if table.scale is None else table.scale.to(DEV)
    got = gather(ids.to(DEV), table.weight.to(DEV), scale).cpu()
    assert torch.equal(_bits(got), _bits(want))
    for world in (2, 3, 4, 8):  # shards read -0.0 elsewhere; their sum is the full lookup
        parts = []
        for r in range(world):
            sh = table.shard(r, world)
            s = None if sh.scale is None else sh.scale.to(DEV)
            parts.append(gather(ids.to(DEV), sh.weight.to(DEV), s, sh.row_start).cpu())
            assert torch.equal(_bits(parts[-1]), _bits(sh.lookup(ids)))
        assert torch.equal(_bits(functools.reduce(operator.add, parts)), _bits(want))


@pytest.mark.parametrize("scales", ["all", "easy"])
def test_gather_every_byte_at_every_scale(scales: str) -> None:
    """Row r holds each e4m3 byte at scale byte r: every (byte, scale) pair through the kernel,
    bitwise equal to the reference (NaN where it is NaN: payloads differ between torch builds).
    "easy": scales 10..246 and no NaN bytes, so
    every tile takes the integer fast path; "all" mixes in tiles that need the general one."""
    from engramrt.kernels.engram_gather import gather

    byte = torch.arange(256, dtype=torch.uint8)
    scale = torch.arange(256, dtype=torch.uint8)
    if scales == "easy":
        byte[(byte & 0x7F) == 0x7F] = 0x80
        scale = scale[10:247]
    w = byte.repeat(scale.numel(), 1)
    s = scale[:, None].repeat(1, 8)
    table = EngramTable(w.view(torch.float8_e4m3fn), s.view(torch.float8_e8m0fnu))
    ids = torch.randperm(scale.numel(), generator=torch.Generator().manual_seed(0))
    ids = ids[: ids.numel() // 3 * 3].view(-1, 3)
    got = gather(ids.to(DEV), table.weight.to(DEV), table.scale.to(DEV)).cpu()
    want = table.lookup(ids)
    nan = want.isnan()
    assert torch.equal(got.isnan(), nan) and (scales == "all") == bool(nan.any())
    assert torch.equal(_bits(got)[~nan], _bits(want)[~nan])


def test_e8m0_zero_byte_through_the_kernel() -> None:
    from engramrt.kernels.engram_gather import gather

    w = torch.full((1, 32), 0x38, dtype=torch.uint8).view(torch.float8_e4m3fn)  # 1.0
    s = torch.zeros(1, 1, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    got = gather(torch.zeros(1, 1, dtype=torch.int64, device=DEV), w.to(DEV), s.to(DEV)).cpu()
    assert torch.equal(got.float(), torch.full((1, 32), 2.0**-127))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gate_matches_reference(dtype: torch.dtype) -> None:
    from engramrt.kernels.engram_gate import gate

    g = torch.Generator().manual_seed(3)
    t, hc, d = 6, 4, 96
    x = torch.randn(t, hc, d, generator=g).to(dtype)
    x[1] = -0.0  # zero stream: dot = +-0 -> the gate's copysign branch
    kv = torch.randn(t, (hc + 1) * d, generator=g).to(dtype)
    q, k = (torch.randn(hc, d, generator=g).to(dtype) for _ in range(2))
    dead = torch.tensor([False, False, True, False, False, True])
    want = engram_gate(x, kv, q, k, 1e-20, dead)
    got = gate(x.to(DEV), kv.to(DEV), q.to(DEV), k.to(DEV), 1e-20, dead.to(DEV)).cpu()
    assert torch.equal(_bits(got[dead]), _bits(x[dead]))  # image rows untouched
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    # a zero stream gives dot = +0.0 or -0.0; either way the gate is sigmoid(+-1e-3), not 0.5
    g0 = gate_from_dot(torch.tensor([0.0, -0.0]))
    assert not torch.any(g0 == 0.5)


def test_dispatch_can_be_forced_to_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    from engramrt.kernels import use_triton

    monkeypatch.setenv(FORCE_TORCH_ENV, "1")
    assert not use_triton("cuda")
    monkeypatch.delenv(FORCE_TORCH_ENV)
    assert use_triton("cuda") and not use_triton("cpu")


@pytest.mark.parametrize(("n", "heads"), [(4, 8), (3, 2)])
def test_hash_kernel_matches_reference_over_random_steps(n: int, heads: int) -> None:
    """Kernels on the kernel device against the torch reference on the CPU, through random
    extends (many requests, runs longer than a program's block, empty runs, padding tokens),
    decodes with padding rows aliasing live slots (num_real as int and as a device tensor) and
    verify blocks committed with every accepted count."""
    import random

    from engramrt.engram import EngramHasher, EngramLayout
    from tests.engram.test_hashing import IMAGE, K, V, make_config

    layout = EngramLayout.from_config(make_config(n, heads))
    tmap = torch.randint(0, K, (V,), generator=torch.Generator().manual_seed(n))
    slots_n = 12
    ker = EngramHasher(layout, tmap, slots_n, DEV, kernels=True)
    ref = EngramHasher(layout, tmap, slots_n, "cpu", kernels=False)
    rng = random.Random(n)
    lengths = [0] * slots_n

    def same(a: torch.Tensor, b: torch.Tensor) -> None:
        assert torch.equal(a.cpu(), b)
        assert torch.equal(ker.history.table[:slots_n].cpu(), ref.history.table[:slots_n])

    def both(method: str, *args, **kw) -> None:
        same(
            getattr(ker, method)(*(a.to(DEV) for a in args), **kw),
            getattr(ref, method)(*args, **kw),
        )

    def toks(count: int) -> torch.Tensor:
        return torch.tensor(
            [IMAGE if rng.random() < 0.05 else rng.randrange(V) for _ in range(count)]
        )

    for _ in range(4):
        req = rng.sample(range(slots_n), 6)
        runs = [rng.choice([0, 1, 5, 40, 70]) for _ in req]
        starts = [lengths[s] for s in req]
        both(
            "extend",
            toks(sum(runs) + 3),
            torch.tensor(req),
            torch.tensor(runs),
            torch.tensor(starts),
        )
        for s, r in zip(req, runs, strict=True):
            lengths[s] += r
        live = rng.sample(range(slots_n), 5)
        rows = [*live, live[0], live[1]]  # two padding rows aliasing live slots
        pos = torch.tensor([lengths[s] for s in rows])
        for num_real in (5, torch.tensor(5)):
            nr = num_real.to(DEV) if isinstance(num_real, torch.Tensor) else num_real
            t = toks(7)
            same(
                ker.decode(t.to(DEV), torch.tensor(rows).to(DEV), pos.to(DEV), num_real=nr),
                ref.decode(t, torch.tensor(rows), pos, num_real=num_real),
            )
            for s in live:
                lengths[s] += 1
            pos = torch.tensor([lengths[s] for s in rows])
        block = 4
        vreq = rng.sample(range(slots_n), 4)
        vpos = torch.tensor([lengths[s] for s in vreq])
        vt = toks(4 * block)
        both("verify", vt, torch.tensor(vreq), vpos)
        acc = torch.tensor([rng.randrange(block) for _ in vreq])
        ker.commit_verify(vt.to(DEV), torch.tensor(vreq).to(DEV), acc.to(DEV))
        ref.commit_verify(vt, torch.tensor(vreq), acc)
        assert torch.equal(ker.history.table[:slots_n].cpu(), ref.history.table[:slots_n])
        for s, a in zip(vreq, acc.tolist(), strict=True):
            lengths[s] += 1 + a


def test_kernels_take_strided_and_int32_inputs() -> None:
    """Views and int32 ids give the reference's answer (the kernels make them contiguous/int64)."""
    from engramrt.engram import EngramHasher, EngramLayout
    from engramrt.kernels.engram_gather import gather
    from tests.engram.test_hashing import K, V, make_config

    layout = EngramLayout.from_config(make_config(4, 8))
    tmap = torch.randint(0, K, (V,), generator=torch.Generator().manual_seed(0))
    ker = EngramHasher(layout, tmap, 4, DEV, kernels=True)
    ref = EngramHasher(layout, tmap, 4, "cpu", kernels=False)
    wide = torch.randint(0, V - 10, (12, 2), generator=torch.Generator().manual_seed(1))
    toks = wide[:, 0]  # a strided view
    args = (torch.tensor([0, 2]), torch.tensor([5, 7]), torch.tensor([0, 3]))
    got = ker.extend(wide.to(DEV)[:, 0], *(a.to(DEV) for a in args))
    assert torch.equal(got.cpu(), ref.extend(toks, *args))
    table = _fp8_table(40, 64, 2)
    ids = torch.randint(0, 40, (6, 3), generator=torch.Generator().manual_seed(2))
    got = gather(ids.int().to(DEV), table.weight.to(DEV), table.scale.to(DEV)).cpu()
    assert torch.equal(_bits(got), _bits(table.lookup(ids)))
