"""`launch doctor`: preflight checks for the failures that silently waste GPU hours.

kernels (fla, varlen causal conv, a GDN fwd+bwd vs reference, known-bad versions), Triton's
C compiler, caches on node-local storage, GPUs (count, foreign processes, keepalive), versions
against the job's lock, and the Slurm context. See launch/doctor/README.md.

Public API:
    run_checks(job=None, env=None, ...) -> list[CheckResult]   every check
    fast_subset(job, ...) -> list[CheckResult]                  in-job preflight; raises LaunchError on FAIL
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TextIO

from launch.doctor.job import JobRequirements
from launch.doctor.results import CheckResult, Status, failure_message, has_failure, render_table, to_json
from launch.errors import LaunchError

__all__ = ["CheckResult", "Status", "add_arguments", "fast_subset", "run", "run_checks"]


def _check_groups() -> list[tuple[str, Callable]]:
    from launch.doctor.caches import check_caches
    from launch.doctor.compiler import check_compiler
    from launch.doctor.gpus import check_gpus
    from launch.doctor.kernels import check_kernels
    from launch.doctor.slurm_context import check_slurm
    from launch.doctor.versions import check_versions

    return [("kernels", check_kernels), ("triton", check_compiler), ("cache", check_caches),
            ("gpus", check_gpus), ("versions", check_versions), ("slurm", check_slurm)]


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
) -> list[CheckResult]:
    """Run every check against `env` (default: this process's environment).

    A check that crashes becomes a FAIL row naming the crash: one broken check never hides
    the others.
    """
    from launch.doctor.context import DoctorContext
    from launch.doctor.job import load_job

    env = dict(os.environ if env is None else env)
    if isinstance(job, str):
        job = load_job(job, preset, trust_allocation=trust_allocation)
    ctx = DoctorContext(
        env=env, job=job, lock_path=lock_path,
        expect_allocation=expect_allocation, run_gdn=run_gdn, needs_gpus_override=needs_gpus,
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
            if os.environ.get("LAUNCH_DEBUG"):
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
        from launch.doctor import nvidia

        try:
            needs_gpus = bool(nvidia.list_gpus(dict(os.environ if env is None else env)))
        except nvidia.NvidiaSmiError:
            needs_gpus = False
    from launch.doctor.job import load_job

    requirements, spec_problem = None, None
    if job:
        try:
            requirements = load_job(job, trust_allocation=True)
        except LaunchError as exc:  # a spec not visible from the node must not stop the job
            spec_problem = CheckResult("versions.lock", Status.WARN, f"lock not checked: {exc}",
                                       "make the job spec visible on the node (LAUNCH_JOBS_PATH)")
    results = run_checks(requirements, env, expect_allocation=expect_allocation, run_gdn=False,
                         needs_gpus=needs_gpus)
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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--job", help="check against this job's resources and lock (a name, or a spec .yaml path)")
    parser.add_argument("--preset", help="the job's preset whose resources apply (default: the spec's default)")
    parser.add_argument("--on-cluster", action="store_true",
                        help="run the doctor as a short Slurm job with the job's resources, on the allocated node")
    parser.add_argument("--nodes", type=int, default=1,
                        help="with --on-cluster: run on this many nodes at once, one task each")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    parser.add_argument("--lock", type=Path, help="version lock file to check against (default: the job's)")
    parser.add_argument("--no-gdn", action="store_true", help="skip the GDN fwd+bwd run on the GPU")
    parser.add_argument("--expect-allocation", action="store_true",
                        help="FAIL when not inside a Slurm allocation (what --on-cluster uses)")


def run(args: argparse.Namespace) -> int:
    if args.lock is not None and not args.lock.is_file():
        raise LaunchError(f"--lock {args.lock}: no such file")
    if args.nodes != 1 and not args.on_cluster:
        raise LaunchError("--nodes needs --on-cluster")
    if args.on_cluster:
        from launch.doctor.job import load_job
        from launch.doctor.remote import run_on_cluster

        job = load_job(args.job, args.preset) if args.job else None
        if args.nodes < 1:
            raise LaunchError(f"--nodes {args.nodes}: must be >= 1")
        results = run_on_cluster(job, args.lock, nodes=args.nodes)
    else:
        if args.preset and not args.job:
            raise LaunchError("--preset needs --job")
        results = run_checks(args.job, preset=args.preset, lock_path=args.lock, expect_allocation=args.expect_allocation,
                             run_gdn=not args.no_gdn)
    if args.json:
        print(to_json(results, {"ok": not has_failure(results)}))
    else:
        print(render_table(results))
    return 1 if has_failure(results) else 0
