"""Row invariance on the CPU: a token's numbers do not depend on how many tokens share its step.

CPU BLAS chooses its algorithm by the row count: a one-row product is a GEMV that sums in another
order than a GEMM, and row counts change a GEMM's blocking. So a token decoded alone, verified
beside drafts, prefilled in a chunk or batched with other requests rounds differently in the last
bit, and V4.1's FP8 round trips turn a last bit into another grid point: a near-tie becomes
another greedy token, and speculation changes greedy output. Within one shape, though, the order
of a row's sums depends neither on the other rows nor on the row's place among them. So inside
``row_invariant()`` every float32 ``mm``, ``addmm`` and ``bmm`` on the CPU runs as products of
exactly ``ROWS`` rows, the last tile padded with zeros: each row's result is the one it gets
alone. The tiles are aten's own kernels (the ``out=`` overloads, which are not overridden).

Three elementwise kernels have the same fault in another form: ``sigmoid``, ``silu`` and
``softplus`` round a value one way in the vectorised body of a buffer and another way in its
tail, so a value's last bit depends on where it falls in the tensor. Inside the context they are
computed from ``exp`` and ``log1p``, which round the same everywhere (within two ulps of aten's).
Reductions along a row (norms, softmax) and the other elementwise ops the models use already
are invariant. ``tests/kernels/test_row_invariant.py`` checks all of this, and
``tests/engine/test_speculation_is_exact.py`` what it is for.

Outside the context, or for other dtypes and devices, the overrides call aten's kernels whole.
The GPU side of batch invariance is the kernels' (a fixed split of every reduction).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Iterator

import torch

ROWS = 4  # small: a CPU's small GEMMs are compute-bound, and a decode step has one row
_state = threading.local()
_lib: torch.library.Library | None = None
_lock = threading.Lock()


def _active(*tensors: torch.Tensor) -> bool:
    return getattr(_state, "depth", 0) > 0 and all(t.dtype == torch.float32 for t in tensors)


def _whole(op, *args, **kw) -> torch.Tensor:
    """aten's own kernel, in one call (its ``out=`` overload: not overridden)."""
    return op.out(*args, **kw, out=args[0].new_empty(0))


def _tiled(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` for ``a [B, M, K]``, ``b [B, K, N]`` as ``(ROWS, K) @ (K, N)`` products, one
    call each, all alike (aten's batched product runs an entry with other threads at another
    batch size, which changes its sums)."""
    batch, m, k = a.shape
    pad = -m % ROWS
    if pad:
        a = torch.cat([a, a.new_zeros(batch, pad, k)], 1)
    out = a.new_empty(batch, a.shape[1], b.shape[-1])
    for i in range(batch):
        for lo in range(0, a.shape[1], ROWS):
            torch.ops.aten.mm.out(a[i, lo : lo + ROWS], b[i], out=out[i, lo : lo + ROWS])
    return out[:, :m]


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not _active(a, b):
        return _whole(torch.ops.aten.mm, a, b)
    return _tiled(a[None], b[None])[0]


def _addmm(bias: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, beta=1, alpha=1):
    if not _active(bias, a, b):
        return _whole(torch.ops.aten.addmm, bias, a, b, beta=beta, alpha=alpha)
    prod = _mm(a, b)  # elementwise from here: each row on its own
    if alpha != 1:
        prod = prod * alpha
    return prod if beta == 0 else prod + (bias if beta == 1 else bias * beta)


def _bmm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if not _active(a, b):
        return _whole(torch.ops.aten.bmm, a, b)
    return _tiled(a, b)


def _sigmoid(x: torch.Tensor) -> torch.Tensor:
    if not _active(x):
        return _whole(torch.ops.aten.sigmoid, x)
    return 1 / (1 + torch.exp(-x))


def _silu(x: torch.Tensor) -> torch.Tensor:
    if not _active(x):
        return _whole(torch.ops.aten.silu, x)
    return x / (1 + torch.exp(-x))


def _softplus(x: torch.Tensor, beta=1, threshold=20) -> torch.Tensor:
    if not _active(x):
        return _whole(torch.ops.aten.softplus, x, beta, threshold)
    bx = x * beta
    return torch.where(bx > threshold, x, torch.log1p(torch.exp(bx)) / beta)


def _register() -> None:
    global _lib
    with _lock:
        if _lib is None:
            lib = torch.library.Library("aten", "IMPL")
            with warnings.catch_warnings():  # "overriding a previously registered kernel"
                warnings.simplefilter("ignore", UserWarning)
                for name, fn in KERNELS.items():
                    lib.impl(name, fn, "CPU")
            _lib = lib


KERNELS = {
    "mm": _mm,
    "addmm": _addmm,
    "bmm": _bmm,
    "sigmoid": _sigmoid,
    "silu": _silu,
    "softplus": _softplus,
}


@contextlib.contextmanager
def row_invariant() -> Iterator[None]:
    """Float32 CPU products in fixed tiles of ``ROWS`` rows on this thread while entered."""
    _register()
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
