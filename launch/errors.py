"""One exception type for every user-facing failure.

The CLI turns a `LaunchError` into one line on stderr and a non-zero exit, never a
traceback. Raise it with a message that says what is wrong *and* what to do.
"""

from __future__ import annotations

import os


class LaunchError(Exception):
    """A failure the user can act on; its message is printed as one line."""

    exit_code: int = 2

    def __init__(self, message: str, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


def debug() -> bool:
    """LAUNCH_DEBUG=1 (or yes, true, on) shows the traceback of a user error; 0, no, false, off or empty do not."""
    return os.environ.get("LAUNCH_DEBUG", "").strip().lower() not in ("", "0", "no", "false", "off")
