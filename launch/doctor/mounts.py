"""Which filesystem a path lives on, from /proc/self/mountinfo.

Test seam: LAUNCH_DOCTOR_MOUNTINFO names a file read instead of /proc/self/mountinfo, so a
test can report a directory as being on nfs without an NFS server.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

# Shared/network filesystems: many ranks writing small cache files to these contend on
# metadata and hang in D-state (seen with the Triton cache on Lustre).
NETWORK_FS_TYPES = frozenset({
    "nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs", "smb3", "smbfs", "9p", "ceph", "glusterfs",
    "afs", "panfs", "orangefs", "wekafs", "fuse.sshfs", "fuse.glusterfs", "fuse.ceph", "fuse.cephfs",
    "fuse.beegfs", "fuse.juicefs", "fuse.s3fs", "fuse.gcsfuse", "fuse.rclone", "fuse.lustre",
})


@dataclass(frozen=True)
class Mount:
    mount_point: str
    fstype: str
    source: str

    @property
    def is_network(self) -> bool:
        return self.fstype in NETWORK_FS_TYPES

    @property
    def is_unknown_fuse(self) -> bool:
        return self.fstype.startswith("fuse") and not self.is_network


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape(field: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """Fields: id parent major:minor root mount_point options [optional...] - fstype source super."""
    mounts = []
    for line in text.splitlines():
        fields = line.split()
        if "-" not in fields:
            continue
        sep = fields.index("-")
        if sep < 5 or len(fields) < sep + 3:
            continue
        mounts.append(Mount(_unescape(fields[4]), fields[sep + 1], _unescape(fields[sep + 2])))
    return mounts


def read_mounts(env: Mapping[str, str]) -> list[Mount]:
    path = env.get("LAUNCH_DOCTOR_MOUNTINFO") or "/proc/self/mountinfo"
    return parse_mountinfo(Path(path).read_text())


def nearest_existing(path: Path) -> Path:
    p = path
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def mount_of(path: Path, mounts: list[Mount]) -> Mount | None:
    """The mount holding `path` (longest mount-point prefix; a later mount hides an earlier one)."""
    real = os.path.realpath(nearest_existing(path))
    best: Mount | None = None
    for m in mounts:
        mp = m.mount_point.rstrip("/") or "/"
        inside = real == mp or mp == "/" or real.startswith(mp + "/")
        if inside and (best is None or len(mp) >= len(best.mount_point.rstrip("/") or "/")):
            best = m
    return best
