"""The launcher's own paths. Atomic writes and hashes live in the neutral `toolkit.fsutil`."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
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


# Job folders hold the sbatch script (its env values: tokens, keys), pickled calls and logs.
PRIVATE_UMASK = 0o077


@contextlib.contextmanager
def private_files() -> Iterator[None]:
    """Everything created inside is for its owner only: folders 0700, files 0600 (0700 where
    executable). sbatch records this umask (SLURM_UMASK) and the job runs with it, so the job's
    logs, checkpoints and metrics are created the same way."""
    previous = os.umask(PRIVATE_UMASK)
    try:
        yield
    finally:
        os.umask(previous)
