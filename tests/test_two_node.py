"""Jobs across two nodes of a real `launch cluster up --nodes 2`.

Real: two slurmd processes (`slurmd -N node1`, `-N node2`), each with its own port, spool and
loopback address (127.0.0.2, 127.0.0.3), one slurmctld, slurmdbd and MariaDB; `launch submit`
-> submitit -> sbatch -> srun across both nodes; the gloo rendezvous at the first node's
NodeAddr. Stand-in: both nodes are processes of this one machine, so a "node crash" is its
slurmd killed and everything it started frozen (SIGSTOP: no FIN, no RST, like a node that lost
power), and the node's reboot is those processes killed and its slurmd started again.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from launch.cluster.embedded import MARKER_VAR, NODE_VAR, EmbeddedCluster, node_daemon
from tests.conftest import JOB_FIXTURES, REPO, RUN_CWD, slurm_available
from tests.stage1_fixtures import make_data
from toolkit.metrics import logged_step_records

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

NODES = ("node1", "node2")
# Small enough for a shared 2-core CI machine: 1 CPU per task, 64-token rows, no vision tower.
STAGE1 = ["--preset", "tiny", "--no-preflight", "--cpus-per-task", "1", "--arg", "row_len=64",
          "--arg", "batch_rows=1", "--arg", "vision=off", "--arg", 'weights={"gen_txt": 1, "und": 1, "replay_text": 1}',
          "--arg", "num_workers=0", "--arg", "warmup=1"]


def launch(args: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "launch", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=RUN_CWD)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedCluster]:
    """`launch cluster up --nodes 2`: 2 stand-in GPUs and 4 CPUs per node; a silent node is DOWN
    after 12 s (Slurm's default is 300 s)."""
    reason = slurm_available()
    if reason:
        pytest.skip(reason)
    state = tmp_path_factory.mktemp("two-nodes")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("SLURM_CONF", None)
    up = launch(["cluster", "up", "--nodes", "2", "--gpus", "2", "--cpus", "4", "--slurmd-timeout", "12",
                 "--state-dir", str(state)], env)
    assert up.returncode == 0, up.stdout + up.stderr
    c = EmbeddedCluster(state)
    yield c
    down = launch(["cluster", "down", "--state-dir", str(state)], env)
    assert down.returncode == 0, down.stderr
    assert not _marked(state), "cluster down left processes behind"


@pytest.fixture()
def env(cluster: EmbeddedCluster, tmp_path: Path) -> dict[str, str]:
    out = {**os.environ, **cluster.env(), "LAUNCH_HOME": str(tmp_path / "home"), "LAUNCH_JOBS_PATH": str(JOB_FIXTURES),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(JOB_FIXTURES)])}
    return out


def _marked(state_dir: Path) -> list[int]:
    marker = f"{MARKER_VAR}={state_dir}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker in (entry / "environ").read_bytes().split(b"\0") \
                    and "State:\tZ" not in (entry / "status").read_text():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def submit(env: dict[str, str], job: str, *args: str) -> tuple[str, Path]:
    out = launch(["submit", job, *args], env)
    assert out.returncode == 0, out.stdout + out.stderr
    first = out.stdout.splitlines()[0]
    assert first.startswith(f"submitted {job}"), out.stdout
    job_id = first.split()[-1]
    return job_id, Path(env["LAUNCH_HOME"]) / "runs" / job / job_id


def slurm_state(job: str, env: dict[str, str]) -> str:
    q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True, timeout=30)
    if q.returncode == 0 and q.stdout.strip():
        return q.stdout.split()[0]
    a = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "State"], env=env, capture_output=True,
                       text=True, timeout=30)
    lines = a.stdout.split()
    return lines[-1] if lines else "UNKNOWN"


def wait_state(job: str, env: dict[str, str], states: set[str], timeout: float = 420) -> str:
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline:
        seen = slurm_state(job, env)
        if seen in states:
            return seen
        time.sleep(0.5)
    raise AssertionError(f"job {job} never reached {states}; last state {seen!r}")


def task_logs(job_dir: Path, job: str) -> list[str]:
    return [(job_dir / f"{job}_{task}_log.out").read_text() for task in (0, 1)]


def job_nodes(job: str, env: dict[str, str]) -> str:
    a = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "NodeList"], env=env, capture_output=True,
                       text=True, timeout=30)
    return a.stdout.split()[-1]


# ---- the cluster itself ----------------------------------------------------------------------


def test_status_lists_both_nodes_and_up_refuses_other_resources(cluster: EmbeddedCluster) -> None:
    cli_env = {**os.environ, "PYTHONPATH": str(REPO)}
    status = launch(["cluster", "status", "--state-dir", str(cluster.state_dir)], cli_env)
    assert status.returncode == 0, status.stdout + status.stderr
    for i, node in enumerate(NODES):
        assert f"{node_daemon(node)}" in status.stdout
        assert f"127.0.0.{i + 2}:" in status.stdout
    assert [ln.split()[:3] for ln in status.stdout.splitlines() if ln.startswith(NODES)][:2] == \
        [["node1", "debug*", "idle"], ["node2", "debug*", "idle"]]
    assert status.stdout.count(" running") == 6  # mariadb munged slurmdbd slurmctld 2x slurmd
    as_json = launch(["cluster", "status", "--json", "--state-dir", str(cluster.state_dir)], cli_env)
    assert as_json.returncode == 0, as_json.stdout + as_json.stderr
    parsed = json.loads(as_json.stdout)
    assert parsed["up"] and [d["running"] for d in parsed["daemons"]] == [True] * 6
    assert [(n["name"], n["addr"], n["state"]) for n in parsed["nodes"]] == \
        [("node1", "127.0.0.2", "idle"), ("node2", "127.0.0.3", "idle")]

    pids = cluster.running_daemons()
    other = launch(["cluster", "up", "--gpus", "3", "--state-dir", str(cluster.state_dir)], cli_env)
    assert other.returncode != 0 and other.stderr.strip().count("\n") == 0, other.stderr
    assert "is up with 2 nodes x (2 GPUs, 4 CPUs)" in other.stderr and "not --gpus 3" in other.stderr
    assert "launch cluster down" in other.stderr and "--nodes 2 --gpus 3 --cpus 4" in other.stderr
    same = launch(["cluster", "up", "--nodes", "2", "--state-dir", str(cluster.state_dir)], cli_env)
    assert same.returncode == 0 and "nothing changed" in same.stdout
    assert cluster.running_daemons() == pids


def test_both_nodes_daemons_are_reachable_from_this_machine_only(cluster: EmbeddedCluster) -> None:
    """Each slurmd listens on its own NodeAddr (127.0.0.2, 127.0.0.3), the rest on 127.0.0.1;
    a neighbour one veth hop away is refused on every port (tests/netprobe.py)."""
    from tests.netprobe import assert_reachable_from_this_machine_only, listening

    pids = cluster.running_daemons()
    pids.pop("munged")  # a unix socket only
    assert_reachable_from_this_machine_only(pids)
    for node in cluster.nodes():
        assert listening(pids[node_daemon(node["name"])]) == [(node["addr"], node["port"])]


# ---- jobs across the two nodes ---------------------------------------------------------------


def test_stage1_on_two_nodes_matches_two_ranks_on_one(env: dict[str, str], tmp_path: Path) -> None:
    """1 task on each of 2 nodes vs 2 tasks on 1 node, same data and seed: the same loss at every
    step (the ranks see the same batches; only where they run differs)."""
    data = make_data(tmp_path)
    common = [*STAGE1, "--arg", "steps=3", "--arg", "ckpt_every=0", "--arg", f"data_dir={data}"]
    across, across_dir = submit(env, "stage1", *common, "--nodes", "2", "--gpus-per-node", "0")
    local, local_dir = submit(env, "stage1", *common, "--nodes", "1", "--gpus-per-node", "2")
    for job, job_dir in ((across, across_dir), (local, local_dir)):
        state = wait_state(job, env, {"COMPLETED", "FAILED", "CANCELLED"})
        assert state == "COMPLETED", "\n".join(task_logs(job_dir, job)) + launch(["logs", job], env).stdout[-3000:]
    assert job_nodes(across, env) == "node[1-2]" and job_nodes(local, env) in NODES
    logs = task_logs(across_dir, across)
    assert "node=0(2), global_rank=0(2)" in logs[0] and "node=1(2), global_rank=1(2)" in logs[1]
    assert "world=2" in logs[0]

    two_nodes, one_node = logged_step_records(across_dir / "metrics.jsonl"), logged_step_records(local_dir / "metrics.jsonl")
    assert [r["step"] for r in two_nodes] == [r["step"] for r in one_node] == [1, 2, 3]
    for a, b in zip(two_nodes, one_node, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=1e-6), (a, b)
    assert two_nodes[-1]["loss"] < two_nodes[0]["loss"]


def test_extraction_over_two_nodes_writes_each_sample_once(env: dict[str, str]) -> None:
    from train.extract.shards import read_index, read_shard

    job, job_dir = submit(env, "extract", "--preset", "tiny", "--nodes", "2", "--gpus-per-node", "0",
                          "--cpus-per-task", "1", "--no-preflight", "--arg", "synthetic_samples=24")
    state = wait_state(job, env, {"COMPLETED", "FAILED", "CANCELLED"})
    assert state == "COMPLETED", "\n".join(task_logs(job_dir, job))
    assert job_nodes(job, env) == "node[1-2]"
    logs = task_logs(job_dir, job)
    assert "node=0(2)" in logs[0] and "node=1(2)" in logs[1]
    # each rank indexed its own shards, and together they hold every sample exactly once
    assert (job_dir / "index.00000.json").is_file() and (job_dir / "index.00001.json").is_file()
    indexed = sorted(i for entry in read_index(job_dir).values() for i in entry.samples)
    assert indexed == list(range(24))
    stored = sorted(i for p in job_dir.glob("shard_*.safetensors") for i in read_shard(p))
    assert stored == list(range(24))


def test_online_dflash_targets_on_one_node_drafter_on_the_other(env: dict[str, str]) -> None:
    job, job_dir = submit(env, "dflash", "--preset", "tiny-online", "--nodes", "2", "--gpus-per-node", "0",
                          "--cpus-per-task", "1", "--no-preflight", "--arg", "topology=1-1", "--arg", "steps=4",
                          "--arg", "synthetic_samples=16")
    state = wait_state(job, env, {"COMPLETED", "FAILED", "CANCELLED"})
    logs = task_logs(job_dir, job)
    assert state == "COMPLETED", "\n".join(logs)
    assert job_nodes(job, env) == "node[1-2]"
    # rank 0, the target, on node 1; rank 1, the drafter, on node 2, training on what rank 0 sent
    assert "node=0(2), global_rank=0(2)" in logs[0] and "target rank 0: sent 4 batches" in logs[0]
    assert "node=1(2), global_rank=1(2)" in logs[1] and "mode=online topology=1-1" in "\n".join(logs)
    assert json.loads((job_dir / "summary.json").read_text())["steps"] == 4


def test_doctor_on_cluster_runs_on_both_nodes(env: dict[str, str], tmp_path: Path) -> None:
    spec = tmp_path / "cpujob.yaml"
    spec.write_text(json.dumps({"name": "cpujob", "entrypoint": "train.stage1",
                                "resources": {"gpus_per_node": 0, "cpus_per_task": 1, "time": "00:05:00"}}))
    doctor_env = {**env, "LAUNCH_KEEPALIVE_STATE": str(tmp_path / "no-keepalive" / "state.json")}
    out = launch(["doctor", "--on-cluster", "--nodes", "2", "--job", str(spec), "--json"], doctor_env, timeout=300)
    assert "Traceback" not in out.stderr, out.stderr
    rows = {r["check"]: r for r in json.loads(out.stdout)["checks"]}
    for node in NODES:  # every check ran on each node, inside the allocation
        assert rows[f"{node}: slurm.context"]["status"] == "PASS", rows
    assert {name.split(":")[0] for name in rows} == set(NODES)
    assert out.returncode == 0, out.stdout


# ---- failures across nodes -------------------------------------------------------------------


def _tree(roots: set[int]) -> set[int]:
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    tree = set(roots)
    grew = True
    while grew:
        grew = False
        for pid, parent in parents.items():
            if parent in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return tree


def crash_node(cluster: EmbeddedCluster, node: str) -> set[int]:
    """The node dies: its slurmd is killed and everything it started (slurmstepd and the job's
    tasks) stops answering. Returns the frozen pids; killing them is the node's reboot."""
    slurmd = cluster.running_daemons()[node_daemon(node)]
    mark = f"{NODE_VAR}={node}".encode()
    steps_of_node = set()
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int(entry.name) != slurmd and \
                    mark in (entry / "environ").read_bytes().split(b"\0"):
                steps_of_node.add(int(entry.name))
        except OSError:
            continue
    frozen = _tree(steps_of_node) - {slurmd}
    os.kill(slurmd, signal.SIGKILL)
    for pid in frozen:
        os.kill(pid, signal.SIGSTOP)
    return frozen


def test_node_death_ends_the_run_and_the_requeue_resumes_from_its_checkpoint(
        cluster: EmbeddedCluster, env: dict[str, str], tmp_path: Path) -> None:
    data = make_data(tmp_path)
    job, job_dir = submit(env, "stage1", *STAGE1, "--nodes", "2", "--gpus-per-node", "0",
                          "--arg", "steps=8", "--arg", "ckpt_every=2", "--arg", f"data_dir={data}")
    first_ckpt = job_dir / "checkpoints" / "step_00000002"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (first_ckpt / "MANIFEST.json").exists():
        assert slurm_state(job, env) in ("PENDING", "RUNNING", "CONFIGURING"), "\n".join(task_logs(job_dir, job))
        time.sleep(0.2)
    assert (first_ckpt / "MANIFEST.json").exists(), "\n".join(task_logs(job_dir, job))
    frozen = crash_node(cluster, "node2")
    try:
        # Slurm notices the silent node, ends the run (NODE_FAIL) and requeues the job.
        deadline = time.monotonic() + 120
        runs: list[str] = []
        while time.monotonic() < deadline:
            a = subprocess.run(["sacct", "-j", job, "-D", "-X", "-n", "-P", "-o", "State"], env=env,
                               capture_output=True, text=True, timeout=30)
            runs = a.stdout.split()
            if runs[:1] == ["NODE_FAIL"] and len(runs) == 2:
                break
            time.sleep(1)
        assert runs[:1] == ["NODE_FAIL"], runs
        status = launch(["status", job], env)
        why = "requeued after run 1 ended NODE_FAIL (node2 stopped responding)"
        assert [ln.strip() for ln in status.stdout.splitlines() if "requeued" in ln] == [why], status.stdout
        assert "Traceback" not in status.stdout + status.stderr
    finally:
        for pid in frozen:  # the node reboots: nothing of the old run survives on it
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    cli_env = {**os.environ, "PYTHONPATH": str(REPO)}
    up = launch(["cluster", "up", "--state-dir", str(cluster.state_dir)], cli_env)
    assert up.returncode == 0, up.stdout + up.stderr
    assert "restarting slurmd:node2 " in up.stdout

    state = wait_state(job, env, {"COMPLETED", "FAILED", "CANCELLED"})
    log = "\n".join(task_logs(job_dir, job))
    assert state == "COMPLETED", log
    assert "# resumed from" in log
    events = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    headers = [e for e in events if e["event"] == "header"]
    assert len(headers) == 2 and headers[1]["start_step"] >= 2
    assert sorted({r["step"] for r in logged_step_records(job_dir / "metrics.jsonl")}) == list(range(1, 9))


def test_slurmctld_killed_mid_job_then_up_and_the_job_completes(
        cluster: EmbeddedCluster, env: dict[str, str]) -> None:
    """`cluster up` restarts only the dead slurmctld, with the first `up`'s configuration; both
    slurmds and the job's steps on them are left alone, so the job completes."""
    job, job_dir = submit(env, "fixture", "--preset", "slow", "--arg", "sleep=10", "--nodes", "2")
    wait_state(job, env, {"RUNNING"}, timeout=60)
    # slurmctld saves its state a few seconds after a change; what it never saved is lost to
    # any slurmctld crash, so wait until the running job is on disk
    job_state = cluster.state_dir / "spool" / "ctld" / "job_state"
    started, deadline = time.time(), time.monotonic() + 30
    while job_state.stat().st_mtime < started and time.monotonic() < deadline:
        time.sleep(0.2)
    before = cluster.running_daemons()
    conf = cluster.slurm_conf.read_bytes()
    os.kill(before["slurmctld"], signal.SIGKILL)
    up = launch(["cluster", "up", "--state-dir", str(cluster.state_dir)], {**os.environ, "PYTHONPATH": str(REPO)})
    assert up.returncode == 0, up.stdout + up.stderr
    assert "restarting slurmctld " in up.stdout
    # the first up's configuration, stand-in GPUs included, though this up named none of it
    assert cluster.slurm_conf.read_bytes() == conf
    gres = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %G"], env=env, capture_output=True, text=True, timeout=30)
    assert sorted(gres.stdout.split("\n")[:2]) == ["node1 gpu:2", "node2 gpu:2"], gres.stdout
    after = cluster.running_daemons()
    assert after["slurmctld"] != before["slurmctld"]
    assert {k: v for k, v in after.items() if k != "slurmctld"} == {k: v for k, v in before.items() if k != "slurmctld"}
    assert wait_state(job, env, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=120) == "COMPLETED"
    sacct = subprocess.run(["sacct", "-j", job, "-X", "-n", "-P", "-o", "State,NodeList"], env=env,
                           capture_output=True, text=True, timeout=30)
    assert sacct.stdout.split() == ["COMPLETED|node[1-2]"]
    assert "fixture done" in task_logs(job_dir, job)[0]
