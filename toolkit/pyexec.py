"""How the toolkit starts a Python child: never with the current directory on its sys.path.

`python -c CODE` puts '' (the current directory) first on sys.path and `python -m MOD` puts the
current directory there: run from a world-writable directory holding another user's `fla/` or
`submitit/`, the child would import that user's code, as the user who started it (root on a node).
`-P` (Python 3.11+) leaves the current directory out; 3.10 has no `-P`, so there it is `-I`
(isolated: PYTHON* variables and the user's site-packages are then ignored too).
"""

from __future__ import annotations

import sys

NO_CWD: tuple[str, ...] = ("-P",) if sys.version_info >= (3, 11) else ("-I",)


def python(*args: str) -> list[str]:
    """argv of this interpreter running `args` without the current directory on sys.path."""
    return [sys.executable, *NO_CWD, *args]
