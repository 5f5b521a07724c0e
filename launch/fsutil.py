"""The launcher's own paths. Atomic writes and hashes live in the neutral `toolkit.fsutil`."""

from __future__ import annotations

import os
from pathlib import Path

from launch.errors import LaunchError


def launch_home() -> Path:
    """Root of the launcher's per-user state: embedded cluster, job registry, run folders.
    LAUNCH_HOME, or ~/.launch when it is unset or empty (as XDG_* variables are read)."""
    raw = os.environ.get("LAUNCH_HOME", "")
    home = Path(raw if raw.strip() else Path.home() / ".launch").expanduser().resolve()
    # The path reaches sbatch's --output/--error lines: a newline there would start a new #SBATCH line.
    if any(ord(c) < 32 or c == "\x7f" for c in str(home)):
        raise LaunchError(f"LAUNCH_HOME={str(home)!r} has a control character; point it at a plain directory path")
    if home.exists() and not home.is_dir():
        raise LaunchError(f"LAUNCH_HOME={home} is not a directory; point LAUNCH_HOME at a directory "
                          "(default ~/.launch)")
    return home
