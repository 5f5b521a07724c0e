"""Shared fixtures: a real embedded Slurm cluster (munge, MariaDB, slurmdbd, slurmctld, slurmd).

The cluster's GPUs are stand-ins: character devices with the NVIDIA major under the state
dir, because this machine has no NVIDIA driver. Slurm allocates them exactly as real ones.
"""

from __future__ import annotations

import os
import pwd
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.cluster.embedded import EmbeddedCluster

REPO = Path(__file__).resolve().parents[1]
JOB_FIXTURES = Path(__file__).with_name("jobfixtures")
# The working directory of every `launch` the tests run: sbatch makes it the job's working
# directory, where Slurm writes `slurm-<id>.out` for any job without --output. Never the repo.
# One per pytest process (conftest is imported as `conftest` and as `tests.conftest`: one path).
RUN_CWD = Path(tempfile.gettempdir()) / f"launch-tests-cwd-{os.getpid()}"
RUN_CWD.mkdir(mode=0o700, exist_ok=True)
_ROOT_SLURM_OUT_AT_START = frozenset(REPO.glob("slurm-*.out"))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A job that wrote `slurm-<id>.out` into the repo ran from there: fail the run, naming it."""
    shutil.rmtree(RUN_CWD, ignore_errors=True)
    new = sorted(set(REPO.glob("slurm-*.out")) - _ROOT_SLURM_OUT_AT_START)
    if new:
        print(f"\nFAILED: a test ran a Slurm job from the repo root, which left {', '.join(p.name for p in new)}",
              file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
# A requeued job's wait on the session cluster (Slurm's cred_expire, 120 s by default). It is also
# a step credential's lifetime, so it keeps room for a loaded 2-core machine.
REQUEUE_DELAY_S = 20
# Tiers (slurm/lxc markers set from the fixtures a test uses) and the per-file progress lines.
pytest_plugins = ["tests.tiers"]


@pytest.fixture(autouse=True)
def environment_restored() -> Iterator[None]:
    """os.environ as it was before each test: code under test that sets a variable for its
    process (the job start's kernel-archive status, a trainer's rendezvous) must not reach the
    tests that a worker runs after it, in whatever order the workers take the files."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """torch on one intra-op thread for a module: small matmuls on a shared 2-core machine only
    contend with more threads (about 10x slower)."""
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def other_uid() -> Iterator[pwd.struct_passwd]:
    """A second local account, one per test worker (parallel workers never share or remove
    another's), made here if absent and removed after the session."""
    if os.geteuid() != 0 or not shutil.which("useradd") or not shutil.which("setpriv"):
        pytest.skip("needs root, useradd and setpriv")
    name = "launch-probe" + os.environ.get("PYTEST_XDIST_WORKER", "").removeprefix("gw")
    made = False
    try:
        pwd.getpwnam(name)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True)
        made = True
    try:
        yield pwd.getpwnam(name)
    finally:
        if made:
            subprocess.run(["userdel", name], check=False)


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
                          timeout=timeout, cwd=RUN_CWD)


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



@pytest.fixture()
def planted_cwd() -> Iterator[tuple[Path, Path]]:
    """(directory, marker): a world-writable, sticky directory (as /tmp) where another uid
    (nobody, 65534, through setpriv: a real second uid writes the files) left packages named
    `submitit` and `fla` whose import creates `marker`. Nothing the toolkit starts there may
    import them. Under a world-traversable root (pytest's own is 0700)."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv for a second uid")
    root = Path(tempfile.mkdtemp(prefix="launch-planted-"))
    root.chmod(0o755)
    shared, marker = root / "shared", root / "imported"
    shared.mkdir()
    shared.chmod(0o1777)
    code = "; ".join(f"mkdir {n} && printf %s {shlex.quote(f'open({str(marker)!r}, {chr(34)}a{chr(34)}).write({n!r})')} "
                     f"> {n}/__init__.py" for n in ("submitit", "fla"))
    try:
        subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", "sh", "-c", code],
                       cwd=shared, check=True, timeout=30)
        assert all((shared / n / "__init__.py").stat().st_uid == 65534 for n in ("submitit", "fla"))
        yield shared, marker
    finally:
        shutil.rmtree(root, ignore_errors=True)
