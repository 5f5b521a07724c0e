"""Keepalive holder protocol tests: the real holder process and the real hook commands,
driven directly with SLURM_* set as slurmd would set them (no Slurm here; see
test_keepalive_slurm.py for the same under the real embedded Slurm).

Stand-in GPUs (char devices, major 195) are held by lock, since this machine has no GPU.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.errors import LaunchError
from launch.keepalive.daemon import KeepaliveDaemon
from launch.keepalive.holders import LockHolder, build_holders, discover_standin_gpus
from launch.keepalive.protocol import parse_gpu_list, request
from launch.keepalive.slurm_state import parse_job_allocations
from tests.keepalive_fixtures import (
    NOBODY_UID,
    SYSTEM_PYTHON,
    Holder,
    base_env,
    can_lock,
    make_standin_gpus,
    running_holder,
    world_readable_dir,
)

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the holder's socket is root-only; run as root")


@pytest.fixture
def world_dir() -> Iterator[Path]:
    with world_readable_dir() as path:
        yield path


@pytest.fixture
def holder(world_dir: Path) -> Iterator[Holder]:
    with running_holder(world_dir, extra_args=["--no-slurm"]) as h:
        yield h


def held_by_holder(h: Holder) -> list[int]:
    return [i for i in range(h.gpus) if not can_lock(h.lock(i))]


# ---- pure parsing ----------------------------------------------------------------------------


def test_parse_gpu_list_accepts_slurm_syntax() -> None:
    assert parse_gpu_list("0,1") == [0, 1]
    assert parse_gpu_list("3,0-2,2") == [0, 1, 2, 3]
    assert parse_gpu_list("") == []


@pytest.mark.parametrize("bad", ["a", "1-", "3-1", "-1", "0,,x"])
def test_parse_gpu_list_rejects_garbage(bad: str) -> None:
    with pytest.raises(LaunchError, match="bad GPU list"):
        parse_gpu_list(bad)


SCONTROL_SAMPLE = textwrap.dedent("""\
    JobId=11 JobName=a UserId=u(1) JobState=RUNNING Reason=None NodeList=n1 TRES=cpu=1,gres/gpu=2 JOB_GRES=gpu:2 Nodes=n1 CPU_IDs=0 Mem=0 GRES=gpu:2(IDX:0-1) Features=(null)
    JobId=12 JobName=b UserId=u(1) JobState=COMPLETED Reason=None Nodes=n1 CPU_IDs=1 Mem=0 GRES=gpu:1(IDX:2)
    JobId=13 JobName=c UserId=u(1) JobState=CONFIGURING Reason=None Nodes=n[1-2] CPU_IDs=1 Mem=0 GRES=gpu:tesla:1(IDX:3)
    JobId=14 JobName=d UserId=u(1) JobState=RUNNING Reason=None Nodes=n2 CPU_IDs=1 Mem=0 GRES=gpu:2(IDX:2-3)
    JobId=15 JobName=e UserId=u(1) JobState=RUNNING Reason=None Nodes=n1 CPU_IDs=1 Mem=0 GRES=
    """)


def test_parse_job_allocations_keeps_active_jobs_on_this_node() -> None:
    # n[1-2] needs scontrol to expand; keep this test pure by naming the single-node form too.
    sample = SCONTROL_SAMPLE.replace("Nodes=n[1-2]", "Nodes=n1,n2")
    assert parse_job_allocations(sample, {"n1"}) == {"11": [0, 1], "13": [3]}
    assert parse_job_allocations(sample, {"n2"}) == {"13": [3], "14": [2, 3]}


def test_build_holders_errors_are_one_line(world_dir: Path) -> None:
    make_standin_gpus(world_dir / "dev", 2)
    (world_dir / "dev" / "nvidiaX").touch()  # not a device: ignored
    assert sorted(discover_standin_gpus(world_dir / "dev")) == [0, 1]
    with pytest.raises(LaunchError, match=r"GPU\(s\) \[5\] not found"):
        build_holders("0,5", world_dir / "dev", 0.5)
    with pytest.raises(LaunchError, match="does not exist"):
        build_holders("auto", world_dir / "nope", 0.5)
    with pytest.raises(LaunchError, match="mem-fraction"):
        build_holders("auto", world_dir / "dev", 1.5)


def test_cli_bad_gpus_is_one_clean_line(world_dir: Path) -> None:
    make_standin_gpus(world_dir / "dev", 2)
    done = subprocess.run(
        [sys.executable, "-m", "launch", "keepalive", "run", "--devices-dir", str(world_dir / "dev"),
         "--gpus", "0,7", "--no-slurm", "--socket", str(world_dir / "s" / "sock"),
         "--state", str(world_dir / "state.json")],
        env=base_env(), capture_output=True, text=True, timeout=30)
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "GPU(s) [7] not found" in done.stderr
    assert "Traceback" not in done.stderr


# ---- the holder and its hooks ----------------------------------------------------------------


def test_holder_holds_every_gpu_and_publishes_state(holder: Holder) -> None:
    state = holder.state()
    assert state is not None
    assert state["held"] == [0, 1, 2, 3] and state["released"] == {} and state["pid"] == holder.proc.pid
    assert held_by_holder(holder) == [0, 1, 2, 3]
    # root-only control: 0700 dir, 0600 socket; the state is readable by everyone
    assert (holder.socket.parent.stat().st_mode & 0o777) == 0o700
    assert (holder.socket.stat().st_mode & 0o777) == 0o600
    assert (holder.state_path.stat().st_mode & 0o777) == 0o644
    status = subprocess.run([sys.executable, "-m", "launch", "keepalive", "status"], env=holder.env(),
                            capture_output=True, text=True, timeout=30)
    assert status.returncode == 0 and "held:     [0, 1, 2, 3]" in status.stdout


def test_prolog_releases_exactly_the_jobs_gpus_and_epilog_reclaims(holder: Holder) -> None:
    done = holder.hook("prolog", "101", "1,2")
    assert done.returncode == 0, done.stderr
    # the ack means the locks are already free: no waiting here
    assert held_by_holder(holder) == [0, 3]
    state = holder.state()
    assert state["held"] == [0, 3] and state["released"] == {"101": [1, 2]}
    assert "prolog job=101 gpus=[1, 2]: released [1, 2]" in holder.hook_log.read_text()

    done = holder.hook("epilog", "101", "1,2")
    assert done.returncode == 0, done.stderr
    assert held_by_holder(holder) == [0, 1, 2, 3]
    assert holder.state()["released"] == {}


def test_prolog_for_a_gpu_the_node_does_not_have_fails_and_releases_nothing(holder: Holder) -> None:
    """gres.conf gives job 102 GPU 7 on a 4-GPU node: the prolog exits 1 (Slurm then requeues
    the job and drains the node) naming the GPU, and GPU 1 stays held."""
    done = holder.hook("prolog", "102", "1,7")
    assert done.returncode == 1
    log = holder.hook_log.read_text()
    assert "job 102 was allocated GPU(s) [7], which this node does not have (it has [0, 1, 2, 3])" in log
    assert held_by_holder(holder) == [0, 1, 2, 3] and holder.state()["released"] == {}


def test_overlapping_jobs_on_disjoint_gpus(holder: Holder) -> None:
    results: dict[str, subprocess.CompletedProcess[str]] = {}

    def prolog(job: str, gpus: str) -> None:
        results[job] = holder.hook("prolog", job, gpus)

    threads = [threading.Thread(target=prolog, args=a) for a in (("201", "0,1"), ("202", "2,3"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.returncode == 0 for r in results.values()), results
    assert held_by_holder(holder) == []
    assert holder.state()["released"] == {"201": [0, 1], "202": [2, 3]}
    # one job ends; only its GPUs come back, the other job keeps its own
    assert holder.hook("epilog", "201", "0,1").returncode == 0
    assert held_by_holder(holder) == [0, 1]
    assert holder.state()["released"] == {"202": [2, 3]}


def test_crashed_job_whose_process_lingers_is_reclaimed_once_it_dies(holder: Holder) -> None:
    assert holder.hook("prolog", "301", "3").returncode == 0
    # the "job" takes its GPU, then the epilog runs while a straggler still holds it
    job = subprocess.Popen(["flock", "-x", str(holder.lock(3)), "sleep", "60"], start_new_session=True)
    deadline = time.monotonic() + 5
    while can_lock(holder.lock(3)) and time.monotonic() < deadline:
        time.sleep(0.02)
    answer = holder.hook("epilog", "301", "3")
    assert answer.returncode == 0
    assert holder.state()["pending"] == [3]
    os.killpg(job.pid, signal.SIGKILL)  # the crash: flock and its sleep child, which shares the lock
    job.wait()
    deadline = time.monotonic() + 5
    while holder.state()["held"] != [0, 1, 2, 3] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert holder.state()["held"] == [0, 1, 2, 3] and holder.state()["pending"] == []
    assert held_by_holder(holder) == [0, 1, 2, 3]


def test_prolog_without_holder_lets_job_proceed_and_logs(world_dir: Path) -> None:
    h = Holder(world_dir)  # never started
    done = h.hook("prolog", "401", "0")
    assert done.returncode == 0
    assert "no keepalive holder listens" in h.hook_log.read_text()
    assert "the job proceeds" in h.hook_log.read_text()
    assert h.hook("epilog", "401", "0").returncode == 0


def test_prolog_fails_when_holder_does_not_ack_in_time(world_dir: Path) -> None:
    """A hung holder: it listens but never answers. The prolog must fail within its bound."""
    h = Holder(world_dir)
    h.socket.parent.mkdir(parents=True, mode=0o700)
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hung.bind(str(h.socket))
    hung.listen(8)
    try:
        t0 = time.monotonic()
        done = h.hook("prolog", "402", "0", timeout=0.5)
        elapsed = time.monotonic() - t0
    finally:
        hung.close()
    assert done.returncode == 1
    assert "did not answer 'release' within 0.5 s" in h.hook_log.read_text()
    assert elapsed < 5


def test_prolog_default_timeout_comes_from_env(world_dir: Path) -> None:
    h = Holder(world_dir, env_extra={"LAUNCH_KEEPALIVE_TIMEOUT": "0.3"})
    h.socket.parent.mkdir(parents=True, mode=0o700)
    hung = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    hung.bind(str(h.socket))
    hung.listen(8)
    try:
        done = h.hook("prolog", "403", "0")
    finally:
        hung.close()
    assert done.returncode == 1 and "within 0.3 s" in h.hook_log.read_text()


def test_hook_outside_slurm_is_a_clean_error(holder: Holder) -> None:
    done = holder.hook("prolog", None, "0")
    assert done.returncode == 2 and "SLURM_JOB_ID is not set" in done.stderr and "Traceback" not in done.stderr
    done = holder.hook("prolog", "404", "zero")
    assert done.returncode == 2 and "bad GPU list 'zero'" in done.stderr
    assert held_by_holder(holder) == [0, 1, 2, 3]


def test_job_without_gpus_does_not_touch_the_holder(holder: Holder) -> None:
    assert holder.hook("prolog", "405", "").returncode == 0
    assert holder.state()["released"] == {} and held_by_holder(holder) == [0, 1, 2, 3]


# ---- a process that is not Slurm gets nothing ------------------------------------------------


NOBODY_PROBE = textwrap.dedent("""\
    import fcntl, os, socket, sys
    sock_path, lock_path = sys.argv[1], sys.argv[2]
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(sock_path)
        s.sendall(b'{"op": "release", "job": "1", "gpus": [0]}\\n')
        print("answer", s.recv(4096).decode().strip())
    except PermissionError:
        print("socket: permission denied")
    fd = os.open(lock_path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        print("lock: got it")
    except BlockingIOError:
        print("lock: busy")
    """)


def _probe_as_nobody(h: Holder) -> str:
    done = subprocess.run([SYSTEM_PYTHON, "-c", NOBODY_PROBE, str(h.socket), str(h.lock(0))],
                          user=NOBODY_UID, capture_output=True, text=True, timeout=30, cwd="/")
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_plain_process_gets_nothing(holder: Holder) -> None:
    out = _probe_as_nobody(holder)
    assert "socket: permission denied" in out and "lock: busy" in out
    # nor through the hook command itself, run as an ordinary user
    done = holder.hook("prolog", "501", "0", user=NOBODY_UID)
    assert done.returncode == 1
    assert held_by_holder(holder) == [0, 1, 2, 3]


def test_peer_uid_is_checked_even_if_permissions_are_loosened(holder: Holder) -> None:
    """Defense in depth: an admin chmods the socket open; the SO_PEERCRED check still refuses."""
    holder.socket.parent.chmod(0o755)
    holder.socket.chmod(0o666)
    out = _probe_as_nobody(holder)
    assert "permission denied: root only" in out and "lock: busy" in out
    assert holder.state()["released"] == {} and held_by_holder(holder) == [0, 1, 2, 3]
    assert "refused a connection from uid 65534" in holder.log_path.read_text()


def test_oversized_request_is_refused_and_the_holder_keeps_its_gpus(holder: Holder) -> None:
    import socket

    from launch.keepalive.protocol import MAX_MESSAGE_BYTES, decode, read_line

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(10)
        sock.connect(str(holder.socket))
        try:
            sock.sendall(b"x" * (MAX_MESSAGE_BYTES + 10))  # no newline: only the bound ends the read
        except (BrokenPipeError, ConnectionResetError):
            pass  # the holder answered and closed first
        answer = decode(read_line(sock))
    assert answer["ok"] is False and f"longer than {MAX_MESSAGE_BYTES} bytes" in answer["error"]
    assert held_by_holder(holder) == [0, 1, 2, 3]
    assert holder.hook("prolog", "801", "0").returncode == 0 and held_by_holder(holder) == [1, 2, 3]


def test_read_line_stops_at_the_bound() -> None:
    import socket

    from launch.keepalive.protocol import MAX_MESSAGE_BYTES, MessageTooLong, read_line

    a, b = socket.socketpair()
    with a, b:
        a.sendall(b'{"op": "status"}\n')
        assert read_line(b) == b'{"op": "status"}\n'
        a.sendall(b"y" * (MAX_MESSAGE_BYTES + 1))
        with pytest.raises(MessageTooLong):
            read_line(b)


# ---- lifecycle ---------------------------------------------------------------------------------


def test_second_holder_on_same_socket_refuses(holder: Holder) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "launch", "keepalive", "run", "--devices-dir", str(holder.devices_dir),
         "--no-slurm", "--hold-timeout", "0.2"],
        env=holder.env(), capture_output=True, text=True, timeout=30)
    assert done.returncode == 2 and "another keepalive holder already listens" in done.stderr
    # the refused one leaves the running holder's socket and state alone
    assert holder.socket.exists() and holder.state()["pid"] == holder.proc.pid
    assert holder.hook("prolog", "701", "0").returncode == 0 and held_by_holder(holder) == [1, 2, 3]


def test_holder_as_ordinary_user_is_a_clean_error(world_dir: Path) -> None:
    make_standin_gpus(world_dir / "dev", 1)
    done = subprocess.run(
        [SYSTEM_PYTHON, "-m", "launch.keepalive.cli", "run", "--devices-dir", str(world_dir / "dev"),
         "--no-slurm", "--socket", str(world_dir / "ctl" / "sock")],
        env=base_env(), capture_output=True, text=True, timeout=30, user=NOBODY_UID, cwd="/")
    assert done.returncode == 2, done.stderr
    assert "cannot create the control socket" in done.stderr and "Traceback" not in done.stderr


def test_unit_and_hook_wrapper_text() -> None:
    from launch.keepalive.hooks import render_hook_wrapper
    from launch.keepalive.systemd import render_unit

    unit = render_unit("/opt/launch/venv/bin/python", "--mem-fraction 0.8")
    assert "ExecStart=/opt/launch/venv/bin/python -m launch.keepalive.cli run --mem-fraction 0.8" in unit
    assert "Before=slurmd.service" in unit and "Restart=always" in unit
    text = render_hook_wrapper("prolog", "/opt/v/bin/python", Path("/run/x y/s"), 10, None, None)
    assert "export LAUNCH_KEEPALIVE_SOCKET='/run/x y/s'" in text  # quoted for sh
    assert text.rstrip().endswith("exec /opt/v/bin/python -m launch.keepalive.cli prolog")


def test_sigterm_frees_everything_and_removes_socket_and_state(holder: Holder) -> None:
    assert holder.stop() == 0
    assert held_by_holder(holder) == []
    assert not holder.socket.exists() and not holder.state_path.exists()
    status = subprocess.run([sys.executable, "-m", "launch", "keepalive", "status"], env=holder.env(),
                            capture_output=True, text=True, timeout=30)
    assert status.returncode == 1 and "not running" in status.stdout


def test_generated_wrappers_work_with_slurmds_minimal_env(holder: Holder, world_dir: Path) -> None:
    hooks_dir = world_dir / "hooks"
    done = subprocess.run(
        [sys.executable, "-m", "launch", "keepalive", "hooks", "--dir", str(hooks_dir),
         "--socket", str(holder.socket), "--log", str(holder.hook_log), "--prolog-timeout", "7"],
        env=base_env(), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    prolog = hooks_dir / "prolog"
    assert os.access(prolog, os.X_OK) and "LAUNCH_KEEPALIVE_TIMEOUT=7" in prolog.read_text()
    minimal = {"SLURM_JOB_ID": "601", "SLURM_JOB_GPUS": "2", "PATH": "/usr/bin:/bin"}
    assert subprocess.run([str(prolog)], env=minimal, timeout=60).returncode == 0
    assert held_by_holder(holder) == [0, 1, 3]
    assert "ms after hook start" in holder.hook_log.read_text()
    assert subprocess.run([str(hooks_dir / "epilog")], env=minimal, timeout=60).returncode == 0
    assert held_by_holder(holder) == [0, 1, 2, 3]


# ---- reconcile with Slurm's view (in-process; the allocation source is a plain function) ----


def test_restart_does_not_grab_gpus_slurm_says_are_in_use(world_dir: Path) -> None:
    devices = make_standin_gpus(world_dir / "dev", 4)
    holders = {i: LockHolder(i, d) for i, d in enumerate(devices)}
    daemon = KeepaliveDaemon(holders, world_dir / "ctl" / "s", world_dir / "state.json",
                             query_allocations=lambda: {"77": [1, 2]}, reconcile_interval=0)
    daemon.start()
    server = threading.Thread(target=daemon.serve_forever, daemon=True)
    server.start()
    try:
        assert daemon.released == {"77": [1, 2]}
        assert [i for i, h in holders.items() if h.held] == [0, 3]
        answer = request(daemon.socket_path, {"op": "status"}, 5)  # root may use the socket
        assert answer["held"] == [0, 3] and answer["released"] == {"77": [1, 2]}
    finally:
        daemon.stop()
        server.join(timeout=5)
        daemon.shutdown()


def test_reconcile_reclaims_jobs_slurm_forgot_but_not_fresh_releases(world_dir: Path) -> None:
    devices = make_standin_gpus(world_dir / "dev", 4)
    holders = {i: LockHolder(i, d) for i, d in enumerate(devices)}
    active = {"81": [0], "82": [1]}
    daemon = KeepaliveDaemon(holders, world_dir / "ctl" / "s", world_dir / "state.json",
                             query_allocations=lambda: dict(active), reconcile_interval=0)
    daemon.start()
    try:
        assert daemon.released == {"81": [0], "82": [1]}
        del active["81"]  # job 81 ended and its epilog never reached the holder
        daemon.release("83", [2])  # a job whose prolog ran after... (see below)
        daemon._released_at["83"] = time.monotonic() + 60  # ...Slurm was asked
        daemon.reconcile()
        assert daemon.released == {"82": [1], "83": [2]}
        assert [i for i, h in holders.items() if h.held] == [0, 3]
    finally:
        daemon.shutdown()


def test_holder_leaves_a_world_writable_directory_alone(world_dir: Path) -> None:
    """A socket directly in a 1777 directory (like /tmp) is refused, one line, and the directory
    keeps its mode; a socket in a subdirectory the holder makes gets a private 0700 one, which
    it removes again on exit, while the 1777 directory above stays 1777."""
    shared = world_dir / "run"
    shared.mkdir()
    shared.chmod(0o1777)
    h = Holder(world_dir, gpus=1, extra_args=["--no-slurm", "--socket", str(shared / "control.sock")])
    h.start(wait=False)
    assert h.proc is not None and h.proc.wait(timeout=30) == 2
    err = h.log_path.read_text().strip()
    assert err.count("\n") == 0 and "refusing a control socket directly in" in err and "Traceback" not in err
    assert (shared.stat().st_mode & 0o7777) == 0o1777
    assert not (shared / "control.sock").exists() and h.state() is None

    with running_holder(world_dir, gpus=1, extra_args=["--no-slurm"]) as ok:  # socket in run/ctl/
        assert ok.socket.parent.parent == shared
        assert (ok.socket.parent.stat().st_mode & 0o777) == 0o700 and ok.socket.parent.stat().st_uid == 0
        assert (shared.stat().st_mode & 0o7777) == 0o1777
    assert not ok.socket.parent.exists()  # the directory it made, gone with it
    assert (shared.stat().st_mode & 0o7777) == 0o1777


def test_holder_never_replaces_a_file_at_its_socket_path(world_dir: Path) -> None:
    """Only a stale socket (or a link) at the socket path is removed: `--socket /etc/x` names
    someone's file, which stays as it was, and no GPU is held meanwhile."""
    devices = make_standin_gpus(world_dir / "dev", 1)
    victim = world_dir / "ctl" / "precious"
    victim.parent.mkdir(mode=0o700)
    victim.write_text("keep me\n")
    daemon = KeepaliveDaemon({0: LockHolder(0, devices[0])}, victim, world_dir / "state.json",
                             query_allocations=None, reconcile_interval=0)
    with pytest.raises(LaunchError, match="exists and is not a socket; refusing to replace it"):
        daemon.start()
    assert victim.read_text() == "keep me\n" and not daemon.started
    assert not devices[0].with_name("nvidia0.lock").exists()  # refused before any GPU was held
    assert not (world_dir / "state.json").exists()
