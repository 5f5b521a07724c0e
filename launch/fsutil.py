"""The launcher's own paths. Atomic writes and hashes live in the neutral `toolkit.fsutil`."""

from __future__ import annotations

import contextlib
import os
import stat
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


def foreign_ancestor(path: Path, writable_mask: int = 0o022) -> str | None:
    """Why `path` (or an existing directory above it) could be swapped by another local user:
    one owned by a uid other than ours or root, or writable by others without the sticky bit
    (a 0777 parent lets anyone rename our folder and put theirs in its place; `writable_mask`
    0o002 tolerates a site's group-writable scratch root). None when safe."""
    me = os.geteuid()
    for p in [path, *path.parents]:
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue
        except OSError:
            return None  # not ours to judge (a directory we cannot stat): the mkdir says why
        if st.st_uid not in (me, 0):
            return f"{p} belongs to uid {st.st_uid}, another user"
        if stat.S_ISDIR(st.st_mode) and st.st_mode & writable_mask and not st.st_mode & stat.S_ISVTX:
            return f"{p} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}, no sticky bit)"
    return None
