"""Engram tables in host memory, read by the GPU in place (UVA).

A table too large for the GPU (DeepSeek-V4.1-Flash's two are ~189 GiB), or one whose HBM the KV
cache should have, lives in one anonymous mapping per stage: huge pages requested before its
pages are touched (4 KiB pages make random row reads ~10x slower: a TLB miss each), then, where
there is a GPU, registered with CUDA (``cudaHostRegister``) so kernels read its rows over PCIe
by host address. Not ``pin_memory``: the caching host allocator rounds a 100 GB request up to
128 GB. Registration happens at load, before any CUDA graph is captured (registering during a
capture fails), and is undone when the mapping is released. Without a GPU the mapping is the
same, unregistered, so the tests run the host path on a CPU.
"""

from __future__ import annotations

import mmap
import os
import weakref

import torch

ALIGN = 2 * 2**20  # tensors start on huge-page boundaries
PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped: every context, UVA


class HostMapping:
    """``nbytes`` of anonymous memory, huge pages requested and every page touched; registered
    with CUDA when ``register``. Tensors come from ``tensor``; the memory stays while any of
    them lives."""

    def __init__(self, nbytes: int, register: bool):
        self.nbytes = max(nbytes, 1)
        self._map = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux; elsewhere the mapping still works
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.bytes.fill_(0)  # touch every page now: huge pages are given at first touch
        self.address = self.bytes.data_ptr()
        self.registered = False
        if register:
            err = torch.cuda.cudart().cudaHostRegister(self.address, self.nbytes, PORTABLE_MAPPED)
            if int(err) != 0:
                raise RuntimeError(
                    f"cudaHostRegister of {self.nbytes / 2**30:.2f} GiB of Engram table memory "
                    f"failed ({err}): the host has too little lockable memory (ulimit -l) or "
                    "CUDA cannot map host memory; use --engram-table-memory device"
                )
            self.registered = True
            # tables hold their mapping; at exit the OS takes it back (unregistering then could
            # race a step still replaying on another thread)
            weakref.finalize(self, _unregister, self.address).atexit = False
        self._used = 0

    def tensor(self, shape: list[int] | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The next free ``shape``/``dtype`` region, huge-page aligned."""
        n = 1
        for s in shape:
            n *= s
        size = n * torch.empty((), dtype=dtype).element_size()
        if self._used + size > self.nbytes:
            raise ValueError(f"{size} bytes do not fit the mapping's {self.nbytes - self._used}")
        t = self.bytes[self._used : self._used + size].view(dtype).view(*shape)
        self._used += -(-size // ALIGN) * ALIGN
        return t

    def huge_page_share(self) -> float | None:
        """Of the mapping's resident memory, the share in huge pages (``/proc/self/smaps``);
        None where the kernel does not say."""
        try:
            with open(f"/proc/{os.getpid()}/smaps") as f:
                return huge_page_share(f.read(), self.address)
        except OSError:
            return None


def choose_placement(requested: str, table_bytes: int, device: torch.device | str) -> str:
    """``device`` or ``host``; ``auto``: host when a stage's tables would take more than half
    of its GPU (the rest is for weights, activations and the KV cache), else device. Off GPU
    the tables are in host memory either way: device (no mapping needed)."""
    if requested not in ("auto", "device", "host"):
        raise ValueError(f"Engram table memory must be auto, device or host, got {requested!r}")
    if requested != "auto":
        return requested
    dev = torch.device(device)
    if dev.type != "cuda":
        return "device"
    total = torch.cuda.get_device_properties(dev.index or 0).total_memory
    return "host" if table_bytes > total // 2 else "device"


def check_reads(table, device: torch.device | str, rows: int = 512, seed: int = 0) -> None:
    """The start-up self-test of a host table: random rows gathered by the kernel the forward
    uses, with the ids on ``device`` (on a GPU: read over UVA), against the same rows looked up
    on the CPU. A mismatch or a refusal is an error that says what to do instead."""
    from engramrt.kernels.engram_gather import gather

    g = torch.Generator().manual_seed(seed)
    cols = 8
    ids = torch.randint(
        table.row_start, table.row_start + max(1, table.num_rows), (rows // cols, cols), generator=g
    )
    want = table.lookup(ids)  # ids on the CPU: the torch path, in host memory
    try:
        got = gather(ids.to(device), table.weight, table.scale, table.row_start).cpu()
        ok = torch.equal(got.view(torch.int16), want.view(torch.int16))
        why = "rows differ from the CPU's"
    except Exception as exc:  # noqa: BLE001 - reported below, with what to do
        ok, why = False, f"{type(exc).__name__}: {exc}"
    if not ok:
        raise RuntimeError(
            f"Engram tables in host memory: the GPU cannot read their rows in place ({why}); "
            "use --engram-table-memory device"
        )


def describe(tables: list, where: str) -> str:
    """The start-up line that says where the tables are and how big they are."""
    nbytes = sum(
        t.weight.numel() * t.weight.element_size()
        + (0 if t.scale is None else t.scale.numel() * t.scale.element_size())
        for t in tables
    )
    host = next((t.host for t in tables if t.host is not None), None)
    size = f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"
    if host is None:
        return f"Engram tables: {size} on {where}"
    share = host.huge_page_share()
    huge = "huge pages unknown" if share is None else f"huge pages {share:.0%}"
    pinned = "pinned, read by the GPU in place" if host.registered else "not registered"
    return f"Engram tables: {size} in host memory ({pinned}, {huge})"


def mapping_bytes(sizes: list[int]) -> int:
    """The bytes a mapping needs for tensors of ``sizes`` bytes, each aligned."""
    return sum(-(-s // ALIGN) * ALIGN for s in sizes)


def huge_page_share(smaps: str, address: int) -> float | None:
    """``AnonHugePages / Rss`` of the mapping in ``smaps`` text that holds ``address``."""
    inside, rss, huge = False, None, None
    for line in smaps.splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:  # a mapping's header: lo-hi perms ...
            lo, hi = (int(x, 16) for x in head.split("-"))
            if inside:
                break
            inside = lo <= address < hi
        elif inside and head == "Rss:":
            rss = int(line.split()[1])
        elif inside and head == "AnonHugePages:":
            huge = int(line.split()[1])
    if not rss or huge is None:
        return None
    return huge / rss


def _unregister(address: int) -> None:
    try:
        torch.cuda.cudart().cudaHostUnregister(address)
    except Exception:  # noqa: BLE001, S110 - at interpreter exit CUDA may be gone already
        pass
