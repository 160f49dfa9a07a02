"""The Triton compilation counter: every compiled variant counted, and once start-up is over
(``serving``) each one logged with its variant, since it stalls a request's step."""

from __future__ import annotations

import pytest

from engramrt.kernels.compiles import compilations, count_compilations, recent, serving


def test_a_compilation_while_serving_is_logged_with_its_variant(capsys) -> None:
    if not count_compilations():
        pytest.skip("this Triton has no post-compile hook")
    import triton

    hook = triton.knobs.runtime.jit_post_compile_hook
    before = compilations()
    serving(False)
    hook(repr="_early[(M=i32)]")  # start-up: counted, not logged
    assert compilations() == before + 1 and recent()[-1] == "_early[(M=i32)]"
    assert "while serving" not in capsys.readouterr().err
    serving()
    try:
        hook(repr="_late[(count=i32)]")
    finally:
        serving(False)
    err = capsys.readouterr().err
    assert compilations() == before + 2
    assert recent()[-2:] == ["_early[(M=i32)]", "_late[(count=i32)]"]
    assert "compiled while serving" in err and "_late[(count=i32)]" in err
