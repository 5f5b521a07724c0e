"""The submitit executor for a resolved job: the sbatch parameters and the job's setup lines.

`launch submit` and `launch doctor --on-cluster` both build their executor here, so a doctor
job sees the same GRES, CPUs, partition, caches and environment as the job it checks.

Everything that reaches the sbatch script is checked (launch.values) and quoted: the job name
is a plain identifier, environment keys are shell names and values are single-quoted, and the
scratch path expands only $SLURM_JOB_ID, $LAUNCH_NODE_SCRATCH and $USER.
"""

from __future__ import annotations

import shlex
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from launch import values
from launch.errors import LaunchError
from launch.jobspec import ResolvedJob
from toolkit import pyexec

CACHE_VARS = {"TRITON_CACHE_DIR": "triton", "HF_HOME": "hf", "TORCHINDUCTOR_CACHE_DIR": "inductor",
              "TILELANG_CACHE_DIR": "tilelang", "CUTE_DSL_CACHE_DIR": "cute_dsl"}
# Checkpointable jobs get SIGUSR2 this long before the limit, to save and requeue.
SIGNAL_DELAY_S = 120


@dataclass
class SlurmOptions:
    """The sbatch options a user passes through `launch submit` (each checked in launch.values)."""

    name: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    exclude: str | None = None
    dependency: str | None = None
    env: dict[str, str] = field(default_factory=dict)

    def sbatch_params(self) -> dict[str, str]:
        return {k: v for k, v in (("account", self.account), ("qos", self.qos), ("constraint", self.constraint),
                                  ("exclude", self.exclude), ("dependency", self.dependency)) if v}


INHERITED_RENDEZVOUS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "NODE_RANK")


def job_environment(job: ResolvedJob, folder: Path, scratch: str, extra_env: dict[str, str] | None = None) -> list[str]:
    """Shell lines for the sbatch script: where the job writes, its node-local caches, its env."""
    try:
        scratch_word = values.scratch_shell(scratch)
    except ValueError as exc:
        raise LaunchError(f"--scratch: {exc}") from None
    lines = [
        # srun by absolute path: a shell function wins over PATH, which the env below may set
        # (with --allow-loader-env) and which must not choose the program that starts the tasks.
        # LAUNCH_SRUN_CONF (the embedded cluster's, see EmbeddedCluster.env) is srun's own config.
        *([f'srun() {{ if [ -n "${{LAUNCH_SRUN_CONF:-}}" ]; then SLURM_CONF="$LAUNCH_SRUN_CONF" {shlex.quote(srun)} "$@"; '
           f'else {shlex.quote(srun)} "$@"; fi; }}'] if (srun := shutil.which("srun")) else []),
        # A rendezvous left in the submitting shell (a torchrun or an in-process torch.distributed
        # there) is not this job's: each job derives its own from its allocation. The spec's
        # env and --env may still set them, below.
        f"unset {' '.join(INHERITED_RENDEZVOUS)}",
        f"export LAUNCH_JOB_NAME={shlex.quote(job.spec.name)}",
        f'export LAUNCH_JOB_DIR={shlex.quote(str(folder))}/"${{SLURM_JOB_ID}}"',
        f"export LAUNCH_SCRATCH={scratch_word}",
        # The rendezvous' key prefix, a secret made here in the job (never in the script, a
        # command line or the log): another user who connects to the store cannot touch its keys.
        "export LAUNCH_RENDEZVOUS_TOKEN=\"$(od -An -N16 -tx1 /dev/urandom | tr -d ' \\n')\"",
    ]
    lines += [f'export {var}="$LAUNCH_SCRATCH"/{sub}' for var, sub in CACHE_VARS.items()]
    # Baked kernel caches (launch/kernels.py): the store every node reads, as the submitter sees it.
    from launch.kernel_archive import STORE_VAR, store_dir

    lines.append(f'[ -n "${{{STORE_VAR}:-}}" ] || export {STORE_VAR}={shlex.quote(str(store_dir()))}')
    for key in job.env:  # the spec loader checked these; this is the last line of defence
        try:
            values.check_env_key(key)
            values.check_env_not_hijack(key, "a job spec may not set it")
        except ValueError as exc:
            raise LaunchError(f"{job.spec.source}: key 'env.{key}': {exc}") from None
    for key, value in {**job.env, **(extra_env or {})}.items():
        values.check_env_key(key)  # --env was checked (and loader variables allowed) in launch submit
        lines.append(f"export {key}={shlex.quote(value)}")
    lines.append('mkdir -p "$LAUNCH_JOB_DIR" "$LAUNCH_SCRATCH"')
    return lines


def make_executor(job: ResolvedJob, folder: Path, scratch: str, options: SlurmOptions | None = None):  # -> SlurmExecutor
    import submitit

    options = options or SlurmOptions()
    r = job.resources
    name = values.check_name(options.name or job.spec.name, "job name")
    # The job's interpreter never puts the directory `launch submit` ran in on sys.path: submitit
    # starts it as `python -u -m submitit.core._submit`, and `-m` would import another user's
    # `submitit/` from a shared working directory (toolkit.pyexec).
    python = " ".join(shlex.quote(a) for a in pyexec.python())
    executor = submitit.SlurmExecutor(folder=folder / "%j", max_num_timeout=3, python=python)
    params: dict = dict(
        job_name=name, time=r.time_minutes, nodes=r.nodes, ntasks_per_node=r.tasks_per_node,
        cpus_per_task=r.cpus_per_task, setup=job_environment(job, folder, scratch, options.env),
        signal_delay_s=SIGNAL_DELAY_S, stderr_to_stdout=False, **options.sbatch_params(),
    )
    if r.gpus_per_node:
        params["gres"] = f"gpu:{r.gpus_per_node}"
    if r.partition:
        params["partition"] = values.check_slurm_value(r.partition, "partition")
    if r.mem_gb:
        params["mem"] = f"{max(1, round(r.mem_gb * 1024))}M"
    executor.update_parameters(**params)
    return executor


def sbatch_script(executor) -> str:  # noqa: ANN001 - submitit.SlurmExecutor
    return executor._make_submission_file_text(executor._submitit_command_str, "dry-run")


def sbatch_failure(exc: Exception) -> str:
    """The one line that matters from submitit's wrapped sbatch failure."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower() and "resolve_ctls_from_dns_srv" not in ln]
    return (errors[-1] if errors else lines[-1] if lines else type(exc).__name__).removeprefix("sbatch: error: ")
