"""Triton compilations in this process, counted: each new kernel variant met mid-serving stalls
a step for ~0.5 s, so the server logs how many start-up compiled and exports the running total
(``engramrt:triton_compilations_total``); a test asserts that serving after warm-up adds none."""

from __future__ import annotations

import sys

_count = 0
_installed = False
_serving = False  # start-up is over: a compilation now stalls a request, and says so
_recent: list[str] = []  # the last few compiled variants, for messages


def count_compilations() -> bool:
    """Start counting (idempotent); False where this Triton has no post-compile hook."""
    global _installed
    if _installed:
        return True
    try:
        import triton
    except ImportError:
        return False
    runtime = getattr(getattr(triton, "knobs", None), "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return False
    previous = runtime.jit_post_compile_hook

    def hook(*args, **kwargs):
        global _count
        _count += 1
        _recent.append(str(kwargs.get("repr", "?")))
        del _recent[:-8]
        if _serving:
            print(
                f"engramrt: a Triton kernel variant compiled while serving (the step stalls): "
                f"{_recent[-1]}",
                file=sys.stderr,
                flush=True,
            )
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_post_compile_hook = hook
    _installed = True
    return True


def serving(on: bool = True) -> None:
    """Start-up is over (``on``): from now on each compilation is logged with its variant."""
    global _serving
    _serving = on


def compilations() -> int:
    return _count


def recent() -> list[str]:
    """The last (up to 8) compiled variants: kernel name, launch options, argument types."""
    return list(_recent)
