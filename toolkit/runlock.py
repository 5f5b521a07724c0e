"""One trainer per run folder: `<run>/.run.lock`, an fcntl lock the trainer holds for its life.

The file says who holds it (Slurm job id, pid, host); the lock itself is the kernel's, so it is
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
import time
from pathlib import Path

LOCK = ".run.lock"


class RunFolderBusy(RuntimeError):
    """Another trainer holds the run folder; the message is one line naming it."""


def _who(path: Path) -> str:
    try:
        info = json.loads(path.read_text())
        job, pid, host = info.get("job"), info.get("pid"), info.get("host")
    except (OSError, ValueError, AttributeError):
        return "another trainer"
    return (f"job {job} " if job else "a trainer ") + f"(pid {pid} on {host})"


def holder(run_dir: str | os.PathLike[str]) -> str | None:
    """Who holds `run_dir` now ("job 12 (pid 345 on node1)"), or None when nobody does (on this
    host). Never creates the lock file."""
    path = Path(run_dir) / LOCK
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _who(path)
    finally:
        os.close(fd)
    return None


def acquire(run_dir: str | os.PathLike[str], job: str | None = None) -> int:
    """Take `run_dir`'s lock for this process (the fd to keep open; `release` or exit frees it),
    or raise RunFolderBusy naming the holder."""
    path = Path(run_dir) / LOCK
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunFolderBusy(f"run folder {run_dir} is in use by {_who(path)}: one trainer writes a run folder at a "
                            "time; wait for it to end (or cancel it), or give another --out") from None
    except BaseException:
        os.close(fd)
        raise
    record = {"job": job or os.environ.get("SLURM_JOB_ID"), "pid": os.getpid(), "host": socket.gethostname(),
              "time": time.time()}
    os.ftruncate(fd, 0)
    os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    return fd


def release(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # closing the last descriptor drops the flock; the file stays (its content is stale, harmless)
