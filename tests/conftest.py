"""Shared fixtures: a real embedded Slurm cluster (munge, MariaDB, slurmdbd, slurmctld, slurmd).

The cluster's GPUs are stand-ins: character devices with the NVIDIA major under the state
dir, because this machine has no NVIDIA driver. Slurm allocates them exactly as real ones.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.cluster.embedded import EmbeddedCluster

REPO = Path(__file__).resolve().parents[1]
JOB_FIXTURES = Path(__file__).with_name("jobfixtures")
# A requeued job's wait on the session cluster (Slurm's cred_expire, 120 s by default). It is also
# a step credential's lifetime, so it keeps room for a loaded 2-core machine.
REQUEUE_DELAY_S = 20
# Tiers (slurm/lxc markers set from the fixtures a test uses) and the per-file progress lines.
pytest_plugins = ["tests.tiers"]


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch on one intra-op thread for a module: small matmuls on a shared 2-core machine only
    contend with more threads (about 10x slower)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def slurm_available() -> str | None:
    if os.geteuid() != 0:
        return "the embedded cluster needs root (slurmd)"
    for tool in ("slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd", "sbatch"):
        if not shutil.which(tool) and not Path("/usr/sbin", tool).exists():
            return f"{tool} not installed (make deps)"
    return None


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedCluster]:
    """One cluster for the session: 4 stand-in GPUs, 4 CPUs, a Prolog that records what it sees;
    a requeued job starts again after REQUEUE_DELAY_S, not Slurm's 120 s."""
    reason = slurm_available()
    if reason:
        pytest.skip(reason)
    state = tmp_path_factory.mktemp("cluster")
    hook_log = state / "prolog.log"
    prolog = state / "prolog.sh"
    prolog.write_text(f"#!/bin/sh\necho \"$SLURM_JOB_ID gpus=$SLURM_JOB_GPUS\" >> {hook_log}\nexit 0\n")
    prolog.chmod(0o755)
    cluster = EmbeddedCluster(state)
    cluster.up(gpus=4, cpus=4, prolog=str(prolog), requeue_delay=REQUEUE_DELAY_S)
    yield cluster
    cluster.down()


@pytest.fixture()
def launch_env(slurm_cluster: EmbeddedCluster, tmp_path: Path) -> dict[str, str]:
    """Environment for running `launch` against the session cluster, with a private LAUNCH_HOME."""
    env = {**os.environ, **slurm_cluster.env(), "LAUNCH_HOME": str(tmp_path / "home"),
           "LAUNCH_JOBS_PATH": str(JOB_FIXTURES),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(JOB_FIXTURES)])}
    return env


def run_launch(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "launch", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=REPO)


def wait_for_state(job_id: str, env: dict[str, str], states: set[str], timeout: float = 90) -> str:
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline:
        out = run_launch(["status", job_id], env)
        lines = out.stdout.splitlines()
        if len(lines) > 1:
            seen = lines[1].split()[3]
            if seen in states:
                return seen
        time.sleep(0.5)
    raise AssertionError(f"job {job_id} never reached {states}; last state {seen!r}")
