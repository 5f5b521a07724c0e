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
from pathlib import Path

from launch.doctor.checks import fast_subset, run_checks
from launch.doctor.job import load_job
from launch.doctor.remote import run_on_cluster
from launch.doctor.results import CheckResult, Status, has_failure, render_table, to_json
from launch.doctor.versions import parse_lock_file
from launch.errors import LaunchError

__all__ = ["CheckResult", "Status", "add_arguments", "fast_subset", "run", "run_checks"]


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
    if args.lock is not None:
        if not args.lock.is_file():
            raise LaunchError(f"--lock {args.lock}: {'not a file' if args.lock.exists() else 'no such file'}")
        parse_lock_file(args.lock)  # a bad lock is one line here, not a crashed check in the table
    if args.nodes != 1 and not args.on_cluster:
        raise LaunchError("--nodes needs --on-cluster")
    if args.on_cluster:
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
