"""`launch resume JOB|DIR [--steps N] [resources]`: a new job that continues JOB's run folder.

The trainers resume from the newest checkpoint that verifies in their `--out`: the new job runs
the old job's command line with `--out <the run folder>` (and `--steps N`: the new total), so
metrics.jsonl, the checkpoints and summary.json stay in one folder while each job keeps its own
logs and outcome in its own job folder. The registry records the run folder and the job it
continues, so `launch report`, `export`, `status` and `list` follow the run across its jobs.

A run folder moved or copied elsewhere (`cp -a`, a backup restored to another disk) is resumed by
its path: the job that last wrote it (its config.yaml's job id, a job submitted from here) gives
the command line and spec, the copy is the `--out`. The trainer compares the data by content (the
manifests' sha256), so synthetic data copied inside the folder resumes at its new path.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from launch import registry, runconfig, submit
from launch.errors import LaunchError
from launch.jobspec import JobSpec, find_spec
from launch.registry import JobRecord

# `launch submit` options that describe a different job, not a continuation of this one
NOT_FOR_RESUME = ("preset", "list_presets", "runs_dir")


def own_spec(rec: JobRecord, run_dir: Path) -> JobSpec:
    """The spec job `rec` was submitted from (its record says; the registry is the user's own),
    never one the run folder's config.yaml names, which anyone who can write the folder may edit.
    A record from before specs were recorded: the spec of its name, or config.yaml's when that
    spec has the job's own name (a spec given by path)."""
    if rec.spec and Path(rec.spec).is_file():
        return find_spec(rec.spec)
    try:
        return find_spec(rec.name)
    except LaunchError:
        source = (runconfig.read(run_dir) or {}).get("spec")
        if not (isinstance(source, str) and Path(source).is_file()):
            raise
        spec = find_spec(source)
        if spec.name != rec.name:
            raise LaunchError(f"job {rec.job_id} ran spec {rec.name!r}, but its run folder's config.yaml names "
                              f"{source} (spec {spec.name!r}); not resumed with another job's spec") from None
        return spec


def add_arguments(p: argparse.ArgumentParser) -> None:
    submit.add_arguments(p)
    for action in p._actions:  # the positional is a job id here, not a job name
        if action.dest == "job":
            action.help = ("the job whose run to continue (see `launch list`), or a run folder (one moved or "
                           "copied elsewhere: its config.yaml names the job)")
            action.metavar = "JOB_OR_DIR"
    p.usage = "launch resume JOB|DIR [--steps N] [resources] [Slurm options] [--follow | --json | --parsable]"
    p.epilog = ("The new job runs JOB's command line on JOB's run folder (--out) and resumes from its newest "
                "checkpoint; resources default to JOB's preset's.")
    p.add_argument("--steps", type=int, metavar="N", help="train to this step in total (default: JOB's --steps)")


def replace_flag(argv: list[str], key: str, value: str) -> list[str]:
    """argv with every `--key V` / `--key=V` dropped and `--key value` appended."""
    flag = "--" + key.replace("_", "-")
    out, skip = [], False
    for i, item in enumerate(argv):
        if skip:
            skip = False
            continue
        if item == flag and i + 1 < len(argv):
            skip = True
            continue
        if item.startswith(flag + "="):
            continue
        out.append(item)
    return [*out, flag, value]


def checkpoint_step(root: Path) -> int | None:
    """The step of the newest complete checkpoint (its MANIFEST.json is written last), which a
    resume starts from; None when there is none. The trainer verifies it byte for byte."""
    steps = [int(p.name[5:]) for p in root.glob("step_*") if p.name[5:].isdigit() and (p / "MANIFEST.json").is_file()]
    return max(steps, default=None)


def job_and_run(job_or_dir: str) -> tuple[JobRecord, Path]:
    """The job whose command line a resume runs, and the run folder it continues. A job id: its run
    folder. A directory: the newest job recorded here for that folder, else (a folder moved or
    copied) the job its config.yaml names, which must be one submitted from here and of the kind
    config.yaml says; the copy is continued in place, the original is not touched."""
    path = Path(job_or_dir).expanduser()
    if not path.is_dir():
        if os.sep in job_or_dir:
            raise LaunchError(f"{job_or_dir}: no such run folder")
        rec = registry.find(job_or_dir)
        return rec, rec.run_folder
    run_dir = path.resolve()
    recorded = [r for r in registry.jobs_of_run(run_dir) if r.kind == "job"]
    if recorded:
        return recorded[-1], run_dir
    config = runconfig.read(run_dir) or {}
    job_id = str(config.get("job_id") or "")
    if not registry.JOB_ID_RE.fullmatch(job_id):
        raise LaunchError(f"{run_dir / runconfig.CONFIG} names no job ({config.get('job_id')!r:.40}): not a run folder a "
                          f"job wrote; start one there with `launch submit JOB --arg out={run_dir}`")
    try:
        rec = registry.find(job_id)
    except LaunchError as exc:
        raise LaunchError(f"{run_dir} is a run of job {job_id} ({run_dir / runconfig.CONFIG}), but {exc}") from None
    if config.get("job") != rec.name:
        raise LaunchError(f"{run_dir / runconfig.CONFIG} names job {job_id} of {config.get('job')!r:.40}, but job "
                          f"{job_id} ran {rec.name!r}: not resumed with another job's command line")
    return rec, run_dir


def run(args: argparse.Namespace) -> int:
    submit._check_option_combinations(args)
    given = [f"--{k.replace('_', '-')}" for k in NOT_FOR_RESUME if getattr(args, k, None)]
    if given:
        raise LaunchError(f"{', '.join(given)}: a resume continues JOB's run with JOB's preset and folder; "
                          "submit a new job for another")
    rec, run_dir = job_and_run(args.job)
    if rec.kind != "job":
        raise LaunchError(f"job {rec.job_id} is a {rec.kind} job; only training jobs are resumed")
    if not (run_dir / "checkpoints").is_dir():
        raise LaunchError(f"job {rec.job_id} has no checkpoints in {run_dir}: nothing to resume from "
                          f"(see `launch status {rec.job_id}`)")
    if args.steps is not None and args.steps < 1:
        raise LaunchError(f"--steps must be >= 1, got {args.steps}")
    at = checkpoint_step(run_dir / "checkpoints")
    if args.steps is not None and at is not None and args.steps <= at:
        raise LaunchError(f"job {rec.job_id}'s run is at step {at} (its newest checkpoint): --steps {args.steps} would "
                          f"train nothing; give the new total, above {at} (e.g. `launch resume {rec.job_id} --steps "
                          f"{2 * at}`); nothing submitted")
    runconfig.read(run_dir)  # a broken config.yaml (a FIFO, an alias bomb) is named here, before any work
    spec = own_spec(rec, run_dir)
    job = spec.resolve(rec.preset)
    submit._apply_overrides(job, argparse.Namespace(**{**vars(args), "arg": []}))
    argv = replace_flag(list(rec.argv), "out", str(run_dir))
    if args.steps is not None:
        argv = replace_flag(argv, "steps", str(args.steps))
    for item in args.arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise LaunchError(f"--arg {item!r}: expected KEY=VALUE (e.g. --arg lr=1e-4)")
        if key.replace("-", "_") == "out":
            raise LaunchError(f"--arg {item}: a resume continues job {rec.job_id}'s run in {run_dir}; submit a new job "
                              "(`launch submit ... --arg out=DIR`) to train in another folder; nothing submitted")
        argv = replace_flag(argv, key, value)
    argv += list(args.extra)
    return submit.submit_job(args, spec, job, argv, run_dir=run_dir, resumes=rec.job_id)
