"""The launcher's record of submitted jobs ($LAUNCH_HOME/jobs.jsonl), for list/status/logs."""

from __future__ import annotations

import dataclasses
import fcntl
import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from launch.errors import LaunchError
from launch.fsutil import launch_home

JOB_ID_RE = re.compile(r"\d{1,12}(_\d{1,6})?", re.ASCII)


@dataclass
class JobRecord:
    job_id: str
    name: str
    preset: str | None
    folder: str
    submitted_at: float
    slurm_conf: str | None
    argv: list[str]
    kind: str = "job"  # or "doctor" (launch doctor --on-cluster)
    tasks: int = 1
    main_task: int = 0  # the task `launch logs` shows by default (DFlash: the drafter)
    # `launch resume`: the run folder this job continues (metrics, checkpoints, summary live
    # there, not in this job's own folder) and the job it continues.
    run_dir: str | None = None
    resumes: str | None = None
    spec: str | None = None  # the spec file it was submitted from (`launch resume` takes this one)

    def log(self, task: int | None = None, stream: str = "out") -> Path:
        """submitit's per-task log: <folder>/<id>_<task>_log.out|err."""
        return Path(self.folder) / f"{self.job_id}_{self.main_task if task is None else task}_log.{stream}"

    @property
    def run_folder(self) -> Path:
        """Where the run's metrics.jsonl, checkpoints and summary.json are."""
        return Path(self.run_dir or self.folder)

    @property
    def stdout(self) -> Path:
        return self.log(None, "out")

    @property
    def stderr(self) -> Path:
        return self.log(None, "err")

    def slurm_env(self) -> dict[str, str]:
        return {"SLURM_CONF": self.slurm_conf} if self.slurm_conf else {}


def registry_path() -> Path:
    return launch_home() / "jobs.jsonl"


def record(job: JobRecord) -> None:
    path = registry_path()
    try:
        if not path.parent.exists():
            path.parent.mkdir(parents=True, mode=0o700)  # LAUNCH_HOME: the user's alone
        # Appends of one line under an exclusive lock: concurrent submits never interleave. The
        # registry names every job's folder and command line: the user's alone (an older 0644
        # registry is narrowed here).
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if os.fstat(fd).st_mode & 0o077:
            os.fchmod(fd, 0o600)
        with os.fdopen(fd, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            f.write(json.dumps(asdict(job)) + "\n")
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise LaunchError(f"job {job.job_id} was queued but cannot be recorded in {path} ({exc.strerror}); "
                          f"follow it with Slurm's own tools (squeue -j {job.job_id}, scancel {job.job_id})") from None


def check_writable() -> None:
    """Before queueing anything: the registry can take one more line (nothing is written)."""
    path = registry_path()
    target = path if path.exists() else path.parent
    while not target.exists():
        target = target.parent
    if path.exists() and not path.is_file():
        raise LaunchError(f"job registry {path} is not a file; move it aside, then submit again")
    if not os.access(target, os.W_OK):
        raise LaunchError(f"job registry {path} is not writable; fix its permissions or set LAUNCH_HOME")


_KINDS = {"job_id": str, "name": str, "folder": str, "kind": str}


def _record_problem(data: object) -> str | None:
    """Why one parsed registry line is not a job record, or None."""
    if not isinstance(data, dict):
        return f"a JSON {type(data).__name__}, not a record"
    missing = [k for k, f in JobRecord.__dataclass_fields__.items()
               if k not in data and f.default is dataclasses.MISSING]
    if missing:
        return f"no {', '.join(missing)}"
    for key, kind in _KINDS.items():
        if key in data and not isinstance(data[key], kind):
            return f"{key} is not a string"
    if not JOB_ID_RE.fullmatch(data["job_id"]):
        return f"job_id {data['job_id']!r} is not a Slurm job id"
    if any(data.get(k) is not None and not isinstance(data[k], str) for k in ("preset", "slurm_conf", "run_dir", "resumes")):
        return "preset, slurm_conf, run_dir or resumes is not a string"
    if isinstance(data["submitted_at"], bool) or not isinstance(data["submitted_at"], (int, float)):
        return "submitted_at is not a time"
    if not isinstance(data["argv"], list) or not all(isinstance(a, str) for a in data["argv"]):
        return "argv is not a list of strings"
    tasks, main = data.get("tasks", 1), data.get("main_task", 0)
    if type(tasks) is not int or type(main) is not int or not 0 <= main < tasks:
        return "tasks/main_task are not task counts"
    return None


def load() -> tuple[list[JobRecord], list[str]]:
    """The records, oldest first, and one 'line N: why' for each line that is not one (a torn
    last line from a crash, a hand edit). Nothing here rewrites the file."""
    path = registry_path()
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return [], []
    except OSError as exc:
        raise LaunchError(f"cannot read the job registry {path} ({exc.strerror}); move it aside or set LAUNCH_HOME") from None
    jobs, bad = [], []
    known = set(JobRecord.__dataclass_fields__)
    for n, line in enumerate(raw.split(b"\n"), 1):
        if not line.strip():
            continue
        try:
            data = json.loads(line.decode("utf-8"))
        except UnicodeDecodeError:
            bad.append(f"line {n}: not UTF-8")
            continue
        except json.JSONDecodeError:
            bad.append(f"line {n}: not JSON (torn or edited)")
            continue
        problem = _record_problem(data)
        if problem:
            bad.append(f"line {n}: {problem}")
            continue
        # A record from a newer launcher may carry fields this one does not know.
        jobs.append(JobRecord(**{k: v for k, v in data.items() if k in known}))
    return jobs, bad


def all_jobs() -> list[JobRecord]:
    return load()[0]


def unreadable_note(bad: list[str]) -> str:
    """'2 lines of ~/.launch/jobs.jsonl are not job records (line 3: not JSON, ...); left as they are'."""
    first = ", ".join(bad[:2]) + (", ..." if len(bad) > 2 else "")
    return f"{len(bad)} line(s) of {registry_path()} are not job records ({first}); left as they are"


def find(job_id: str) -> JobRecord:
    if not JOB_ID_RE.fullmatch(job_id):
        raise LaunchError(f"'{job_id}' is not a Slurm job id (digits, e.g. 1234; see `launch list`)")
    jobs, bad = load()
    for job in reversed(jobs):
        if job.job_id == job_id:
            return job
    if bad:
        raise LaunchError(f"job {job_id} is not in the registry, and {unreadable_note(bad)}")
    raise LaunchError(f"job {job_id} was not submitted from here (see `launch list`; registry {registry_path()})")


def jobs_of_run(run_folder: Path) -> list[JobRecord]:
    """Every job that wrote to this run folder, oldest first: its first job and its resumes."""
    target = run_folder.resolve()
    return [j for j in all_jobs() if j.run_folder.resolve() == target]


def now() -> float:
    return time.time()
