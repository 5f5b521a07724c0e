"""The launcher against the real embedded Slurm cluster (see conftest.slurm_cluster)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import RUN_CWD, run_launch, slurm_available, wait_for_state

from launch.cluster.embedded import MARKER_VAR, EmbeddedCluster, node_daemon

pytestmark = pytest.mark.slurm


def _submit(env: dict[str, str], *args: str) -> str:
    out = run_launch(["submit", "fixture", *args], env)
    assert out.returncode == 0, out.stderr
    first = out.stdout.splitlines()[0]
    assert first.startswith("submitted fixture"), out.stdout
    return first.split()[-1]


def test_submit_runs_to_completed_with_accounting(launch_env, tmp_path):
    # A value that would run a command if it reached the script unquoted.
    probe = f"$(touch {tmp_path}/pwned); `touch {tmp_path}/pwned2`"
    job = _submit(launch_env, "--preset", "slow", "--arg", "sleep=4", "--env", f"PROBE={probe}")
    assert wait_for_state(job, launch_env, {"RUNNING"}) == "RUNNING"
    assert wait_for_state(job, launch_env, {"COMPLETED", "FAILED"}) == "COMPLETED"
    # sacct (slurmdbd + MariaDB) knows the job after it left the controller's queue.
    sacct = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "State"], env=launch_env,
                           capture_output=True, text=True)
    assert sacct.stdout.strip() == "COMPLETED"
    logs = run_launch(["logs", job], launch_env)
    assert "fixture done" in logs.stdout
    assert f"PROBE={probe}\n" in logs.stdout and not list(tmp_path.glob("pwned*"))
    # The job environment puts compile caches on node-local scratch, per job.
    assert f"TRITON_CACHE_DIR=/tmp/launch-{os.environ.get('USER', 'root')}/{job}/triton" in logs.stdout
    listing = run_launch(["list"], launch_env)
    assert job in listing.stdout and "COMPLETED" in listing.stdout


def test_loader_env_cannot_choose_srun_and_the_job_folder_is_private(launch_env, tmp_path):
    """--env PATH (allowed with --allow-loader-env) puts a fake srun first: the script still
    starts the tasks with the real one, by absolute path. The job folder is its owner's only:
    folders 0700, the sbatch script (it holds the env values), pickles and logs 0600."""
    evil = tmp_path / "evil"
    evil.mkdir()
    (evil / "srun").write_text(f"#!/bin/sh\ntouch {tmp_path}/pwned\nexit 1\n")
    (evil / "srun").chmod(0o755)
    path = f"{evil}:/usr/local/bin:/usr/bin:/bin"
    refused = run_launch(["submit", "fixture", "--env", f"PATH={path}"], launch_env)
    assert refused.returncode != 0 and "add --allow-loader-env if you mean it" in refused.stderr
    job = _submit(launch_env, "--env", f"PATH={path}", "--allow-loader-env", "--env", "TOKEN=s3cret")
    assert wait_for_state(job, launch_env, {"COMPLETED", "FAILED"}) == "COMPLETED"
    assert not (tmp_path / "pwned").exists()
    folder = Path(launch_env["LAUNCH_HOME"]) / "runs" / "fixture" / job
    assert "fixture done" in run_launch(["logs", job], launch_env).stdout
    script = folder / f"{job}_submission.sh"
    assert "TOKEN=s3cret" in script.read_text()
    for path in (folder.parent, folder, *folder.iterdir()):
        mode = path.stat().st_mode & 0o777
        assert mode & 0o077 == 0, f"{path} is {oct(mode)}"
    assert folder.stat().st_mode & 0o777 == 0o700 and script.stat().st_mode & 0o777 == 0o600
    # cancelling the finished job says it had ended (and how), rather than "cancel requested"
    cancel = run_launch(["cancel", job], launch_env)
    assert cancel.returncode == 0 and cancel.stdout.startswith(f"job {job} had already ended (COMPLETED"), cancel.stdout


def test_a_job_never_imports_from_the_directory_launch_submit_ran_in(launch_env, planted_cwd):
    """`launch submit` from a world-writable directory holding another uid's `submitit/` and
    `fla/`: the job (root here) starts as `python -P -m submitit.core._submit` in that directory
    and imports neither; it completes, and the planted code never ran. `python -P -m launch` is
    the `launch` console script (whose sys.path starts at its bin directory)."""
    shared, marker = planted_cwd
    sub = subprocess.run([sys.executable, "-P", "-m", "launch", "submit", "fixture", "--parsable"], env=launch_env,
                         cwd=shared, capture_output=True, text=True, timeout=120)
    assert sub.returncode == 0, sub.stderr
    assert wait_for_state(sub.stdout.strip(), launch_env, {"COMPLETED", "FAILED"}) == "COMPLETED"
    assert not marker.exists(), f"the job imported the planted {marker.read_text()}"


def test_follow_streams_log_and_exit_code(launch_env):
    out = run_launch(["submit", "fixture", "--follow"], launch_env)
    assert out.returncode == 0, out.stderr
    assert "fixture done" in out.stdout
    assert "COMPLETED" in out.stdout


def _metrics_steps(job_dir: Path) -> list[int]:
    path = job_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(ln)["step"] for ln in path.read_text().splitlines() if ln.strip()]


@pytest.mark.parametrize("preset", ["counting", "counting-own"])
def test_cancel_reads_cancelled_at_step_without_traceback(launch_env, preset):
    """counting: the wrapper records the cancel; counting-own: the entrypoint catches SIGTERM and
    writes outcome.json itself (as the trainers' runtime does), and its record is kept."""
    out = run_launch(["submit", "fixture", "--preset", preset, "--no-preflight", "--json"], launch_env)
    assert out.returncode == 0, out.stderr
    submitted = json.loads(out.stdout)
    job, job_dir = submitted["job_id"], Path(submitted["folder"])
    deadline = time.monotonic() + 60
    while len(_metrics_steps(job_dir)) < 3 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert len(_metrics_steps(job_dir)) >= 3
    out = run_launch(["cancel", job], launch_env)
    assert out.returncode == 0, out.stderr
    assert wait_for_state(job, launch_env, {"CANCELLED", "COMPLETED"}) == "CANCELLED"
    outcome = json.loads((job_dir / "outcome.json").read_text())
    assert outcome["state"] == "cancelled" and outcome["step"] == _metrics_steps(job_dir)[-1] >= 3
    assert outcome["trainer"] == ("fixture" if preset == "counting-own" else None)
    status = run_launch(["status", job], launch_env)
    assert f"outcome: cancelled at step {outcome['step']}" in status.stdout, status.stdout
    assert status.returncode == 0, "a cancelled job is how it was asked to end: exit 1 is for a failed one"
    assert "Traceback" not in status.stdout + status.stderr
    assert "DataLoader" not in status.stdout and "RuntimeError" not in status.stdout


def test_failed_job_error_reaches_logs_and_status(launch_env):
    job = _submit(launch_env, "--preset", "crash")
    assert wait_for_state(job, launch_env, {"FAILED", "COMPLETED"}) == "FAILED"
    status = run_launch(["status", job], launch_env)
    assert status.returncode == 1
    assert "outcome: failed: ValueError: fixture failure: shard 7 is corrupt" in status.stdout
    assert "Traceback" not in status.stdout
    # The job wrote its outcome (one line), and the full traceback stayed in the log.
    job_dir = Path(launch_env["LAUNCH_HOME"]) / "runs" / "fixture" / job
    outcome = json.loads((job_dir / "outcome.json").read_text())
    assert outcome == {**outcome, "state": "failed", "step": None,
                       "error": "ValueError: fixture failure: shard 7 is corrupt"}
    task0 = json.loads((job_dir / "outcome.task0.json").read_text())
    assert (task0["state"], task0["task"], task0["error"]) == ("failed", 0, outcome["error"])
    assert "Traceback (most recent call last)" in (job_dir / f"{job}_0_log.err").read_text()
    logs = run_launch(["logs", job], launch_env)
    assert "fixture failure: shard 7 is corrupt" in logs.stdout
    # The terminal gets the traceback's last line; --verbose (and the file) the whole of it.
    assert "Traceback" not in logs.stdout and "(traceback in the log)" in logs.stdout, logs.stdout
    assert "Traceback (most recent call last)" in run_launch(["logs", job, "--verbose"], launch_env).stdout
    # Followed to its end, the reason is said once, in the launcher's closing line.
    followed = run_launch(["submit", "fixture", "--preset", "crash", "--follow"], launch_env)
    assert followed.returncode == 1
    assert followed.stdout.count("shard 7 is corrupt") == 1, followed.stdout
    assert "ended FAILED: failed: ValueError: fixture failure: shard 7 is corrupt" in followed.stdout, followed.stdout


def test_failed_preflight_is_the_outcome_for_a_spec_given_by_path(launch_env, tmp_path):
    spec = tmp_path / "locked.yaml"
    spec.write_text('name: locked\nentrypoint: fixture_entry\nresources: {time: "00:05:00"}\nlock: {torch: ">=99"}\n')
    out = run_launch(["submit", str(spec), "--parsable"], launch_env)
    assert out.returncode == 0, out.stderr
    job = out.stdout.strip()
    assert wait_for_state(job, launch_env, {"COMPLETED", "FAILED"}) == "FAILED"
    status = run_launch(["status", job], launch_env).stdout
    assert "outcome: failed: preflight: doctor found 1 failing check(s): versions.lock: locked lock: torch" in status
    assert "fixture done" not in run_launch(["logs", job], launch_env).stdout  # the entrypoint never ran


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


def test_infeasible_request_is_refused_in_one_line(launch_env):
    for extra in ([], ["--dry-run"]):
        out = run_launch(["submit", "fixture", "--gpus-per-node", "64", *extra], launch_env)
        assert out.returncode == 2, out.stdout + out.stderr
        assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
        # Names what was asked and what the largest node has (the session cluster: 4 GPUs, 4 CPUs).
        assert "asks for 1 node with 64 GPUs, 64 CPUs" in out.stderr, out.stderr
        assert "has 4 GPUs, 4 CPUs" in out.stderr, out.stderr
    assert run_launch(["list"], launch_env).stdout.startswith("no jobs")


def test_follow_heartbeat_names_the_pending_reason_of_a_held_job(launch_env):
    blocker = _submit(launch_env, "--preset", "slow", "--no-preflight")
    # sleep=3: the job stays RUNNING across several of the follower's 1-s polls (a job that ends
    # between two polls would go from PENDING straight to COMPLETED in what it prints).
    held = run_launch(["submit", "fixture", "--no-preflight", "--parsable", "--arg", "sleep=3",
                       "--dependency", f"afterany:{blocker}"], launch_env)
    assert held.returncode == 0, held.stderr
    job = held.stdout.strip()
    subprocess.run(["scontrol", "hold", job], env=launch_env, check=True, capture_output=True)
    follower = subprocess.Popen([sys.executable, "-m", "launch", "logs", "-f", job], env=launch_env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=RUN_CWD)
    try:
        first = follower.stdout.readline()
        assert first.startswith(f"[launch] job {job}: PENDING: held by ") and f"`scontrol release {job}`" in first, first
        subprocess.run(["scontrol", "release", job], env=launch_env, check=True, capture_output=True)
        run_launch(["cancel", blocker], launch_env)
        rest, _ = follower.communicate(timeout=90)
    finally:
        follower.kill()
    assert follower.returncode == 0, first + rest
    # The reason changed (held -> the dependency, or straight to running): each change is said.
    assert f"[launch] job {job}: RUNNING" in rest and f"[launch] job {job}: COMPLETED" in rest, rest
    assert "fixture done" not in rest or rest.index("RUNNING") < rest.index("fixture done")


def test_logs_of_task_1_of_a_two_task_job(launch_env):
    job = _submit(launch_env, "--preset", "gpu2", "--no-preflight")
    assert wait_for_state(job, launch_env, {"COMPLETED", "FAILED"}) == "COMPLETED"
    one = run_launch(["logs", job, "--task", "1"], launch_env)
    assert one.returncode == 0, one.stderr
    assert "fixture task 1 of 2" in one.stdout and "fixture task 0 of 2" not in one.stdout
    every = run_launch(["logs", job, "--all", "--tail", "2"], launch_env).stdout
    sections = [part.splitlines()[1:] for part in every.split("==> ")[1:]]
    assert len(sections) == 4  # out and err of each task
    assert all(len(lines) <= 2 for lines in sections), every  # --tail 2: each log's last lines
    assert "[task 0] " in every and "[task 1] " in every
    assert "[task 1] fixture task 1 of 2" in run_launch(["logs", job, "--all"], launch_env).stdout
    assert "tasks (main 0): 0 completed, 1 completed" in run_launch(["status", job], launch_env).stdout


def test_bogus_arg_is_refused_before_submit(launch_env):
    out = run_launch(["submit", "fixture", "--arg", "bogus=1"], launch_env)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "launch submit: error: fixture: unknown argument(s): --arg bogus=1 "
        "(its arguments: `python -m fixture_entry --help`, each given as --arg KEY=VALUE); nothing submitted"]
    assert run_launch(["list"], launch_env).stdout.startswith("no jobs")


def test_json_output_of_submit_status_and_list(launch_env):
    out = run_launch(["submit", "fixture", "--no-preflight", "--json", "--name", "jsonprobe"], launch_env)
    assert out.returncode == 0, out.stderr
    submitted = json.loads(out.stdout)
    job = submitted["job_id"]
    assert submitted["name"] == "fixture" and submitted["tasks"] == 1 and submitted["log"].endswith(f"{job}_0_log.out")
    wait_for_state(job, launch_env, {"COMPLETED", "FAILED"})
    status = json.loads(run_launch(["status", job, "--json"], launch_env).stdout)
    assert status["state"] == "COMPLETED" and status["outcome"]["state"] == "completed"
    listing = json.loads(run_launch(["list", "--json"], launch_env).stdout)
    assert [row["job_id"] for row in listing] == [job]
    # --name reached sbatch. slurmdbd may first hold the job under its placeholder name
    # "allocation" until slurmctld's full record arrives (seen under load), so wait for that.
    deadline, name = time.monotonic() + 60, ""
    while time.monotonic() < deadline:
        name = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "JobName"], env=launch_env,
                              capture_output=True, text=True).stdout.strip()
        if name not in ("", "allocation"):
            break
        time.sleep(1)
    assert name == "jsonprobe"


def test_doctor_job_is_recorded_and_cancelled_on_sigterm(launch_env):
    doctor = subprocess.Popen([sys.executable, "-m", "launch", "doctor", "--on-cluster"], env=launch_env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=RUN_CWD)
    try:
        line = doctor.stderr.readline()
        assert line.startswith("doctor submitted as Slurm job "), line
        job = line.split()[5].rstrip(";")
        doctor.send_signal(signal.SIGTERM)
        _, err = doctor.communicate(timeout=60)
    finally:
        doctor.kill()
    assert doctor.returncode == 143 and f"doctor job {job} cancelled (SIGTERM)" in err, err
    assert wait_for_state(job, launch_env, {"CANCELLED", "COMPLETED"}) == "CANCELLED"
    listing = run_launch(["list"], launch_env).stdout
    assert any(row.split()[:2] == [job, "doctor"] for row in listing.splitlines()), listing


def test_dry_run_prints_script_and_submits_nothing(launch_env):
    out = run_launch(["submit", "stage1", "--preset", "tiny", "--dry-run"], launch_env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("#SBATCH") >= 5
    assert 'export TRITON_CACHE_DIR="$LAUNCH_SCRATCH"/triton' in out.stdout
    # The scratch default expands only its documented variables, each quoted.
    assert 'export LAUNCH_SCRATCH="${LAUNCH_NODE_SCRATCH:-/tmp}"/launch-"${USER:-root}"/"${SLURM_JOB_ID}"' in out.stdout
    assert "python -m train.stage1 --shape tiny" in out.stdout
    assert run_launch(["list"], launch_env).stdout.startswith("no jobs")


def test_accounting_killed_mid_job_the_job_finishes_and_up_restarts_only_it(launch_env, slurm_cluster):
    """slurmdbd and MariaDB SIGKILLed while a job runs: the job completes, `launch status`
    answers (from slurmctld), and `up` restarts exactly those two; sacct then knows the job."""
    job = _submit(launch_env, "--preset", "slow", "--arg", "sleep=5")
    assert wait_for_state(job, launch_env, {"RUNNING"}) == "RUNNING"
    before = slurm_cluster.running_daemons()
    said: list[str] = []
    try:
        for name in ("slurmdbd", "mariadb"):
            os.kill(before[name], signal.SIGKILL)
        deadline = time.monotonic() + 10
        while {"slurmdbd", "mariadb"} & set(slurm_cluster.running_daemons()) and time.monotonic() < deadline:
            for name in ("slurmdbd", "mariadb"):
                slurm_cluster._reap(before[name])
            time.sleep(0.1)
        assert not {"slurmdbd", "mariadb"} & set(slurm_cluster.running_daemons())
        assert wait_for_state(job, launch_env, {"COMPLETED", "FAILED"}) == "COMPLETED"
        status = run_launch(["status", job], launch_env)
        assert status.returncode == 0 and "COMPLETED" in status.stdout, status.stdout + status.stderr
    finally:
        assert slurm_cluster.up(progress=said.append) is True
    after = slurm_cluster.running_daemons()
    assert {n for n in before if after.get(n) != before[n]} == {"slurmdbd", "mariadb"}, (before, after)
    assert any("restarting mariadb, slurmdbd" in line for line in said), said
    deadline = time.monotonic() + 60  # slurmctld resends the job's records once slurmdbd is back
    sacct = ""
    while time.monotonic() < deadline and sacct != "COMPLETED":
        sacct = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "State"], env=launch_env,
                               capture_output=True, text=True).stdout.strip()
        time.sleep(1)
    assert sacct == "COMPLETED"


def test_second_up_changes_nothing(slurm_cluster):
    pids = slurm_cluster.running_daemons()
    assert slurm_cluster.up(gpus=4, cpus=4) is False
    assert slurm_cluster.running_daemons() == pids


def test_daemons_are_reachable_from_this_machine_only(slurm_cluster):
    """slurmctld, slurmd, slurmdbd and MariaDB listen on loopback only; a neighbour one veth
    hop away is refused on every one of their ports (tests/netprobe.py)."""
    from netprobe import assert_reachable_from_this_machine_only

    pids = slurm_cluster.running_daemons()
    pids.pop("munged")  # a unix socket only
    assert_reachable_from_this_machine_only(pids)


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


def test_status_of_a_running_job_says_its_step_and_eta(launch_env):
    """`launch status N` of a RUNNING job: the step and ETA the trainer last logged (what the
    follow's heartbeat says), in the text and in --json; none once it has ended."""
    job = _submit(launch_env, "--no-preflight", "--arg", "steps=2", "--arg", "step_s=0.2", "--arg", "sleep=30")
    metrics = None
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        rec = json.loads(run_launch(["status", job, "--json"], launch_env).stdout)
        if rec["state"] == "RUNNING" and rec.get("progress", {}).get("step") == 2:
            metrics = rec["progress"]
            break
        time.sleep(0.5)
    assert metrics is not None and metrics["steps_total"] == 2 and metrics["eta_s"] == pytest.approx(30), metrics
    text = run_launch(["status", job], launch_env).stdout
    assert "  progress: step 2/2, ETA 0:30" in text, text
    run_launch(["cancel", job], launch_env)
    wait_for_state(job, launch_env, {"CANCELLED"})
    assert "progress:" not in run_launch(["status", job], launch_env).stdout
