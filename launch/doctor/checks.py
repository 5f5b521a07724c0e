"""The doctor's checks, run in order: `run_checks` (every check) and `fast_subset` (the in-job
preflight). The CLI verb lives in launch/doctor/__init__.py; both re-export these."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TextIO

from launch.doctor import nvidia
from launch.doctor.caches import check_caches
from launch.doctor.compiler import check_compiler
from launch.doctor.context import DoctorContext
from launch.doctor.device_policy import check_device_policy
from launch.doctor.fabric import check_fabric
from launch.doctor.gpus import check_gpus
from launch.doctor.job import JobRequirements, load_job
from launch.doctor.kernels import check_kernels
from launch.doctor.results import CheckResult, Status, failure_message, has_failure, render_table
from launch.doctor.slurm_context import check_slurm
from launch.doctor.slurm_node import check_slurm_node
from launch.doctor.versions import check_versions
from launch.errors import LaunchError, debug


def _check_groups() -> list[tuple[str, Callable]]:
    return [("kernels", check_kernels), ("triton", check_compiler), ("cache", check_caches),
            ("cache.kernel_archive", _check_kernel_archive),
            ("gpus", check_gpus), ("fabric", check_fabric), ("versions", check_versions), ("slurm", check_slurm),
            ("slurm.devices", check_device_policy), ("slurm.node", check_slurm_node)]


def _check_kernel_archive(ctx: DoctorContext) -> list[CheckResult]:
    if ctx.preflight:  # in the job, its start has just looked for the archive and said so in its own line
        return []
    from launch.kernel_archive import doctor_check

    return [doctor_check(ctx.env, ctx.gpus)]


def run_checks(
    job: str | JobRequirements | None = None,
    env: Mapping[str, str] | None = None,
    *,
    preset: str | None = None,
    trust_allocation: bool = False,
    lock_path: Path | None = None,
    expect_allocation: bool = False,
    run_gdn: bool = True,
    needs_gpus: bool | None = None,
    preflight: bool = False,
) -> list[CheckResult]:
    """Run every check against `env` (default: this process's environment).

    A check that crashes becomes a FAIL row naming the crash: one broken check never hides
    the others.
    """
    env = dict(os.environ if env is None else env)
    if isinstance(job, str):
        job = load_job(job, preset, trust_allocation=trust_allocation)
    ctx = DoctorContext(
        env=env, job=job, lock_path=lock_path,
        expect_allocation=expect_allocation, run_gdn=run_gdn, needs_gpus_override=needs_gpus, preflight=preflight,
    )
    results: list[CheckResult] = []
    for group, check in _check_groups():
        try:
            results.extend(check(ctx))
        except LaunchError:
            raise
        except Exception as exc:  # a doctor bug must not read as a healthy node
            results.append(CheckResult(group, Status.FAIL, f"check crashed: {type(exc).__name__}: {exc}",
                                       "report this as a launch doctor bug (LAUNCH_DEBUG=1 shows the traceback)"))
            if debug():
                raise
    return results


def fast_subset(
    job: str | None,
    *,
    env: Mapping[str, str] | None = None,
    needs_gpus: bool | None = None,
    expect_allocation: bool = True,
    stream: TextIO | None = sys.stderr,
) -> list[CheckResult]:
    """The preflight `launch submit` runs inside the job before training.

    Every check except the GDN fwd+bwd numeric run (which may compile kernels for a minute on
    a cold cache). Prints the table to `stream` (None: silent). Returns the results when
    nothing FAILs; otherwise raises LaunchError (exit_code 1) whose one-line message names
    each failing check, what was found and the fix.

    job: a job name or spec path; its `lock:` is checked. Its GPU count is not: inside the job
    the submitted preset is unknown here, so the allocation Slurm made is taken as the truth.
    needs_gpus: None means "CUDA GPUs are visible here" (nvidia-smi), so a CPU run, even on
    stand-in GPUs, does not need fla; True makes missing GPU kernels FAIL regardless.
    """
    if needs_gpus is None:
        try:
            needs_gpus = bool(nvidia.list_gpus(dict(os.environ if env is None else env)))
        except nvidia.NvidiaSmiError:
            needs_gpus = False
    requirements, spec_problem = None, None
    if job:
        try:
            requirements = load_job(job, trust_allocation=True)
        except LaunchError as exc:  # a spec not visible from the node must not stop the job
            spec_problem = CheckResult("versions.lock", Status.WARN, f"lock not checked: {exc}",
                                       "make the job spec visible on the node (LAUNCH_JOBS_PATH)")
    results = run_checks(requirements, env, expect_allocation=expect_allocation, run_gdn=False,
                         needs_gpus=needs_gpus, preflight=True)
    if spec_problem is not None:
        results = [spec_problem if r.check == "versions.lock" else r for r in results]
    # Every task runs the checks (GPUs and caches are per node); one table per job is enough
    # in the log unless this task found a failure.
    first_task = (env if env is not None else os.environ).get("SLURM_PROCID", "0") == "0"
    if stream is not None and (first_task or has_failure(results)):
        print(render_table(results), file=stream, flush=True)
    if has_failure(results):
        raise LaunchError(failure_message(results), exit_code=1)
    return results


