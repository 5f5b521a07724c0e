"""`launch export JOB [--step N] [--out DIR]`: a job's checkpoint as a transformers checkpoint.

JOB is a job id submitted from here (`launch list`) or a job directory. The job's entrypoint comes
from its job spec; its package's `export` module does the work
(`<entrypoint>.export.export_checkpoint(job_dir, step, out) -> Path`, e.g. train/stage1/export.py),
so the launcher names the trainer only by its entrypoint.
"""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path

from launch import registry
from launch.errors import LaunchError
from launch.jobspec import find_spec, known_jobs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB", help="job id (see `launch list`) or a job directory")
    parser.add_argument("--step", type=int, default=None, help="checkpoint step to export (default: the latest)")
    parser.add_argument("--out", default=None, help="output directory (default: <job dir>/export/step_N)")
    parser.add_argument("--job", dest="spec", default=None,
                        help="job spec name (stage1, dflash, ...) for a directory not under $LAUNCH_HOME/runs/<job>/")


def resolve(job: str, spec: str | None = None) -> tuple[Path, str]:
    """(job directory, job spec name) of a job id or a job directory."""
    path = Path(job).expanduser()
    if path.is_dir():
        path = path.resolve()
        if spec:
            return path, spec
        for rec in reversed(registry.all_jobs()):
            if Path(rec.folder).resolve() == path:
                return path, rec.name
        if path.parent.name in known_jobs():  # $LAUNCH_HOME/runs/<job name>/<job id>
            return path, path.parent.name
        raise LaunchError(f"{path}: not a directory of a job submitted from here; say which job it is with "
                          f"--job ({', '.join(known_jobs())})")
    if os.sep in job:
        raise LaunchError(f"{job}: no such job directory")
    rec = registry.find(job)
    return rec.run_folder, spec or rec.name  # a resumed job's checkpoints are in the run it continued


def run(args: argparse.Namespace) -> int:
    if args.step is not None and args.step < 1:
        raise LaunchError(f"--step must be >= 1, got {args.step}")
    job_dir, name = resolve(args.job, args.spec)
    if not job_dir.is_dir():
        raise LaunchError(f"job {args.job}: its directory {job_dir} does not exist (the job never started?)")
    entrypoint = find_spec(name).entrypoint
    module_name = f"{entrypoint}.export"
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        raise LaunchError(f"job {name} (entrypoint {entrypoint}) has no export ({module_name} does not exist)") from None
    try:
        out = module.export_checkpoint(job_dir, args.step, Path(args.out) if args.out else None)
    except (RuntimeError, ValueError, OSError) as exc:
        raise LaunchError(" ".join(str(exc).split())) from None
    print(out)
    return 0
