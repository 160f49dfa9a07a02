"""Triton compilations in this process, counted: each new kernel variant met mid-serving stalls
a step for ~0.5 s, so the server logs how many start-up compiled and exports the running total
(``engramrt:triton_compilations_total``); a test asserts that serving after warm-up adds none."""

from __future__ import annotations

_count = 0
_installed = False
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
        return previous(*args, **kwargs) if previous is not None else None

    runtime.jit_post_compile_hook = hook
    _installed = True
    return True


def compilations() -> int:
    return _count


def recent() -> list[str]:
    """The last (up to 8) compiled variants: kernel name, launch options, argument types."""
    return list(_recent)
