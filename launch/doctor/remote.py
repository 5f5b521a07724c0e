"""`launch doctor --on-cluster`: the doctor as a short Slurm job with the job's resources.

It goes through the same submitit executor as `launch submit` (same GRES, CPUs, partition and
the same job environment: node-local cache variables and the spec's env), with one task and a
short time limit, to whichever Slurm the environment names (SLURM_CONF, or the embedded one).
Like any job it is checked for feasibility before submit and recorded in the registry (so
`launch list`, `logs` and `cancel` know it); a SIGINT or SIGTERM of the CLI cancels it.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

from launch import feasibility, registry
from launch.doctor.checks import run_checks
from launch.doctor.job import JobRequirements
from launch.doctor.results import CheckResult, Status
from launch.errors import LaunchError
from launch.executor import make_executor, sbatch_failure
from launch.fsutil import launch_home, private_files
from launch.jobspec import JobSpec, ResolvedJob
from launch.slurmenv import TERMINAL_STATES, job_state, pending_words, require_cluster, run_slurm

DOCTOR_TIME_LIMIT_MIN = 15
HEARTBEAT_S = 30.0


def doctor_in_allocation(job: str | None, preset: str | None, lock_path: str | None) -> list[dict[str, str]]:
    """Runs inside the Slurm job: the full doctor, expecting to be in an allocation."""
    results = run_checks(job, preset=preset, lock_path=Path(lock_path) if lock_path else None,
                         expect_allocation=True)
    rows = [r.to_dict() for r in results]
    if int(os.environ.get("SLURM_JOB_NUM_NODES", "1")) > 1:  # one task per node: say whose rows
        node = os.environ.get("SLURMD_NODENAME", "?")
        rows = [{**row, "check": f"{node}: {row['check']}"} for row in rows]
    return rows


class CancelOnSignals:
    """While the CLI submits and waits: SIGINT or SIGTERM cancels the job, then ends the CLI with
    128 + the signal. A signal while sbatch runs is held until the job id is known."""

    def __init__(self, env_extra: dict[str, str]) -> None:
        self.env_extra = env_extra
        self.job_id: str | None = None
        self.pending: int | None = None

    def submitted(self, job_id: str) -> None:
        self.job_id = job_id
        if self.pending is not None:
            self.handle(self.pending, None)

    def handle(self, signum: int, _frame: object) -> None:
        if self.job_id is None:
            self.pending = signum
            return
        run_slurm(["scancel", self.job_id], self.env_extra, timeout=15)
        print(f"doctor job {self.job_id} cancelled ({signal.Signals(signum).name})", file=sys.stderr, flush=True)
        raise SystemExit(128 + signum)

    def __enter__(self) -> CancelOnSignals:
        self.previous = {s: signal.signal(s, self.handle) for s in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self.previous.items():
            signal.signal(s, h)


def _resolved(job: JobRequirements | None) -> ResolvedJob:
    if job is not None and job.resolved is not None:
        return job.resolved
    spec = JobSpec(name="doctor", entrypoint="launch.doctor", source=Path("<none>"))
    return ResolvedJob(spec=spec, preset=None, resources=spec.resources, args={}, env={})


def run_on_cluster(job: JobRequirements | None, lock_path: Path | None, wait_s: float | None = None,
                   nodes: int = 1) -> list[CheckResult]:
    """The doctor in an allocation like the job's; with `nodes` > 1, one task on each node."""
    env_extra = require_cluster()
    resolved = _resolved(job)
    resolved.resources.nodes = nodes
    # Only the options `launch doctor` itself takes: a preset's resources, or fewer nodes.
    advice = "check a smaller --preset" + (" or fewer --nodes" if nodes > 1 else "") + " (the doctor runs with the preset's resources)"
    problem = feasibility.check(resolved.resources, feasibility.query_cluster(env_extra),
                                f"the doctor for {resolved.spec.name}" + (f" (preset {resolved.preset})" if resolved.preset else ""),
                                advice)
    if problem:
        raise LaunchError(problem)
    folder = launch_home() / "doctor" / time.strftime("%Y%m%d-%H%M%S")
    executor = make_executor(resolved, folder, resolved.spec.scratch)
    executor.update_parameters(job_name="launch-doctor", time=DOCTOR_TIME_LIMIT_MIN, nodes=nodes, ntasks_per_node=1)
    os.environ.update(env_extra)  # submitit calls sbatch with this process's environment
    with CancelOnSignals(env_extra) as guard, private_files():
        try:
            sjob = executor.submit(doctor_in_allocation, job.source and str(job.source) if job else None,
                                   job.preset if job else None, str(lock_path.resolve()) if lock_path else None)
        except Exception as exc:  # submitit wraps sbatch failures in several exception types
            raise LaunchError(f"sbatch refused the doctor job: {sbatch_failure(exc)}") from None
        job_id = str(sjob.job_id)
        rec = registry.JobRecord(job_id=job_id, name="doctor", preset=resolved.spec.name if job else None,
                                 folder=str(folder / job_id), submitted_at=registry.now(),
                                 slurm_conf=env_extra.get("SLURM_CONF"), argv=[], kind="doctor")
        registry.record(rec)
        guard.submitted(job_id)
        print(f"doctor submitted as Slurm job {job_id}; logs in {rec.folder}", file=sys.stderr, flush=True)
        rows = _wait(sjob, rec, env_extra, wait_s)
    return [CheckResult(r["check"], Status(r["status"]), r["found"], r["fix"]) for r in rows]


def _wait(sjob, rec: registry.JobRecord, env_extra: dict[str, str], wait_s: float | None) -> list[dict]:  # noqa: ANN001
    import submitit

    job_id = rec.job_id
    deadline = time.monotonic() + (wait_s if wait_s is not None else (DOCTOR_TIME_LIMIT_MIN + 10) * 60)
    last_said, said_at = "", 0.0
    while True:
        st = job_state(job_id, env_extra)
        if st["state"] in TERMINAL_STATES or (st["state"] == "UNKNOWN" and sjob.done()):
            break
        now = time.monotonic()
        say = st["state"] + (f": {pending_words(st['reason'], job_id)}" if st["state"] == "PENDING" else "")
        if say != last_said or now - said_at >= HEARTBEAT_S:
            print(f"[launch] doctor job {job_id}: {say}", file=sys.stderr, flush=True)
            last_said, said_at = say, now
        if now > deadline:
            sjob.cancel(check=False)
            raise LaunchError(f"doctor job {job_id} did not finish in time and was cancelled; "
                              f"last state {say}; logs: {rec.folder}")
        time.sleep(1.0)
    try:
        return [row for task_rows in sjob.results() for row in task_rows]
    except (submitit.core.utils.FailedJobError, submitit.core.utils.UncompletedJobError) as exc:
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        raise LaunchError(f"doctor job {job_id} failed: {lines[-1] if lines else exc}; logs: {rec.folder}") from None
