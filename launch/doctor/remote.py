"""`launch doctor --on-cluster`: the doctor as a short Slurm job with the job's resources.

It goes through the same submitit executor as `launch submit` (same GRES, CPUs, partition and
the same job environment: node-local cache variables and the spec's env), with one task and a
short time limit, to whichever Slurm the environment names (SLURM_CONF, or the embedded one).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from launch.doctor.job import JobRequirements
from launch.doctor.results import CheckResult, Status
from launch.errors import LaunchError
from launch.fsutil import launch_home

DOCTOR_TIME_LIMIT_MIN = 15


def doctor_in_allocation(job: str | None, preset: str | None, lock_path: str | None) -> list[dict[str, str]]:
    """Runs inside the Slurm job: the full doctor, expecting to be in an allocation."""
    from launch.doctor import run_checks

    results = run_checks(job, preset=preset, lock_path=Path(lock_path) if lock_path else None,
                         expect_allocation=True)
    rows = [r.to_dict() for r in results]
    if int(os.environ.get("SLURM_JOB_NUM_NODES", "1")) > 1:  # one task per node: say whose rows
        node = os.environ.get("SLURMD_NODENAME", "?")
        rows = [{**row, "check": f"{node}: {row['check']}"} for row in rows]
    return rows


def run_on_cluster(job: JobRequirements | None, lock_path: Path | None, wait_s: float | None = None,
                   nodes: int = 1) -> list[CheckResult]:
    """The doctor in an allocation like the job's; with `nodes` > 1, one task on each node."""
    import submitit

    from launch.jobspec import JobSpec, ResolvedJob
    from launch.slurmenv import require_slurm_clients, slurm_env
    from launch.submit import make_executor

    env_extra = slurm_env()
    require_slurm_clients()
    os.environ.update(env_extra)  # submitit calls sbatch with this process's environment
    if job is not None and job.resolved is not None:
        resolved = job.resolved
    else:
        spec = JobSpec(name="doctor", entrypoint="launch.doctor", source=Path("<none>"))
        resolved = ResolvedJob(spec=spec, preset=None, resources=spec.resources, args={}, env={})
    folder = launch_home() / "doctor" / time.strftime("%Y%m%d-%H%M%S")
    executor = make_executor(resolved, folder, resolved.spec.scratch)
    executor.update_parameters(job_name="launch-doctor", time=DOCTOR_TIME_LIMIT_MIN, nodes=nodes, ntasks_per_node=1)
    try:
        sjob = executor.submit(doctor_in_allocation, job.source and str(job.source) if job else None,
                               job.preset if job else None, str(lock_path.resolve()) if lock_path else None)
    except Exception as exc:  # submitit wraps sbatch failures in several exception types
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        detail = next((ln for ln in lines if "error" in ln.lower()), lines[-1] if lines else type(exc).__name__)
        raise LaunchError(f"sbatch refused the doctor job: {detail.strip()}") from None
    print(f"doctor submitted as Slurm job {sjob.job_id}; logs in {folder}", file=sys.stderr, flush=True)
    deadline = time.monotonic() + (wait_s if wait_s is not None else (DOCTOR_TIME_LIMIT_MIN + 10) * 60)
    try:
        while not sjob.done():
            if time.monotonic() > deadline:
                sjob.cancel(check=False)
                raise LaunchError(f"doctor job {sjob.job_id} did not finish in time and was cancelled; "
                                  f"is the partition busy? logs: {folder}")
            time.sleep(1.0)
        rows = [row for task_rows in sjob.results() for row in task_rows]
    except KeyboardInterrupt:
        sjob.cancel(check=False)
        raise
    except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as exc:
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        raise LaunchError(f"doctor job {sjob.job_id} failed: {lines[-1] if lines else exc}; logs: {folder}") from None
    return [CheckResult(r["check"], Status(r["status"]), r["found"], r["fix"]) for r in rows]
