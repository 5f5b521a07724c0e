"""Keepalive acceptance: the holder under test wired into the REAL embedded Slurm as
Prolog/Epilog, with 4 stand-in GPUs.

Real: slurmctld/slurmd/slurmdbd/munge, sbatch, the Prolog/Epilog run as root by slurmd with
PrologFlags=Alloc, the holder process, its root-only socket, flock, setuid to nobody.
Stand-in: the GPUs are char devices with the NVIDIA major 195 (this machine has no NVIDIA
driver), so the holder holds them by lock, and a job "uses" a GPU by taking the same lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.cluster.embedded import EmbeddedCluster
from tests.keepalive_fixtures import (
    NOBODY_UID,
    SYSTEM_PYTHON,
    Holder,
    base_env,
    can_lock,
    world_readable_dir,
)

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
ALL_GPUS = [0, 1, 2, 3]

# The job's payload: record what it sees, optionally use (lock) its GPUs, wait for the test's
# go-ahead, then exit with the requested code (or crash by SIGKILL).
JOB_SCRIPT = textwrap.dedent("""\
    import fcntl, json, os, signal, sys, time
    out_dir, devices, state_path, mode = sys.argv[1:5]
    job = os.environ["SLURM_JOB_ID"]
    mine = [int(g) for g in os.environ.get("SLURM_JOB_GPUS", "").split(",") if g]
    def can_lock(i):
        fd = os.open(f"{devices}/nvidia{i}.lock", os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)
        return True
    lockable = [i for i in range(4) if can_lock(i)]
    held_fds = []
    if mode in ("use", "crash"):
        for i in mine:  # use the GPUs: take and keep their locks
            fd = os.open(f"{devices}/nvidia{i}.lock", os.O_RDONLY)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            held_fds.append(fd)
    with open(state_path) as f:
        state = json.load(f)
    record = {"job": job, "gpus": mine, "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
              "lockable": lockable, "holder_state": state}
    tmp = f"{out_dir}/{job}.json.tmp"
    with open(tmp, "w") as f:
        json.dump(record, f)
    os.replace(tmp, f"{out_dir}/{job}.json")
    if mode == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    deadline = time.time() + 120
    while not os.path.exists(f"{out_dir}/{job}.go") and time.time() < deadline:
        time.sleep(0.05)
    """)


class KeepaliveSlurm:
    """One embedded cluster whose Prolog/Epilog are the keepalive hooks, plus the holder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cluster = EmbeddedCluster(root / "cluster")
        self.out = root / "out"
        self.out.mkdir()
        self.out.chmod(0o777)
        self.job_py = root / "job.py"
        self.job_py.write_text(JOB_SCRIPT)
        # the holder's paths live in `root`; its devices are the cluster's stand-in GPUs
        self.holder = Holder(root, extra_args=["--reconcile-interval", "5"])

    def start(self) -> None:
        hooks = subprocess.run(
            [sys.executable, "-m", "launch", "keepalive", "hooks", "--dir", str(self.root / "hooks"),
             "--socket", str(self.holder.socket), "--log", str(self.holder.hook_log),
             # the prolog's bound is 10 s by default; 3 s keeps the hung-holder test short
             "--prolog-timeout", "3"],
            env=base_env(), capture_output=True, text=True, timeout=60)
        assert hooks.returncode == 0, hooks.stderr
        self.cluster.up(gpus=4, cpus=4, prolog=str(self.root / "hooks" / "prolog"),
                        epilog=str(self.root / "hooks" / "epilog"))
        # the holder finds the cluster's nodes under <root>/dev: point it at the cluster's dev dir
        (self.root / "dev").symlink_to(self.cluster.dev_dir)
        self.holder.env_extra = self.cluster.env()
        self.holder.start()

    def stop(self) -> None:
        self.holder.stop()
        self.cluster.down()

    def env(self) -> dict[str, str]:
        return {**base_env(), **self.cluster.env()}

    def sbatch(self, gpus: int, mode: str = "wait") -> str:
        done = subprocess.run(
            ["sbatch", "--parsable", f"--gres=gpu:{gpus}", "-c", "1", "-o", str(self.out / "%j.log"),
             "--wrap", f"exec {SYSTEM_PYTHON} {self.job_py} {self.out} {self.cluster.dev_dir} "
                       f"{self.holder.state_path} {mode}"],
            env=self.env(), capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().split(";")[0]

    def record(self, job: str, timeout: float = 60) -> dict:
        path = self.out / f"{job}.json"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists():
                return json.loads(path.read_text())
            time.sleep(0.1)
        raise AssertionError(f"job {job} wrote no record in {timeout} s; {self.diagnose(job)}")

    def finish(self, job: str) -> None:
        (self.out / f"{job}.go").touch()

    def job_state(self, job: str) -> str:
        q = subprocess.run(["scontrol", "show", "job", "-o", job], env=self.env(), capture_output=True,
                           text=True, timeout=30)
        for field in q.stdout.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "GONE"

    def wait_job_done(self, job: str, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            state = self.job_state(job)
            if state in ("COMPLETED", "FAILED", "CANCELLED", "NODE_FAIL", "TIMEOUT", "OUT_OF_MEMORY", "GONE"):
                return state
            time.sleep(0.2)
        raise AssertionError(f"job {job} still {state} after {timeout} s")

    def wait_holder(self, held: list[int], released: dict[str, list[int]], timeout: float = 30) -> dict:
        deadline = time.monotonic() + timeout
        state: dict | None = None
        while time.monotonic() < deadline:
            state = self.holder.state()
            if state and state["held"] == held and state["released"] == released:
                return state
            time.sleep(0.1)
        raise AssertionError(f"holder never reached held={held} released={released}; last {state}; "
                             f"hooks: {self.tail(self.holder.hook_log)}")

    def diagnose(self, job: str) -> str:
        return (f"state {self.job_state(job)}; hooks: {self.tail(self.holder.hook_log)}; "
                f"slurmd: {self.tail(self.cluster.log_dir / 'slurmd.log')}")

    @staticmethod
    def tail(path: Path, lines: int = 8) -> str:
        try:
            return " | ".join(path.read_text(errors="replace").splitlines()[-lines:])
        except FileNotFoundError:
            return f"({path} missing)"


@pytest.fixture(scope="module")
def ks() -> Iterator[KeepaliveSlurm]:
    if os.geteuid() != 0:
        pytest.skip("the embedded cluster and the holder's socket need root")
    for tool in ("slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd", "sbatch", "scontrol"):
        if not shutil.which(tool) and not Path("/usr/sbin", tool).exists():
            pytest.skip(f"{tool} not installed (make deps)")
    with world_readable_dir() as root:
        setup = KeepaliveSlurm(root)
        try:
            setup.start()
            yield setup
        finally:
            setup.stop()


@pytest.fixture
def idle(ks: KeepaliveSlurm) -> KeepaliveSlurm:
    """Each test starts with no jobs and every GPU held."""
    ks.wait_holder(ALL_GPUS, {})
    return ks


def test_2gpu_job_runs_while_holder_holds_exactly_the_other_two(idle: KeepaliveSlurm) -> None:
    job = idle.sbatch(2)
    rec = idle.record(job)
    mine = rec["gpus"]
    others = [g for g in ALL_GPUS if g not in mine]
    assert len(mine) == 2
    assert rec["cuda_visible_devices"] is not None
    # inside the job: its own GPUs are free, the other two are held
    assert rec["lockable"] == mine
    assert rec["holder_state"]["held"] == others
    assert rec["holder_state"]["released"] == {job: mine}
    idle.finish(job)
    assert idle.wait_job_done(job) == "COMPLETED"
    idle.wait_holder(ALL_GPUS, {})
    log = idle.holder.hook_log.read_text()
    assert f"prolog job={job} gpus={mine}: released {mine}" in log
    assert f"epilog job={job}: reclaimed {mine}" in log


def test_two_concurrent_2gpu_jobs(idle: KeepaliveSlurm) -> None:
    a, b = idle.sbatch(2, "use"), idle.sbatch(2, "use")
    rec_a, rec_b = idle.record(a), idle.record(b)
    assert sorted(rec_a["gpus"] + rec_b["gpus"]) == ALL_GPUS
    # both run at once (neither finished before the other recorded) and the holder holds nothing
    state = idle.wait_holder([], {a: rec_a["gpus"], b: rec_b["gpus"]})
    assert state["pending"] == []
    assert idle.job_state(a) == "RUNNING" and idle.job_state(b) == "RUNNING"
    idle.finish(a)
    assert idle.wait_job_done(a) == "COMPLETED"
    idle.wait_holder(rec_a["gpus"], {b: rec_b["gpus"]})  # only a's GPUs come back
    idle.finish(b)
    assert idle.wait_job_done(b) == "COMPLETED"
    idle.wait_holder(ALL_GPUS, {})


def test_crashed_job_gets_its_gpus_reclaimed(idle: KeepaliveSlurm) -> None:
    job = idle.sbatch(2, "crash")
    rec = idle.record(job)
    assert rec["lockable"] == rec["gpus"]
    assert idle.wait_job_done(job) == "FAILED"
    idle.wait_holder(ALL_GPUS, {})
    assert all(not can_lock(idle.holder.lock(i)) for i in ALL_GPUS)
    assert f"epilog job={job}: reclaimed {rec['gpus']}" in idle.holder.hook_log.read_text()


def test_holder_restarted_mid_job_does_not_take_the_jobs_gpus(idle: KeepaliveSlurm) -> None:
    # the job does not lock its GPUs, so only the holder's knowledge keeps it off them
    job = idle.sbatch(2, "wait")
    rec = idle.record(job)
    mine = rec["gpus"]
    others = [g for g in ALL_GPUS if g not in mine]
    old_pid = idle.holder.proc.pid
    idle.holder.proc.send_signal(signal.SIGKILL)  # a crash: stale socket and state stay behind
    idle.holder.proc.wait()
    idle.holder.start()
    state = idle.holder.wait_ready()
    assert state["pid"] != old_pid
    assert state["held"] == others and state["released"] == {job: mine}
    assert [i for i in ALL_GPUS if can_lock(idle.holder.lock(i))] == mine
    assert f"job {job} already owns GPU(s) {mine} (from Slurm)" in idle.holder.log_path.read_text()
    idle.finish(job)
    assert idle.wait_job_done(job) == "COMPLETED"
    idle.wait_holder(ALL_GPUS, {})  # the new holder takes them back from the epilog


NOBODY_PROBE = textwrap.dedent("""\
    import fcntl, json, os, socket, subprocess, sys
    sock_path, devices = sys.argv[1], sys.argv[2]
    result = {}
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sock_path)
        result["socket"] = "connected"
    except PermissionError:
        result["socket"] = "denied"
    got = []
    for i in range(4):
        fd = os.open(f"{devices}/nvidia{i}.lock", os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            got.append(i)
        except BlockingIOError:
            pass
    result["locked"] = got
    print(json.dumps(result))
    """)


def test_plain_shell_process_gets_nothing(idle: KeepaliveSlurm) -> None:
    """A process started by ssh/bash, not by Slurm: no release path, no GPU."""
    h = idle.holder
    # as an ordinary user: the socket is out of reach and every GPU is held
    probe = subprocess.run([SYSTEM_PYTHON, "-c", NOBODY_PROBE, str(h.socket), str(idle.cluster.dev_dir)],
                           user=NOBODY_UID, capture_output=True, text=True, timeout=30, cwd="/")
    assert probe.returncode == 0, probe.stderr
    assert json.loads(probe.stdout) == {"socket": "denied", "locked": []}
    # pretending to be a prolog does not help an ordinary user either
    fake = h.hook("prolog", "999999", "0,1", user=NOBODY_UID, env=idle.cluster.env())
    assert fake.returncode == 1
    # a plain shell (even root's) outside any allocation cannot take a held GPU
    shell = subprocess.run(["bash", "-c", f"flock -n -x {h.lock(0)} true"], timeout=30)
    assert shell.returncode != 0
    assert h.state()["held"] == ALL_GPUS and h.state()["released"] == {}
    st = h.socket.stat()
    assert (st.st_mode & 0o777) == 0o600 and st.st_uid == 0
    assert (h.socket.parent.stat().st_mode & 0o777) == 0o700


def test_hung_holder_fails_the_prolog_so_the_job_never_runs_on_a_held_gpu(idle: KeepaliveSlurm) -> None:
    """Last in this module: it drains the node (Slurm's answer to a failed prolog), then undoes that."""
    h = idle.holder
    node = idle.cluster.read_state()["node"]
    h.stop()
    # a holder that accepts connections but never answers, still holding every GPU
    fds = []
    for i in ALL_GPUS:
        fd = os.open(h.lock(i), os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fds.append(fd)
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hung.bind(str(h.socket))
    hung.listen(8)
    job = ""
    try:
        job = idle.sbatch(1)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and f"prolog job={job}" not in h.hook_log.read_text():
            time.sleep(0.2)
        log = h.hook_log.read_text()
        assert "did not answer 'release' within 3 s; failing the prolog" in log, log[-2000:]
        time.sleep(2)  # give slurmd/slurmctld time to act on the failure
        assert not (idle.out / f"{job}.json").exists(), "the job ran although its GPU was still held"
        assert idle.job_state(job) not in ("RUNNING", "COMPLETED")
        sinfo = subprocess.run(["sinfo", "-h", "-N", "-n", node, "-o", "%T"], env=idle.env(),
                               capture_output=True, text=True, timeout=30)
        assert "drain" in sinfo.stdout, sinfo.stdout
    finally:
        hung.close()
        h.socket.unlink(missing_ok=True)
        for fd in fds:
            os.close(fd)
        if job:
            subprocess.run(["scancel", job], env=idle.env(), timeout=30)
        subprocess.run(["scontrol", "update", f"nodename={node}", "state=resume"], env=idle.env(), timeout=30)
        h.start()
    idle.wait_holder(ALL_GPUS, {})
