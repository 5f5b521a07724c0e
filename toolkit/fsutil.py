"""Small filesystem helpers shared by the launcher and the trainers: atomic writes, fsync, sha256,
and publishing a finished directory over an earlier one without losing a user's files."""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes, mode: int = 0o644) -> None:
    """Write `data` to `path` so that readers see either the old file or the whole new one.

    Temp file in the same directory, fsync, chmod, rename, then fsync the directory so the
    rename itself survives a crash. `mode` is narrowed by the umask, as open() does: a job
    submitted with a private umask (launch.fsutil.private_files) keeps its files private.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode & ~current_umask())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_path(path.parent)


def current_umask() -> int:
    """The process's umask, read without changing it (os.umask can only set it, which would
    race with other threads creating files)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    previous = os.umask(0o022)
    os.umask(previous)
    return previous


def fsync_path(path: str | os.PathLike[str]) -> None:
    """fsync a file or a directory (a directory's fsync makes renames into it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_text(path: str | os.PathLike[str], text: str, mode: int = 0o644) -> None:
    atomic_write_bytes(path, text.encode(), mode)


def sha256_file(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


class DestinationError(ValueError):
    """A directory to publish into that is not ours to replace; one line, nothing written."""


def check_destination(out: Path, is_ours: Callable[[Path], bool]) -> None:
    """DestinationError unless `out` is absent, an empty directory, or one `is_ours` recognises
    (an earlier export, replaced by `publish_dir` with the user's other files kept). A symbolic
    link is refused: replacing it would turn the link into a directory."""
    if out.is_symlink():
        raise DestinationError(f"--out {out} is a symbolic link (to {os.readlink(out)}): nothing written; give the "
                               "directory itself")
    if not out.exists():
        return
    if not out.is_dir():
        raise DestinationError(f"--out {out} exists and is not a directory: nothing written")
    names = sorted(p.name for p in out.iterdir())
    if names and not is_ours(out):
        raise DestinationError(f"--out {out} exists and is not an export (it holds {', '.join(names[:3])}"
                               f"{', ...' if len(names) > 3 else ''}): nothing written; give a new or empty directory")


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError:
        shutil.copy2(src, dst, follow_symlinks=False)


def publish_dir(tmp: Path, out: Path) -> list[str]:
    """Swap the finished directory `tmp` in as `out` atomically (one rename; readers see the old
    directory or the new one). Whatever the old `out` held that `tmp` does not (a user's NOTES.md,
    eval.json) is carried into the new one first, by hard link (else a copy): never deleted.
    Returns the names carried over."""
    kept: list[str] = []
    if out.is_dir() and not out.is_symlink():
        for entry in sorted(out.iterdir()):
            if (tmp / entry.name).exists() or (tmp / entry.name).is_symlink():
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.copytree(entry, tmp / entry.name, symlinks=True, copy_function=_link_or_copy)
            else:
                _link_or_copy(str(entry), str(tmp / entry.name))
            kept.append(entry.name)
        fsync_path(tmp)
        old = out.with_name(f".old-{out.name}-{os.getpid()}")
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    fsync_path(out.parent)
    return kept


def disk_full(exc: BaseException) -> bool:
    """Whether a write failed for want of space (or quota): an OSError's errno, or the text of a
    library's wrapper (torch's RuntimeError, safetensors' SafetensorError: "code: 28")."""
    if getattr(exc, "errno", None) in (errno.ENOSPC, errno.EDQUOT):
        return True
    text = str(exc)
    return "No space left on device" in text or "code: 28," in text or "StorageFull" in text or \
        "Disk quota exceeded" in text


def free_space(path: str | os.PathLike[str]) -> str:
    """Free space where `path` is, in words ("12 MiB"), for a message."""
    try:
        st = os.statvfs(path)
    except OSError:
        return "unknown"
    free = st.f_bavail * st.f_frsize
    return f"{free >> 20} MiB" if free >= 1 << 20 else f"{free >> 10} KiB"
