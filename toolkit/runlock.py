"""One trainer per run folder: a flock on the run directory itself and on `<run>/.run.lock`, held
by the trainer for its life and checked again before every checkpoint write.

The directory's lock cannot be undone by removing or swapping `.run.lock` (a second trainer would
otherwise take a fresh file's lock and both would train the folder); the file's lock stays for
file systems without directory locks. The file says who holds it (Slurm job id, pid, host); the lock itself is the kernel's, so it is
released however the holder ends (SIGKILL included) and never goes stale. The launcher probes it
before submitting a resume or a job with the same `--out`, the trainer takes it before it writes
anything in the folder, and `launch`'s job wrapper writes config.yaml only when nobody holds it.
flock(2) is per host on most network file systems: the launcher also asks Slurm about the jobs
it recorded for the folder (launch.submit), which covers a trainer on another node.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import stat
import time
from dataclasses import dataclass
from pathlib import Path

LOCK = ".run.lock"


class RunFolderBusy(RuntimeError):
    """Another trainer holds the run folder; the message is one line naming it."""


class RunFolderLost(RuntimeError):
    """The run folder this trainer locked was replaced or its lock file removed under it: another
    trainer may be writing there now; one line, the trainer stops before its next write."""


@dataclass
class Held:
    """The run folder's lock as its holder keeps it: an fd on the directory itself (flock; a
    removed or swapped `.run.lock` does not free it) and on `.run.lock` (flock too: a network file
    system without directory locks still has it)."""

    run_dir: Path
    dir_fd: int | None
    file_fd: int
    job: str | None = None


_WHO_MAX = 4096


def _who(path: Path) -> str:
    """The holder's line from `.run.lock`: opened without following a link or blocking (a FIFO
    there answers at once), a small regular file only."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return "another trainer"
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return "another trainer"
        info = json.loads(os.read(fd, _WHO_MAX))
        job, pid, host = info.get("job"), info.get("pid"), info.get("host")
    except (OSError, ValueError, AttributeError):
        return "another trainer"
    finally:
        os.close(fd)
    return (f"job {job} " if job else "a trainer ") + f"(pid {pid} on {host})"


def _locked_by_other(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False  # a file system without flock on it: the other lock, and Slurm's records, say
    return False


def holder(run_dir: str | os.PathLike[str]) -> str | None:
    """Who holds `run_dir` now ("job 12 (pid 345 on node1)"), or None when nobody does (on this
    host). Never creates anything, never blocks (a FIFO at `.run.lock` is not opened for reading)."""
    path = Path(run_dir) / LOCK
    for target, flags in ((Path(run_dir), os.O_DIRECTORY), (path, os.O_NOFOLLOW)):
        try:
            fd = os.open(target, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | flags)
        except OSError:
            continue
        try:
            if (flags == os.O_DIRECTORY or stat.S_ISREG(os.fstat(fd).st_mode)) and _locked_by_other(fd):
                return _who(path)
        finally:
            os.close(fd)
    return None


def acquire(run_dir: str | os.PathLike[str], job: str | None = None) -> Held:
    """Take `run_dir`'s lock for this process (keep the result; `release` or exit frees it), or
    raise RunFolderBusy naming the holder."""
    run_dir = Path(run_dir)
    path = run_dir / LOCK
    busy = RunFolderBusy(f"run folder {run_dir} is in use by {{who}}: one trainer writes a run folder at a time; "
                         "wait for it to end (or cancel it), or give another --out")
    dir_fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(dir_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(dir_fd)
        raise RunFolderBusy(str(busy).format(who=_who(path))) from None
    except OSError:  # no flock on directories here (some network file systems): the file's alone
        os.close(dir_fd)
        dir_fd = None
    try:
        file_fd = _open_lock_file(path)
    except BaseException:
        if dir_fd is not None:
            os.close(dir_fd)
        raise
    try:
        fcntl.flock(file_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException as exc:
        os.close(file_fd)
        if dir_fd is not None:
            os.close(dir_fd)
        if isinstance(exc, BlockingIOError):
            raise RunFolderBusy(str(busy).format(who=_who(path))) from None
        raise
    held = Held(run_dir, dir_fd, file_fd, job or os.environ.get("SLURM_JOB_ID"))
    _write_who(held)
    return held


def _open_lock_file(path: Path) -> int:
    """`.run.lock`, a regular file: something else there (a FIFO, a directory) is replaced, never
    opened for reading or followed."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISREG(st.st_mode):
        if stat.S_ISDIR(st.st_mode):
            raise RunFolderBusy(f"run folder {path.parent}: {LOCK} is a directory; remove it")
        path.unlink()
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)


def _write_who(held: Held) -> None:
    record = {"job": held.job, "pid": os.getpid(), "host": socket.gethostname(),
              "time": time.time()}
    os.ftruncate(held.file_fd, 0)
    os.pwrite(held.file_fd, (json.dumps(record) + "\n").encode(), 0)


def check_held(held: Held | None) -> None:
    """Before a write into the run folder: the folder at its path is still the one this process
    locked, and `.run.lock` still its file. Removed or replaced, another trainer may hold the new
    one: RunFolderLost, one line (nothing is written)."""
    if held is None:
        return
    try:
        now = held.run_dir.stat()
    except OSError as exc:
        raise RunFolderLost(f"run folder {held.run_dir} is gone ({exc.strerror}); this trainer stops "
                            "before writing there") from None
    if held.dir_fd is not None:
        mine = os.fstat(held.dir_fd)
        if (mine.st_dev, mine.st_ino) != (now.st_dev, now.st_ino):
            raise RunFolderLost(f"run folder {held.run_dir} was replaced while this trainer held it; another "
                                "trainer may be writing there: this one stops before its next write")
    try:
        lock_now = (held.run_dir / LOCK).lstat()
    except FileNotFoundError:
        lock_now = None
    mine = os.fstat(held.file_fd)
    if lock_now is None or (lock_now.st_dev, lock_now.st_ino) != (mine.st_dev, mine.st_ino):
        if held.dir_fd is None:  # the file was the only lock: another trainer may have taken a new one
            raise RunFolderLost(f"run folder {held.run_dir}: its {LOCK} was removed or replaced while this trainer "
                                "held it; another trainer may be writing there: this one stops before its next write")
        # the directory's lock still holds: put the holder's line back where `launch` reads it
        os.close(held.file_fd)
        held.file_fd = _open_lock_file(held.run_dir / LOCK)
        try:
            fcntl.flock(held.file_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunFolderLost(f"run folder {held.run_dir}: another process locked its new {LOCK}; this trainer "
                                "stops before its next write") from None
        _write_who(held)


def release(held: Held | None) -> None:
    if held is not None:
        # closing the descriptors drops the flocks; the file stays (its content is stale, harmless)
        for fd in (held.file_fd, held.dir_fd):
            if fd is not None:
                os.close(fd)
