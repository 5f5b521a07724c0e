"""The launcher against the real embedded Slurm cluster (see conftest.slurm_cluster)."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from conftest import run_launch, slurm_available, wait_for_state

from launch.cluster.embedded import MARKER_VAR, EmbeddedCluster, node_daemon

pytestmark = pytest.mark.slurm


def _submit(env: dict[str, str], *args: str) -> str:
    out = run_launch(["submit", "fixture", *args], env)
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert first.startswith("submitted fixture"), out.stdout
    return first.split()[-1]


def test_submit_runs_to_completed_with_accounting(launch_env):
    job = _submit(launch_env, "--preset", "slow", "--arg", "sleep=4")
    assert wait_for_state(job, launch_env, {"RUNNING"}) == "RUNNING"
    assert wait_for_state(job, launch_env, {"COMPLETED", "FAILED"}) == "COMPLETED"
    # sacct (slurmdbd + MariaDB) knows the job after it left the controller's queue.
    sacct = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "State"], env=launch_env,
                           capture_output=True, text=True)
    assert sacct.stdout.strip() == "COMPLETED"
    logs = run_launch(["logs", job], launch_env)
    assert "fixture done" in logs.stdout
    # The job environment puts compile caches on node-local scratch, per job.
    assert f"TRITON_CACHE_DIR=/tmp/launch-{os.environ.get('USER', 'root')}/{job}/triton" in logs.stdout
    listing = run_launch(["list"], launch_env)
    assert job in listing.stdout and "COMPLETED" in listing.stdout


def test_follow_streams_log_and_exit_code(launch_env):
    out = run_launch(["submit", "fixture", "--follow"], launch_env)
    assert out.returncode == 0, out.stderr
    assert "fixture done" in out.stdout
    assert "COMPLETED" in out.stdout


def test_cancel(launch_env):
    job = _submit(launch_env, "--preset", "slow")
    wait_for_state(job, launch_env, {"RUNNING"})
    out = run_launch(["cancel", job], launch_env)
    assert out.returncode == 0, out.stderr
    assert wait_for_state(job, launch_env, {"CANCELLED", "COMPLETED"}) == "CANCELLED"


def test_failed_job_error_reaches_logs_and_status(launch_env):
    job = _submit(launch_env, "--preset", "crash")
    assert wait_for_state(job, launch_env, {"FAILED", "COMPLETED"}) == "FAILED"
    status = run_launch(["status", job], launch_env)
    assert status.returncode == 1
    assert "fixture failure: shard 7 is corrupt" in status.stdout
    logs = run_launch(["logs", job], launch_env)
    assert "fixture failure: shard 7 is corrupt" in logs.stdout


def test_nonzero_exit_code_fails_the_job(launch_env):
    out = run_launch(["submit", "fixture", "--arg", "mode=exit3", "--follow"], launch_env)
    assert out.returncode == 1
    assert "exited with code 3" in out.stdout


def test_gres_stand_ins_set_cuda_visible_devices_and_reach_prolog(launch_env, slurm_cluster):
    job = _submit(launch_env, "--preset", "gpu2")
    assert wait_for_state(job, launch_env, {"COMPLETED", "FAILED"}) == "COMPLETED"
    logs = run_launch(["logs", job], launch_env).stdout
    assert "CUDA_VISIBLE_DEVICES=0,1" in logs
    assert "SLURM_JOB_GPUS=0,1" in logs
    prolog_log = (slurm_cluster.state_dir / "prolog.log").read_text()
    assert f"{job} gpus=0,1" in prolog_log


def test_dry_run_prints_script_and_submits_nothing(launch_env):
    out = run_launch(["submit", "stage1", "--preset", "tiny", "--dry-run"], launch_env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("#SBATCH") >= 5
    assert "export TRITON_CACHE_DIR=$LAUNCH_SCRATCH/triton" in out.stdout
    assert "python -m train.stage1 --preset tiny" in out.stdout
    assert run_launch(["list"], launch_env).stdout.startswith("no jobs")


def test_second_up_changes_nothing(slurm_cluster):
    pids = slurm_cluster.running_daemons()
    assert slurm_cluster.up(gpus=4, cpus=4) is False
    assert slurm_cluster.running_daemons() == pids


def _live_processes_of(state_dir: Path) -> list[str]:
    found = []
    marker = f"{MARKER_VAR}={state_dir}".encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            if "State:\tZ" in status:
                continue  # reaped by init eventually; not running
            cmdline = (entry / "cmdline").read_bytes()
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0") or str(state_dir).encode() in cmdline:
            found.append(entry.name + ": " + cmdline.replace(b"\0", b" ").decode(errors="replace"))
    return found


def test_cluster_down_leaves_nothing_behind(tmp_path):
    reason = slurm_available()
    if reason:
        pytest.skip(reason)
    cluster = EmbeddedCluster(tmp_path / "c")
    assert cluster.up(gpus=1, cpus=2) is True
    env = {**os.environ, **cluster.env()}
    sb = subprocess.run(["sbatch", "--parsable", "-o", str(tmp_path / "j.out"), "--wrap", "sleep 300"], env=env,
                        capture_output=True, text=True)
    assert sb.returncode == 0, sb.stderr
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        q = subprocess.run(["squeue", "-h", "-o", "%T"], env=env, capture_output=True, text=True)
        if q.stdout.strip() == "RUNNING":
            break
        time.sleep(0.3)
    assert _live_processes_of(cluster.state_dir), "the cluster should be running before down"
    node = cluster.nodes()[0]["name"]
    stopped = cluster.down()
    assert stopped == [node_daemon(node), "slurmctld", "slurmdbd", "munged", "mariadb"]
    assert _live_processes_of(cluster.state_dir) == []
    assert not cluster.is_up()
    assert cluster.down() == []  # a second down is a no-op
