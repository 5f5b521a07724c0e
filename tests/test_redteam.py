"""Fixes for the red team's silent cases of issue 39 that are not a refusal (the refusals are
rows of the bad-input corpus, tests/badinputs/redteam_cases.py)."""

from __future__ import annotations

from pathlib import Path

JOB_FIXTURES = Path(__file__).with_name("jobfixtures")


def test_list_presets_shows_a_specs_terminal_escapes_escaped(tmp_path: Path, monkeypatch, capsys) -> None:
    from launch.cli import main

    monkeypatch.syspath_prepend(str(JOB_FIXTURES))
    monkeypatch.setenv("LAUNCH_HOME", str(tmp_path / "home"))
    spec = tmp_path / "job.yaml"
    spec.write_text('name: demo\nentrypoint: fixture_entry\nresources: {nodes: 1, gpus_per_node: 0, cpus_per_task: 1, '
                    'time: "00:05:00"}\npresets:\n  small: {description: "ok\\x1b]0;owned\\x07\\x1b[2J\\rgone", '
                    'args: {sleep: 0}}\n')
    assert main(["submit", str(spec), "--list-presets"]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "\r" not in out
    assert "ok\\x1b]0;owned\\x07\\x1b[2J\\rgone" in out


def test_make_wheelhouse_refuses_a_bad_python_or_a_missing_lock_in_one_line(tmp_path: Path, capsys) -> None:
    from images.make_wheelhouse import main

    for argv, said in ((["--python", "3", "--glibc", "2.39"], "python=3 is not a CPython version such as 3.12"),
                       (["--python", "3.12", "--glibc", "x"], "glibc=x is not a glibc version such as 2.39"),
                       (["--lock", str(tmp_path / "nope.lock"), "--out", str(tmp_path / "wh")],
                        f"lock={tmp_path / 'nope.lock'}: no such file")):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"make wheelhouse: {said}") and err.count("\n") == 1, err
    assert not (tmp_path / "wh").exists()


def test_install_kernels_refuses_bad_inputs_and_an_unhashed_pin_in_one_line(tmp_path: Path, capsys) -> None:
    """bench/install_kernels.py: a wheel of a bad name, a missing lock, a --json that is a
    directory, a lock pin without --hash (a wheel of that name and version with any bytes would be
    installed): one line each, exit 1, nothing installed."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("install_kernels", Path(__file__).resolve().parents[1] / "bench" / "install_kernels.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    lock, bad, good, target = tmp_path / "gpu.lock", tmp_path / "bad", tmp_path / "good", tmp_path / "target"
    lock.write_text("demo-pkg==1.0\n")
    bad.mkdir()
    (bad / "not-a-wheel.whl").write_bytes(b"PK")
    good.mkdir()
    (good / "demo_pkg-1.0-py3-none-any.whl").write_bytes(b"PK other bytes")
    (tmp_path / "out.json").mkdir()
    for argv, said in (
        (["--lock", str(lock), "--wheels", str(bad)], "not-a-wheel.whl: not a wheel's file name"),
        (["--lock", str(tmp_path / "nope.lock"), "--wheels", str(good)], f"--lock {tmp_path / 'nope.lock'}: no such file"),
        (["--lock", str(lock), "--check", "--json", str(tmp_path / "out.json")], f"--json {tmp_path / 'out.json'}: a directory"),
        (["--wheels", str(good)], "--lock is required"),
        (["--pythonpath"], f"--target {target}: not a directory"),
        (["--lock", str(lock), "--wheels", str(good)], "demo_pkg-1.0-py3-none-any.whl: gpu.lock pins demo-pkg==1.0 "
                                                       "without --hash=sha256:...")):
        assert mod.main([*argv, "--target", str(target)]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"install_kernels: {said}") and err.count("\n") == 1, err
    assert not target.exists()


def test_a_cache_or_scratch_dir_another_uid_made_is_refused_in_the_job(tmp_path: Path, monkeypatch) -> None:
    """TRITON_CACHE_DIR pre-made by another uid (its compiled kernels would run as the user) and a
    scratch under a world-writable, non-sticky directory: the job's setup refuses each in one line;
    the user's own directories pass."""
    import os

    import pytest

    from launch.errors import LaunchError
    from launch.runner import prepare_node_local_dirs

    for var in ("LAUNCH_SCRATCH", "TRITON_CACHE_DIR", "HF_HOME", "TORCHINDUCTOR_CACHE_DIR"):
        monkeypatch.delenv(var, raising=False)
    theirs = tmp_path / "triton"
    theirs.mkdir()
    os.chown(theirs, 65534, 65534)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(theirs))
    with pytest.raises(LaunchError, match=rf"TRITON_CACHE_DIR={theirs}: {theirs} belongs to uid 65534, another user; "
                                          "code cached there would run as you"):
        prepare_node_local_dirs()
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    monkeypatch.setenv("LAUNCH_SCRATCH", str(shared / "job"))
    with pytest.raises(LaunchError, match=r"LAUNCH_SCRATCH=\S+: \S*shared is writable by other users \(mode 777"):
        prepare_node_local_dirs()
    shared.chmod(0o1777)  # sticky, as /tmp: nobody else can rename the job's directory
    prepare_node_local_dirs()
    assert (shared / "job").is_dir() and (tmp_path / "mine").is_dir()


def test_the_rendezvous_store_listens_on_its_address_alone_and_hides_its_keys(monkeypatch) -> None:
    """Rank 0's TCPStore: its listening socket is on the given address (127.0.0.1 here), not on
    every address; a client without the job's token sees none of the job's keys."""
    import datetime
    import socket

    import torch.distributed as dist

    from train.common.distributed import rendezvous_store

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    monkeypatch.setenv("LAUNCH_RENDEZVOUS_TOKEN", "s3cret")
    store = rendezvous_store("127.0.0.1", port, 0, 1)
    store.set("rank0", "here")
    listening = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        if state == "0A" and int(local.split(":")[1], 16) == port:
            listening.append(local.split(":")[0])
    assert listening == ["0100007F"], listening  # 127.0.0.1, not 00000000 (every address)
    outsider = dist.TCPStore("127.0.0.1", port, 1, is_master=False, timeout=datetime.timedelta(seconds=5))
    assert not outsider.check(["rank0"])
    assert outsider.check(["job-s3cret/rank0"])  # the oracle: the key is there, under the secret prefix


def test_resume_takes_the_jobs_own_spec_not_the_one_its_run_folders_config_names(tmp_path: Path) -> None:
    """A run folder's config.yaml edited to name another entrypoint's spec (extract's): `launch
    resume` still takes the spec the job was submitted from (its registry record), or the spec of
    its name for a record from before specs were recorded."""
    from launch import runconfig
    from launch.registry import JobRecord
    from launch.resume import own_spec

    jobs = Path(__file__).resolve().parents[1] / "launch" / "jobs"
    run = tmp_path / "run"
    run.mkdir()
    runconfig.write(run, {"job": "extract", "spec": str(jobs / "extract.yaml"), "entrypoint": "train.extract"})
    rec = JobRecord(job_id="5", name="stage1", preset="tiny", folder=str(tmp_path / "5"), submitted_at=0.0,
                    slurm_conf=None, argv=[], run_dir=str(run), spec=str(jobs / "stage1.yaml"))
    assert own_spec(rec, run).entrypoint == "train.stage1"
    rec.spec = None  # a record from before specs were recorded
    assert own_spec(rec, run).entrypoint == "train.stage1"


RANK = """
import sys, torch, torch.distributed as dist
from train.common.distributed import init_distributed, shutdown_distributed
info = init_distributed(torch.device("cpu"))
t = torch.tensor([float(info.rank + 1)])
dist.all_reduce(t)
print("sum", int(t.item()), flush=True)
shutdown_distributed(info)
"""


def test_a_two_rank_jobs_rendezvous_is_a_private_file_no_port_another_uid_can_take(tmp_path: Path) -> None:
    """Two ranks of a `launch` job meet through a file store in the job's 0700 folder, named by
    the job's secret: a listener already on the port the rendezvous used to derive from the job
    id changes nothing (both ranks finish, at once), and a second uid (nobody) cannot open the
    store's file. Outside `launch` (no job folder, no MASTER_PORT) a 2-rank start is one line."""
    import os
    import socket
    import subprocess
    import sys

    import pytest

    from train.common.distributed import PORT_BASE, PORT_SPAN, RendezvousError, init_distributed

    job = tmp_path / "job"
    job.mkdir(mode=0o700)
    token = os.urandom(16).hex()
    squatter = socket.socket()
    try:
        squatter.bind(("127.0.0.1", PORT_BASE + 4242 % PORT_SPAN))
        squatter.listen(4)
    except OSError:
        pass  # the port is taken already: the same test, by someone else
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "MASTER_"))}
    env.update(PYTHONPATH=str(Path(__file__).resolve().parents[1]), SLURM_JOB_ID="4242", SLURM_NTASKS="2",
               SLURM_JOB_NODELIST="localhost", SLURM_JOB_NUM_NODES="1", LAUNCH_JOB_DIR=str(job),
               LAUNCH_RENDEZVOUS_TOKEN=token)
    try:
        procs = [subprocess.Popen([sys.executable, "-c", RANK], env={**env, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
        outputs = [p.communicate(timeout=180)[0] for p in procs]
    finally:
        squatter.close()
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert all("sum 3" in out for out in outputs), outputs
    store = job / f".rendezvous-{token}"
    if store.exists():  # torch removes it when the last rank lets go
        assert store.stat().st_mode & 0o077 == 0
    if os.geteuid() == 0:
        store.touch(mode=0o600)  # the file a running job holds
        other = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--", "cat", str(store)],
                               capture_output=True, text=True, timeout=30)
        assert other.returncode != 0 and "Permission denied" in other.stderr, other

    with pytest.MonkeyPatch.context() as mp:
        for key in [k for k in os.environ if k.startswith(("SLURM_", "MASTER_", "LAUNCH_"))]:
            mp.delenv(key)
        mp.setenv("SLURM_JOB_ID", "4242")
        mp.setenv("SLURM_NTASKS", "2")
        mp.setenv("SLURM_PROCID", "1")
        mp.setenv("SLURM_JOB_NODELIST", "localhost")
        with pytest.raises(RendezvousError, match=r"a 2-rank job outside `launch` has no private folder for its "
                                                  r"rendezvous"):
            init_distributed(torch_device_cpu())


def torch_device_cpu():  # noqa: ANN201 - torch imported late: collection stays light
    import torch

    return torch.device("cpu")
