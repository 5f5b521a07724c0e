"""The embedded cluster and the launcher's state are the user's own: a second local uid (a real
account made with useradd, commands run as it with setpriv) can neither submit, read accounting,
see the queue, cancel the user's job, nor read the job registry or a job folder.

The cluster and LAUNCH_HOME live under a world-traversable directory here (pytest's own temp
root is 0700, which would refuse the other uid before any of the cluster's own permissions are
tried); the control lines show the other uid does reach them: it reads slurm.conf, and root
runs the same commands."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import JOB_FIXTURES, REPO, run_launch, slurm_available, wait_for_state

from launch.cluster.embedded import EmbeddedCluster

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

@pytest.fixture(scope="module")
def open_root() -> Iterator[Path]:
    root = Path(tempfile.mkdtemp(prefix="launch-private-"))
    root.chmod(0o755)
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def as_other(user: pwd.struct_passwd, argv: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups", "--", *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd="/",
                          env={"PATH": "/usr/local/bin:/usr/bin:/bin", "SLURM_CONF": env["SLURM_CONF"]})


def test_a_second_uid_can_neither_submit_nor_see_nor_cancel_nor_read(other_uid, open_root: Path) -> None:
    reason = slurm_available()
    if reason:
        pytest.skip(reason)
    cluster = EmbeddedCluster(open_root / "cluster")
    cluster.up(cpus=2)
    try:
        env = {**os.environ, **cluster.env(), "LAUNCH_HOME": str(open_root / "home"),
               "LAUNCH_JOBS_PATH": str(JOB_FIXTURES), "PYTHONPATH": os.pathsep.join([str(REPO), str(JOB_FIXTURES)])}
        sub = run_launch(["submit", "fixture", "--preset", "slow", "--parsable"], env)
        assert sub.returncode == 0, sub.stderr
        job = sub.stdout.strip()
        assert wait_for_state(job, env, {"RUNNING"}, timeout=120) == "RUNNING"

        # control: the other uid reaches the cluster's config, and root's own commands work
        assert as_other(other_uid, ["cat", env["SLURM_CONF"]], env).returncode == 0
        # slurmctld hands the job's start to slurmdbd asynchronously: wait until root's sacct lists it
        deadline, listed = time.monotonic() + 60, ""
        while job not in listed and time.monotonic() < deadline:
            listed = subprocess.run(["sacct", "-a", "-X", "-n", "-o", "JobID"], capture_output=True, text=True,
                                    env=env).stdout
            if job not in listed:
                time.sleep(1)
        assert job in listed, "root's sacct never listed the job: the control of the accounting check failed"

        submit = as_other(other_uid, ["sbatch", "--wrap", "true"], env)
        assert submit.returncode != 0 and "Submitted batch job" not in submit.stdout, submit.stdout + submit.stderr
        accounting = as_other(other_uid, ["sacct", "-a", "-X", "-n", "-P", "-o", "JobID,JobName,WorkDir"], env)
        assert job not in accounting.stdout and str(open_root) not in accounting.stdout, accounting.stdout
        queue = as_other(other_uid, ["squeue", "-h", "-o", "%i %j"], env)
        assert job not in queue.stdout, queue.stdout
        cancel = as_other(other_uid, ["scancel", job], env)
        assert cancel.returncode != 0, cancel.stdout + cancel.stderr
        assert wait_for_state(job, env, {"RUNNING"}, timeout=10) == "RUNNING"  # still running

        registry = open_root / "home" / "jobs.jsonl"
        assert registry.stat().st_mode & 0o777 == 0o600
        assert as_other(other_uid, ["cat", str(registry)], env).returncode != 0
        folder = open_root / "home" / "runs" / "fixture" / job
        assert as_other(other_uid, ["ls", str(folder)], env).returncode != 0
        assert as_other(other_uid, ["cat", str(folder / f"{job}_submission.sh")], env).returncode != 0
        # nothing of the other uid's reached the accounting (root sees all users' jobs)
        users = subprocess.run(["sacct", "-a", "-X", "-n", "-P", "-o", "User"], capture_output=True, text=True, env=env)
        assert other_uid.pw_name not in users.stdout, users.stdout
        # a dependency on a job Slurm does not know would be satisfied at once: refused
        dep = run_launch(["submit", "fixture", "--dependency", "afterok:999999", "--parsable"], env)
        assert dep.returncode != 0 and dep.stdout == "", dep.stdout + dep.stderr
        assert "--dependency afterok:999999: Slurm knows no job 999999" in dep.stderr, dep.stderr
        run_launch(["cancel", job], env)
    finally:
        cluster.down()
