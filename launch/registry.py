"""The launcher's record of submitted jobs ($LAUNCH_HOME/jobs.jsonl), for list/status/logs."""

from __future__ import annotations

import fcntl
import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from launch.errors import LaunchError
from launch.fsutil import launch_home


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

    def log(self, task: int | None = None, stream: str = "out") -> Path:
        """submitit's per-task log: <folder>/<id>_<task>_log.out|err."""
        return Path(self.folder) / f"{self.job_id}_{self.main_task if task is None else task}_log.{stream}"

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
    path.parent.mkdir(parents=True, exist_ok=True)
    # Appends of one line under an exclusive lock: concurrent submits never interleave.
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.write(json.dumps(asdict(job)) + "\n")
        f.flush()
        os.fsync(f.fileno())


def all_jobs() -> list[JobRecord]:
    path = registry_path()
    if not path.exists():
        return []
    jobs = []
    known = set(JobRecord.__dataclass_fields__)
    for line in path.read_text(errors="replace").splitlines():
        try:
            data = json.loads(line)
            # A record from a newer launcher may carry fields this one does not know.
            jobs.append(JobRecord(**{k: v for k, v in data.items() if k in known}))
        except (json.JSONDecodeError, TypeError, AttributeError):
            continue  # a torn last line from a crash is skipped, not fatal
    return jobs


def find(job_id: str) -> JobRecord:
    if not re.fullmatch(r"\d{1,12}(_\d{1,6})?", job_id):
        raise LaunchError(f"'{job_id}' is not a Slurm job id (digits, e.g. 1234; see `launch list`)")
    for job in reversed(all_jobs()):
        if job.job_id == job_id:
            return job
    raise LaunchError(f"job {job_id} was not submitted from here (see `launch list`; registry {registry_path()})")


def now() -> float:
    return time.time()
