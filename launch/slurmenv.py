"""Which Slurm the launcher talks to, and small wrappers around its client commands.

Order: an explicit SLURM_CONF in the environment; else the embedded cluster under
$LAUNCH_HOME when it is up; else the system's default configuration (a real cluster's
login node).
"""

from __future__ import annotations

import os
import shutil
import subprocess

from launch.cluster.embedded import EmbeddedCluster
from launch.errors import LaunchError


def slurm_env() -> dict[str, str]:
    """Variables to add to the environment so Slurm's clients reach the right controller."""
    if os.environ.get("SLURM_CONF"):
        return {"SLURM_CONF": os.environ["SLURM_CONF"]}
    embedded = EmbeddedCluster()
    if embedded.is_up():
        return embedded.env()
    return {}


def require_slurm_clients() -> None:
    for tool in ("sbatch", "srun", "squeue", "sacct", "scancel"):
        if shutil.which(tool) is None:
            raise LaunchError(f"'{tool}' not found: no Slurm client on this machine; install slurm-client, "
                              "or start the embedded cluster with `make deps && launch cluster up`")


def run_slurm(argv: list[str], env_extra: dict[str, str] | None = None,
              timeout: float = 30) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(env_extra if env_extra is not None else slurm_env())}
    try:
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as exc:
        raise LaunchError(f"'{argv[0]}' not found: is Slurm installed here?") from exc
    except subprocess.TimeoutExpired as exc:
        raise LaunchError(f"'{' '.join(argv)}' did not answer in {timeout:.0f} s: is slurmctld up?") from exc


TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
                   "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def job_state(job_id: str, env_extra: dict[str, str] | None = None) -> dict[str, str]:
    """State of one job: squeue while it is known to the controller, sacct afterwards."""
    q = run_slurm(["squeue", "-h", "-j", job_id, "-o", "%T|%M|%N|%r"], env_extra)
    if q.returncode == 0 and q.stdout.strip():
        state, elapsed, nodes, reason = (q.stdout.strip().splitlines()[0].split("|") + [""] * 4)[:4]
        return {"state": state, "elapsed": elapsed, "nodes": nodes, "reason": reason, "exit_code": ""}
    a = run_slurm(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State,Elapsed,NodeList,ExitCode"], env_extra)
    if a.returncode == 0 and a.stdout.strip():
        state, elapsed, nodes, exit_code = (a.stdout.strip().splitlines()[0].split("|") + [""] * 4)[:4]
        # "CANCELLED by 0" -> "CANCELLED"
        return {"state": state.split()[0], "elapsed": elapsed, "nodes": nodes, "reason": "",
                "exit_code": exit_code}
    return {"state": "UNKNOWN", "elapsed": "", "nodes": "", "reason": (a.stderr or q.stderr).strip(),
            "exit_code": ""}
