"""An ``engramrt`` command line for a child process, which the current directory cannot shadow.

``python -m engramrt`` puts the current directory first on ``sys.path``: run from the parent of
a clone (a folder holding a directory named ``engramrt``), the child imports that directory as
a namespace package instead of the installed one and dies on its first attribute. ``-P``
(Python 3.11+) leaves the directory out; on 3.10 a bootstrap removes it before the import.
"""

from __future__ import annotations

import sys

_BOOT = (
    "import runpy, sys; del sys.path[0]; sys.argv[0] = 'engramrt'; "
    "runpy.run_module('engramrt', run_name='__main__', alter_sys=True)"
)


def engramrt_command(*args: str) -> list[str]:
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", "engramrt", *args]
    return [sys.executable, "-c", _BOOT, *args]
