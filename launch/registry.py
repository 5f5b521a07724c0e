"""The launcher's record of submitted jobs ($LAUNCH_HOME/jobs.jsonl), for list/status/logs."""

from __future__ import annotations

import fcntl
import json
import os
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

    @property
    def stdout(self) -> Path:
        return Path(self.folder) / f"{self.job_id}_0_log.out"

    @property
    def stderr(self) -> Path:
        return Path(self.folder) / f"{self.job_id}_0_log.err"

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
    for line in path.read_text().splitlines():
        try:
            jobs.append(JobRecord(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            continue  # a torn last line from a crash is skipped, not fatal
    return jobs


def find(job_id: str) -> JobRecord:
    for job in reversed(all_jobs()):
        if job.job_id == job_id:
            return job
    raise LaunchError(f"job {job_id} was not submitted from here (see `launch list`; registry {registry_path()})")


def now() -> float:
    return time.time()
