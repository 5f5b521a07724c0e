"""The launcher's own paths. Atomic writes and hashes live in the neutral `toolkit.fsutil`."""

from __future__ import annotations

import os
from pathlib import Path


def launch_home() -> Path:
    """Root of the launcher's per-user state: embedded cluster, job registry, run folders."""
    return Path(os.environ.get("LAUNCH_HOME", Path.home() / ".launch")).expanduser().resolve()
