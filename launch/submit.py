"""`launch submit JOB`: a bundled job through submitit into whichever Slurm the environment names."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

from launch import registry
from launch.errors import LaunchError
from launch.fsutil import launch_home
from launch.jobspec import ResolvedJob, find_spec, parse_time_minutes
from launch.runner import CACHE_VARS, EntrypointRun
from launch.slurmenv import require_slurm_clients, slurm_env


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job", help="job name (stage1, dflash, extract) or path to a job spec .yaml")
    p.add_argument("--preset", help="preset from the job spec (e.g. tiny, qwen35-2b)")
    p.add_argument("--nodes", type=int)
    p.add_argument("--gpus-per-node", type=int)
    p.add_argument("--cpus-per-task", type=int)
    p.add_argument("--time", help="wall-clock limit: D-HH:MM:SS, HH:MM:SS, HH:MM or minutes")
    p.add_argument("--partition")
    p.add_argument("--scratch", help="node-local scratch for caches (default: per job under "
                   "$LAUNCH_NODE_SCRATCH, else /tmp)")
    p.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                   help="override an entrypoint argument (repeatable)")
    p.add_argument("--runs-dir", help="where job folders go (default $LAUNCH_HOME/runs)")
    p.add_argument("--no-preflight", action="store_true", help="skip the doctor's fast checks in the job")
    p.add_argument("--dry-run", action="store_true", help="print the sbatch script and job environment; submit nothing")
    p.add_argument("--follow", "-f", action="store_true", help="stream the log until the job ends")
    # Arguments after a bare `--` reach the entrypoint verbatim (split off in launch.cli).
    p.set_defaults(extra=[])


def _apply_overrides(job: ResolvedJob, args: argparse.Namespace) -> None:
    r = job.resources
    for attr in ("nodes", "gpus_per_node", "cpus_per_task", "partition"):
        value = getattr(args, attr)
        if value is not None:
            setattr(r, attr, value)
    if args.time is not None:
        try:
            parse_time_minutes(args.time)
        except ValueError as exc:
            raise LaunchError(f"--time: {exc}") from exc
        r.time = args.time
    if r.nodes < 1 or r.cpus_per_task < 1 or r.gpus_per_node < 0:
        raise LaunchError("--nodes and --cpus-per-task must be >= 1, --gpus-per-node >= 0")
    for item in args.arg:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise LaunchError(f"--arg '{item}': expected KEY=VALUE")
        job.args[key.replace("-", "_")] = value


def job_environment(job: ResolvedJob, folder: Path, scratch: str) -> list[str]:
    """Shell lines for the sbatch script: where the job writes, its node-local caches, its env."""
    lines = [
        f"export LAUNCH_JOB_NAME={shlex.quote(job.spec.name)}",
        f"export LAUNCH_JOB_DIR={shlex.quote(str(folder))}/${{SLURM_JOB_ID}}",
        # Not quoted: the default expands SLURM_JOB_ID and LAUNCH_NODE_SCRATCH on the node.
        f"export LAUNCH_SCRATCH={scratch}",
    ]
    lines += [f"export {var}=$LAUNCH_SCRATCH/{sub}" for var, sub in CACHE_VARS.items()]
    lines += [f"export {k}={shlex.quote(v)}" for k, v in job.env.items()]
    lines.append('mkdir -p "$LAUNCH_JOB_DIR" "$LAUNCH_SCRATCH"')
    return lines


def make_executor(job: ResolvedJob, folder: Path, scratch: str):  # -> submitit.SlurmExecutor
    import submitit

    r = job.resources
    executor = submitit.SlurmExecutor(folder=folder / "%j", max_num_timeout=3)
    params: dict = dict(
        job_name=job.spec.name, time=r.time_minutes, nodes=r.nodes, ntasks_per_node=r.tasks_per_node,
        cpus_per_task=r.cpus_per_task, setup=job_environment(job, folder, scratch),
        # Checkpointable jobs get SIGUSR2 this long before the limit, to save and requeue.
        signal_delay_s=120, stderr_to_stdout=False,
    )
    if r.gpus_per_node:
        params["gres"] = f"gpu:{r.gpus_per_node}"
    if r.partition:
        params["partition"] = r.partition
    if r.mem_gb:
        params["mem"] = f"{int(r.mem_gb)}G"
    executor.update_parameters(**params)
    return executor


def sbatch_script(executor) -> str:
    return executor._make_submission_file_text(executor._submitit_command_str, "dry-run")


def run(args: argparse.Namespace) -> int:
    spec = find_spec(args.job)
    job = spec.resolve(args.preset)
    _apply_overrides(job, args)
    argv = job.argv(args.extra)
    folder = Path(args.runs_dir or launch_home() / "runs").resolve() / spec.name
    scratch = args.scratch or spec.scratch
    env_extra = slurm_env()
    if not args.dry_run:
        require_slurm_clients()
    os.environ.update(env_extra)  # submitit calls sbatch with our environment
    executor = make_executor(job, folder, scratch)
    runner = EntrypointRun(spec.entrypoint, argv, spec.name, preflight=not args.no_preflight)
    if args.dry_run:
        print("# --- sbatch script (dry run: nothing submitted) ---")
        print(sbatch_script(executor).replace("%j", "<jobid>"))
        print("# --- job ---")
        print(f"# entrypoint: python -m {spec.entrypoint} {shlex.join(argv)}")
        print(f"# preset:     {job.preset}")
        print(f"# slurm:      {env_extra.get('SLURM_CONF', 'system default configuration')}")
        return 0
    folder.mkdir(parents=True, exist_ok=True)
    try:
        submitted = executor.submit(runner)
    except Exception as exc:  # submitit wraps sbatch failures in several exception types
        msg = str(exc).strip().splitlines()
        detail = next((ln for ln in msg if "error" in ln.lower()), msg[-1] if msg else type(exc).__name__)
        raise LaunchError(f"sbatch refused the job: {detail.strip()}") from exc
    job_id = str(submitted.job_id)
    rec = registry.JobRecord(job_id=job_id, name=spec.name, preset=job.preset, folder=str(folder / job_id),
                             submitted_at=registry.now(), slurm_conf=env_extra.get("SLURM_CONF"), argv=argv)
    registry.record(rec)
    print(f"submitted {spec.name} (preset {job.preset}) as job {job_id}")
    print(f"  logs: {rec.stdout}")
    if args.follow:
        from launch.jobs_cli import follow

        return follow(rec, sys.stdout)
    return 0
