"""Refuse to train outside a real Slurm allocation.

Why: on our GPU nodes a keepalive holder occupies every idle GPU and releases exactly the
GPUs of a Slurm job (from the job's prolog). A trainer started with ssh or bash gets GPUs that
are still held, and runs slow or not at all. So training entrypoints check, before anything
else, that they run inside a Slurm job step that Slurm itself reports as RUNNING.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping

SUBMIT_HINT = "submit with `launch submit <job>`"
WHY = "the node's keepalive GPU holders yield GPUs only to Slurm jobs"


class NotInSlurmAllocation(RuntimeError):
    """Raised (and turned into one line + exit 3 by `require_slurm_allocation`)."""


def _job_state_from_scontrol(job_id: str, env: Mapping[str, str]) -> str:
    """JobState of `job_id` per `scontrol show job`; NotInSlurmAllocation if Slurm does not confirm it."""
    try:
        proc = subprocess.run(
            ["scontrol", "show", "job", job_id], capture_output=True, text=True, timeout=20, env=dict(env)
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NotInSlurmAllocation(f"cannot ask Slurm about job {job_id} ({exc})") from exc
    for field in proc.stdout.split() if proc.returncode == 0 else []:
        if field.startswith("JobState="):
            return field.split("=", 1)[1]
    said = (proc.stderr.strip().splitlines() or ["no JobState"])[0]
    raise NotInSlurmAllocation(f"Slurm does not confirm job {job_id} (scontrol: {said})")


def check_slurm_allocation(env: Mapping[str, str] | None = None) -> str:
    """Return the Slurm job id if this process runs inside a RUNNING Slurm job; raise otherwise."""
    env = os.environ if env is None else env
    job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
    if not job_id:
        raise NotInSlurmAllocation("no SLURM_JOB_ID: this process is not inside a Slurm allocation")
    # An allocation alone (salloc shell) is not enough: we want a job step (srun) or the batch
    # script itself, which is what sbatch/submitit start.
    in_step = bool(env.get("SLURM_STEP_ID") or env.get("SLURM_STEPID"))
    in_batch = bool(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST"))
    if not (in_step or in_batch):
        raise NotInSlurmAllocation(
            f"SLURM_JOB_ID={job_id} is set but neither SLURM_STEP_ID nor SLURM_JOB_NODELIST is"
        )
    if shutil.which("scontrol", path=env.get("PATH")):
        state = _job_state_from_scontrol(job_id, env)
        if state not in ("RUNNING", "COMPLETING"):
            raise NotInSlurmAllocation(f"Slurm job {job_id} is {state}, not RUNNING")
    return job_id


def require_slurm_allocation(entrypoint: str, env: Mapping[str, str] | None = None) -> str:
    """Exit non-zero with one line on stderr unless inside a RUNNING Slurm job; return its id."""
    try:
        return check_slurm_allocation(env)
    except NotInSlurmAllocation as exc:
        print(
            f"{entrypoint}: refusing to run outside a Slurm allocation: {exc}; {WHY}; {SUBMIT_HINT}",
            file=sys.stderr,
        )
        raise SystemExit(3) from None
