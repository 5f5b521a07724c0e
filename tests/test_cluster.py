"""The embedded cluster's configuration and argument checks, without starting daemons.

(The daemons themselves: tests/test_launch_slurm.py for one node, tests/test_two_node.py for
two.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch.cluster.embedded import ClusterConfig, EmbeddedCluster, render_template
from launch.errors import LaunchError

REPO = Path(__file__).resolve().parents[1]


def _render(tmp_path: Path, n: int) -> str:
    cluster = EmbeddedCluster(tmp_path / "c")
    nodes = [dict(name=f"node{i}", addr=f"127.0.0.{i + 1}", port=40000 + i, cpus=4, memory_mb=1000, gpus=2,
                  gpu_files=[f"/d/node{i}/nvidia0", f"/d/node{i}/nvidia1"]) for i in range(1, n + 1)]
    config = ClusterConfig(nodes=n, gpus=2, cpus=4, slurmd_timeout=12)
    cluster._render_configs(nodes, {"slurmctld": 1, "slurmdbd": 2, "mariadb": 3}, "pw", config)
    return cluster.slurm_conf.read_text() + (cluster.etc / "gres.conf").read_text()


def test_two_nodes_each_with_own_port_address_spool_and_gpus(tmp_path: Path) -> None:
    text = _render(tmp_path, 2)
    lines = text.splitlines()
    assert "NodeName=node1 NodeAddr=127.0.0.2 Port=40001 CPUs=4 RealMemory=1000 Gres=gpu:2 State=UNKNOWN" in lines
    assert "NodeName=node2 NodeAddr=127.0.0.3 Port=40002 CPUs=4 RealMemory=1000 Gres=gpu:2 State=UNKNOWN" in lines
    assert "NodeName=node2 Name=gpu File=/d/node2/nvidia0,/d/node2/nvidia1" in lines
    spool = next(ln for ln in lines if ln.startswith("SlurmdSpoolDir="))
    assert spool.endswith("/spool/d/%n")
    assert any(ln.startswith("SlurmdLogFile=") and ln.endswith("/slurmd-%n.log") for ln in lines)
    assert "SlurmdTimeout=12" in lines and any(ln.endswith(",cred_expire=12") for ln in lines)
    import grp

    # the user's own cluster: only the user's group runs jobs, no one else sees them
    group = grp.getgrgid(os.getgid()).gr_name
    assert f"PartitionName=debug Nodes=node1,node2 Default=YES MaxTime=INFINITE State=UP AllowGroups={group}" in lines
    assert "PrivateData=jobs,accounting,usage,users" in lines
    first_job = next(ln for ln in lines if ln.startswith("FirstJobId="))
    assert 100_000 <= int(first_job.split("=")[1]) < 1_000_000


def test_requeue_delay_is_cred_expire_and_leaves_the_node_timeout_alone(tmp_path: Path) -> None:
    """The tests' session cluster asks for a short requeue wait; Slurm's node timeout stays its own."""
    cluster = EmbeddedCluster(tmp_path / "c")
    node = dict(name="n", addr="127.0.0.1", port=40000, cpus=1, memory_mb=1000, gpus=0, gpu_files=[])
    for config, expire in ((ClusterConfig(requeue_delay=20), 20), (ClusterConfig(slurmd_timeout=12, requeue_delay=30), 30),
                           (ClusterConfig(), None)):
        cluster._render_configs([node], {"slurmctld": 1, "slurmdbd": 2, "mariadb": 3}, "pw", config)
        lines = cluster.slurm_conf.read_text().splitlines()
        auth = next(ln for ln in lines if ln.startswith("AuthInfo="))
        assert auth.endswith(f",cred_expire={expire}") if expire else "cred_expire" not in auth, (config, auth)
        assert any(ln.startswith("SlurmdTimeout=") for ln in lines) == bool(config.slurmd_timeout)


def test_one_node_keeps_the_plain_layout(tmp_path: Path) -> None:
    lines = _render(tmp_path, 1).splitlines()
    assert any(ln.startswith("SlurmdSpoolDir=") and ln.endswith("/spool/d") for ln in lines)
    assert any(ln.startswith("SlurmdLogFile=") and ln.endswith("/slurmd.log") for ln in lines)


def test_the_ansible_role_context_renders_without_the_embedded_keys() -> None:
    """The `slurm` role passes only its own keys: the embedded cluster's additions (per-node
    ports and files, node timeout, first job id) must be optional in the shared template."""
    context = dict(managed="m", cluster_name="c", controller_host="ctl", controller_addr="", slurmctld_port=6817,
                   slurmd_port=6818, slurm_user="slurm", munge_socket="", state_save_dir="/s", slurmd_spool_dir="/d",
                   run_dir="/r", log_dir="/l", slurmd_parameters="", proctrack_type="p", task_plugin="t",
                   scheduler_parameters="", slurmdbd_host="db", slurmdbd_port=6819, prolog="", epilog="",
                   partition="gpu", nodes=[dict(name="kpro6", addr="", cpus=64, memory_mb=1000, gpus=8, gpu_files="")])
    text = render_template("slurm.conf.j2", **context)
    assert "NodeName=kpro6 CPUs=64 RealMemory=1000 Gres=gpu:8 State=UNKNOWN" in text.splitlines()
    assert "SlurmdSpoolDir=/d\n" in text and "FirstJobId" not in text and "SlurmdTimeout" not in text


@pytest.mark.parametrize("kwargs, message", [
    ({"nodes": 0}, "--nodes must be a whole number >= 1"),
    ({"gpus": -1}, "--gpus must be a whole number >= 0"),
    ({"nodes": 10**20}, "at most 64 nodes"),
    ({"prolog": "/nonexistent/prolog"}, "--prolog /nonexistent/prolog: not an executable file"),
    ({"requeue_delay": 2}, "--requeue-delay must be a whole number >= 5"),
])
def test_bad_resources_are_refused_before_anything_starts(tmp_path: Path, kwargs: dict, message: str) -> None:
    cluster = EmbeddedCluster(tmp_path / "c")
    with pytest.raises(LaunchError, match=message.replace("*", r"\*")):
        cluster.up(**kwargs)
    assert not (tmp_path / "c").exists()


def test_cli_error_is_one_line(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "launch", "cluster", "up", "--nodes", "0", "--state-dir",
                          str(tmp_path / "c")], env={**os.environ, "PYTHONPATH": str(REPO)},
                         capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and out.stderr.strip().count("\n") == 0 and "Traceback" not in out.stderr
    assert "--nodes" in out.stderr and "must be between 1 and" in out.stderr


def test_down_with_an_unreadable_state_stops_the_clusters_processes_and_keeps_the_file(tmp_path: Path) -> None:
    """The state file that `status` and `up` refuse is never rewritten: `down` finds the
    cluster's processes by their marker (a real child here, as a daemon of `up` carries it),
    stops them and moves the file aside with its bytes intact."""
    from launch.cluster.embedded import MARKER_VAR

    cluster = EmbeddedCluster(tmp_path / "c")
    cluster.state_dir.mkdir()
    garbage = b'{"pids": {"slurmctld": \xff'
    cluster.state_file.write_bytes(garbage)
    daemon = subprocess.Popen(["sleep", "60"], env={**os.environ, MARKER_VAR: str(cluster.state_dir)})
    try:
        # Popen returns once exec began; the kernel fills /proc/PID/environ a moment later (a
        # loaded CI machine saw it empty), and a daemon of `up` has long been running by then.
        deadline = time.monotonic() + 30
        while not cluster._is_ours(daemon.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(LaunchError, match="unreadable cluster state"):
            cluster.status_text()
        stopped = cluster.down()
        assert stopped == [f"pid {daemon.pid}"]
        assert not cluster._marked_processes()  # `down` waited for it (and reaped its own child)
    finally:
        daemon.kill()
        daemon.wait()
    assert not cluster.state_file.exists()
    [aside] = cluster.state_dir.glob("cluster.json.unreadable-*")
    assert aside.read_bytes() == garbage
    assert cluster.read_state() is None  # a fresh `up` can start from here


@pytest.mark.slurm
def test_accounting_databases_initialised_at_once_all_succeed(tmp_path: Path) -> None:
    """The tiers start one cluster per xdist worker, together: their MariaDB bootstraps ran at
    the same moment and, sharing /tmp, collided on their temporary tables' file names (3 of 6
    aborted). Each has its own tmpdir now, and a datadir only once its bootstrap succeeded."""
    import shutil
    from concurrent.futures import ThreadPoolExecutor

    if not shutil.which("mariadb-install-db"):
        pytest.skip("mariadb-install-db is not installed")
    clusters = [EmbeddedCluster(tmp_path / f"c{i}") for i in range(6)]
    for cluster in clusters:
        (cluster.state_dir / "mysql").mkdir(parents=True)  # as _start_fresh leaves it
    with ThreadPoolExecutor(len(clusters)) as pool:
        errors = [f.exception() for f in [pool.submit(c._init_mariadb, lambda _m: None) for c in clusters]]
    assert errors == [None] * len(clusters), errors
    for cluster in clusters:
        assert (cluster.state_dir / "mysql" / "mysql" / "db.frm").exists()
        assert not (cluster.state_dir / "mysql.init").exists()
