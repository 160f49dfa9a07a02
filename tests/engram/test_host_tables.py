"""Engram tables in host memory (``--engram-table-memory host``): the same rows and the same
logits as tables loaded the usual way, left in place when the model moves, streamed from the
shards without a second copy, huge-page coverage read from smaps, the flags, and the start-up
self-test that refuses a GPU that cannot read them. On a GPU (``-m gpu``) host placement
against device placement, eager and in CUDA graphs."""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from engramrt.bundled import GQA_MODEL_DIR
from engramrt.commands.flags import add_engram_memory_flags, engram_table_memory
from engramrt.engram.host_memory import HostMapping, choose_placement, huge_page_share
from engramrt.runner.batch import StepBatch
from engramrt.runner.stage import StageRunner
from tests.support.kernel_env import triton_runs


def _tables(runner: StageRunner) -> list:
    return [runner.model.layers[str(i)].engram.embed for i in runner.model.engram_layer_ids]


def _steps(
    runners: list[StageRunner], seed: int, last_only: bool = False
) -> list[list[torch.Tensor]]:
    """Random prompts in two slots, then decode steps: every runner's logits each step."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(6, 1000) for _ in range(rng.randint(2, 12))] for _ in range(2)]
    out = [[] for _ in runners]
    batch = StepBatch([t for p in prompts for t in p], [0, 1], [len(p) for p in prompts], [0, 0])
    pos = [len(p) for p in prompts]
    for _ in range(4):
        for i, r in enumerate(runners):
            out[i].append(r.compute(batch, last_only=last_only))
        nxt = [rng.randrange(6, 1000) for _ in range(2)]
        batch = StepBatch(nxt, [0, 1], [1, 1], list(pos))
        pos = [p + 1 for p in pos]
    return out


def test_host_placement_gives_the_device_placements_rows_and_logits() -> None:
    d = GQA_MODEL_DIR
    plain = StageRunner.load(d, 2, 64, "cpu", "float32")
    host = StageRunner.load(d, 2, 64, "cpu", "float32", table_memory="host")
    for a, b in zip(_tables(plain), _tables(host), strict=True):
        assert a.host is None and b.host is not None and not b.host.registered
        assert torch.equal(a.weight.view(torch.uint8), b.weight.view(torch.uint8))
        assert torch.equal(a.scale.view(torch.uint8), b.scale.view(torch.uint8))
        lo, hi = b.host.address, b.host.address + b.host.nbytes
        assert lo <= b.weight.data_ptr() < hi and lo <= b.scale.data_ptr() < hi
    host.model.to(torch.float64)  # a move or cast leaves the rows in their mapping
    for b in _tables(host):
        assert b.weight.dtype == torch.float8_e4m3fn and b.host.address <= b.weight.data_ptr()
    host.model.to(torch.float32)
    for x, y in zip(*_steps([plain, host], seed=1), strict=True):
        assert torch.equal(x, y)


def test_huge_page_share_reads_the_mapping_that_holds_the_address() -> None:
    smaps = textwrap.dedent("""\
        7f0000000000-7f0000400000 rw-p 00000000 00:00 0
        Size:               4096 kB
        Rss:                4096 kB
        AnonHugePages:         0 kB
        7f1000000000-7f1040000000 rw-p 00000000 00:00 0
        Size:            1048576 kB
        Rss:             1048576 kB
        AnonHugePages:   1036288 kB
        7f2000000000-7f2000001000 r--p 00000000 08:01 42    /usr/lib/x.so
        Rss:                   4 kB
        AnonHugePages:         0 kB
    """)
    assert huge_page_share(smaps, 0x7F1000200000) == 1036288 / 1048576
    assert huge_page_share(smaps, 0x7F0000000000) == 0.0
    assert huge_page_share(smaps, 0x7F3000000000) is None  # no mapping holds it


def test_a_live_mapping_is_touched_and_reports_its_pages() -> None:
    m = HostMapping(8 * 2**20, register=False)
    t = m.tensor([1024, 256], torch.float32)
    assert t.data_ptr() == m.address and not t.any()
    t.fill_(1.5)
    u = m.tensor([16], torch.uint8)  # the next region starts on a huge-page boundary
    assert (u.data_ptr() - m.address) % (2 * 2**20) == 0 and not u.any()
    share = m.huge_page_share()
    assert share is None or 0.0 <= share <= 1.0
    with pytest.raises(ValueError, match="do not fit"):
        m.tensor([8 * 2**20], torch.uint8)


def test_loading_streams_into_the_mapping(tmp_path) -> None:
    """A 192 MiB table: the load's peak resident memory stays near the table's size (no file
    mapping, no second copy), and the bytes are the file's."""
    rows, dim = 768 * 1024, 256
    weight = torch.randint(0, 255, (rows, dim), dtype=torch.uint8).view(torch.float8_e4m3fn)
    scale = torch.randint(100, 140, (rows, dim // 32), dtype=torch.uint8)
    f = tmp_path / "t.safetensors"
    save_file(
        {
            "layers.0.engram.embed.weight": weight,
            "layers.0.engram.embed.scale": scale.view(torch.float8_e8m0fnu),
        },
        f,
    )
    del weight, scale
    script = textwrap.dedent(f"""
        import resource, torch
        from pathlib import Path
        from safetensors import safe_open
        from engramrt.model.checkpoint import _stream_to_host
        names = ["layers.0.engram.embed.weight", "layers.0.engram.embed.scale"]
        where = {{n: Path({str(f)!r}) for n in names}}
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        state, host = _stream_to_host(where, names, torch.bfloat16, False)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        with safe_open(where[names[0]], framework="pt") as st:
            same = all(torch.equal(state[n].view(torch.uint8), st.get_tensor(n).view(torch.uint8))
                       for n in names)
        print((peak - before) * 1024, same)
    """)
    root = str(Path(__file__).resolve().parents[2])
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONPATH": root},
    )
    grew, same = out.stdout.split()
    size = rows * dim + rows * dim // 32
    assert same == "True"
    assert int(grew) < 1.1 * size + 64 * 2**20, (int(grew) / 2**20, size / 2**20)


@pytest.mark.parametrize("cut", [4, 20, -100])
def test_a_damaged_shard_is_an_error_naming_the_tensor(tmp_path, cut: int) -> None:
    """Cut inside the header length, inside the header, inside the data: each a
    ``CheckpointError`` that names the tensor, not a struct or JSON error."""
    from engramrt.model.checkpoint import CheckpointError, _read_into

    name = "layers.0.engram.embed.weight"
    f = tmp_path / "t.safetensors"
    save_file({name: torch.zeros(64, 32, dtype=torch.uint8)}, f)
    data = f.read_bytes()
    f.write_bytes(data[:cut])
    dst = torch.empty(64, 32, dtype=torch.uint8)
    with pytest.raises(CheckpointError, match=name):
        _read_into(f, name, dst, _NoBar())


class _NoBar:
    def update(self, n: int) -> None:
        pass


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engram_memory_flags(p)
    return p.parse_args(list(argv))


def test_placement_flags_and_vllms_engram_config() -> None:
    assert engram_table_memory(_args()) == "auto"
    assert engram_table_memory(_args("--engram-table-memory", "host")) == "host"
    assert engram_table_memory(_args("--engram-config", '{"cpu_offload": true}')) == "host"
    assert engram_table_memory(_args("--engram-config", '{"cpu_offload": false}')) == "device"
    for bad, msg in [
        ('{"cpu_offload": true, "x": 1}', "takes"),
        ("[1]", "takes"),
        ("{", "not JSON"),
    ]:
        with pytest.raises(ValueError, match=msg):
            engram_table_memory(_args("--engram-config", bad))
    with pytest.raises(ValueError, match="contradicts"):
        engram_table_memory(
            _args("--engram-table-memory", "device", "--engram-config", '{"cpu_offload": true}')
        )
    assert choose_placement("auto", 10**15, "cpu") == "device"  # off GPU: RAM either way
    assert choose_placement("host", 0, "cpu") == "host"
    with pytest.raises(ValueError, match="auto, device or host"):
        choose_placement("gpu", 0, "cpu")


@pytest.mark.skipif(not triton_runs(), reason="Triton cannot run here")
@pytest.mark.triton
def test_the_start_up_self_test_passes_and_fails_loudly(monkeypatch) -> None:
    from engramrt.engram import host_memory
    from engramrt.kernels import engram_gather

    device = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU: a registered mapping
    runner = StageRunner.load(GQA_MODEL_DIR, 1, 16, device, "float32", table_memory="host")
    table = _tables(runner)[0]
    host_memory.check_reads(table, device)  # the real kernel reads the mapping
    real = engram_gather.gather

    def off_by_one_row(ids, *a, **k):
        return real(ids + 1, *a, **k)

    monkeypatch.setattr(engram_gather, "gather", off_by_one_row)
    with pytest.raises(RuntimeError, match="rows differ.*--engram-table-memory device"):
        host_memory.check_reads(table, device)

    def refused(*a, **k):
        raise ValueError("Pointer argument cannot be accessed from Triton (cpu tensor?)")

    monkeypatch.setattr(engram_gather, "gather", refused)
    with pytest.raises(RuntimeError, match="Pointer argument.*--engram-table-memory device"):
        host_memory.check_reads(table, device)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_host_tables_on_a_gpu_equal_device_tables_eager_and_in_graphs() -> None:
    """fp32 and bf16: registered host tables read over UVA give the device tables' logits bit
    for bit, with their rows read ahead at forward entry and without, eagerly and from
    captured graphs (decode and mixed)."""
    d = GQA_MODEL_DIR
    for dtype in ("float32", "bfloat16"):
        dev = StageRunner.load(d, 2, 64, "cuda", dtype)
        host = StageRunner.load(d, 2, 64, "cuda", dtype, table_memory="host")
        plain = StageRunner.load(d, 2, 64, "cuda", dtype, table_memory="host")
        assert all(t.host.registered and t.weight.device.type == "cpu" for t in _tables(host))
        assert dev.prefetcher is None and host.prefetcher is not None  # host rows read ahead
        plain.prefetcher = None  # ... and the same without
        runners = [dev, host, plain]
        for x, y, z in zip(*_steps(runners, seed=2), strict=True):
            assert torch.equal(x, y) and torch.equal(x, z)
        for r in runners:
            r.hasher.history.table.zero_()
            r.capture_graphs(2, 32)
        for x, y, z in zip(*_steps(runners, seed=3, last_only=True), strict=True):
            assert torch.equal(x, y) and torch.equal(x, z)
