"""Baked kernel caches (toolkit/kernel_cache.py): the key, the archive, the once-per-node unpack.

Real files, real tar/gzip, real flock, and 8 real processes racing to unpack one archive (what 8
ranks of a job do at start). The GPU parts of the key read `cpu` here; the GPU key is exercised
with explicit fields.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import stat
from pathlib import Path

import pytest

from toolkit import kernel_cache as kc


def _fake_caches(root: Path, n: int = 40) -> dict[str, Path]:
    """Triton/TileLang/Inductor/CUTLASS-DSL-like trees: nested hash dirs with binary and text files."""
    dirs = {name: root / name for name in kc.CACHES}
    for i in range(n):
        (dirs["triton"] / f"{i:04x}abcd").mkdir(parents=True)
        (dirs["triton"] / f"{i:04x}abcd" / "kernel.cubin").write_bytes(os.urandom(2048))
        (dirs["triton"] / f"{i:04x}abcd" / "kernel.json").write_text(json.dumps({"i": i}))
    (dirs["tilelang"] / "kernels" / "k1").mkdir(parents=True)
    (dirs["tilelang"] / "kernels" / "k1" / "lib.so").write_bytes(os.urandom(4096))
    (dirs["inductor"] / "fxgraph" / "ab").mkdir(parents=True)
    (dirs["inductor"] / "fxgraph" / "ab" / "entry").write_bytes(b"graph")
    dirs["cute_dsl"].mkdir(parents=True)
    (dirs["cute_dsl"] / "0f3a.mlirbc").write_bytes(os.urandom(1024))
    (dirs["triton"] / "x.lock").write_text("")  # a lock file is not packed
    return dirs


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.name.startswith(".kernel-archive-") and not p.name.endswith(".lock")}


def test_key_reads_cpu_here_and_changes_with_any_version():
    fields = kc.key_fields()
    assert (fields["gpu_arch"], fields["driver"], fields["cuda"]) == ("cpu", "cpu", "cpu")
    assert fields["packages"]["torch"] != "-" and set(kc.KERNEL_PACKAGES) == set(fields["packages"])
    key = kc.archive_key(fields)
    assert key.startswith("cpu-cpu-") and key == kc.archive_key(kc.key_fields())
    h200 = kc.key_fields(gpu_arch="sm_90", driver="580.95.05", cuda="13.0", packages={"tilelang": "0.1.15"})
    assert kc.archive_key(h200).startswith("sm_90-cuda13.0-")
    for change in ({"driver": "580.95.06"}, {"cuda": "12.8"}, {"gpu_arch": "sm_100"},
                   {"packages": {"tilelang": "0.1.16"}}):
        assert kc.archive_key({**h200, **change}) != kc.archive_key(h200), change


def test_pack_is_reproducible_and_unpack_seeds_the_job_caches(tmp_path: Path):
    caches = _fake_caches(tmp_path / "baked")
    fields = kc.key_fields(gpu_arch="sm_90", driver="580", cuda="13.0", packages={"tilelang": "0.1.15"})
    store = tmp_path / "store"
    first = kc.pack(store, fields, caches, note="preset qwen35-2b")
    second = kc.pack(store, fields, caches)
    assert first["sha256"] == second["sha256"] and first["archive"] == f"{first['sha256']}.tar.gz"
    assert first["files"] == {"cute_dsl": 1, "inductor": 1, "tilelang": 1, "triton": 80}
    assert [m["key"] for m in kc.manifests(store)] == [first["key"]]

    job = {name: tmp_path / "job" / name for name in kc.CACHES}
    job["triton"].mkdir(parents=True)
    (job["triton"] / "0000abcd").mkdir()
    (job["triton"] / "0000abcd" / "kernel.json").write_text("the job's own")  # never overwritten
    got = kc.unpack(store, first["key"], tmp_path / "node", job)
    assert got.state == "unpacked" and got.files == 83
    assert got.seeded == {"triton": 79, "tilelang": 1, "inductor": 1, "cute_dsl": 1}
    tree = tmp_path / "node" / first["key"]
    for name in kc.CACHES:
        assert _files(tree / name) == _files(caches[name])
        assert stat.S_IMODE((tree / name).stat().st_mode) == kc.READONLY_DIR
    cubin = tree / "triton" / "0001abcd" / "kernel.cubin"
    assert stat.S_IMODE(cubin.stat().st_mode) == kc.READONLY_FILE
    assert (job["triton"] / "0001abcd" / "kernel.cubin").stat().st_ino == cubin.stat().st_ino  # a link, not a copy
    assert (job["triton"] / "0000abcd" / "kernel.json").read_text() == "the job's own"
    again = kc.unpack(store, first["key"], tmp_path / "node", job)
    assert again.state == "present" and again.seeded == {}  # once per node, once per cache directory
    assert kc.count_entries(job) == {"triton": 80, "tilelang": 1, "inductor": 1, "cute_dsl": 1}
    assert "no baked archive" in kc.unpack(store, "sm_90-cuda13.0-0000", tmp_path / "node", job).line(store)


def test_a_corrupt_archive_is_refused_and_leaves_nothing(tmp_path: Path):
    fields = kc.key_fields(gpu_arch="sm_90", driver="580", cuda="13.0", packages={})
    manifest = kc.pack(tmp_path / "store", fields, _fake_caches(tmp_path / "baked", n=3))
    archive = tmp_path / "store" / manifest["archive"]
    archive.write_bytes(archive.read_bytes()[:-100] + b"x" * 100)
    job = {name: tmp_path / "job" / name for name in kc.CACHES}
    with pytest.raises(kc.ArchiveError, match="sha256"):
        kc.unpack(tmp_path / "store", manifest["key"], tmp_path / "node", job)
    assert [p.name for p in (tmp_path / "node").iterdir()] == [f".{manifest['key']}.lock"]
    assert not (tmp_path / "job").exists()


def _rank(store: str, key: str, node: str, job: str, start, queue) -> None:
    start.wait()
    dirs = {name: Path(job) / name for name in kc.CACHES}
    got = kc.unpack(Path(store), key, Path(node), dirs)
    queue.put((got.state, sum(got.seeded.values())))


def test_eight_processes_starting_together_share_one_unpack(tmp_path: Path):
    manifest = kc.pack(tmp_path / "store", kc.key_fields(), _fake_caches(tmp_path / "baked", n=300))
    ctx = multiprocessing.get_context("fork")
    start, queue = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(str(tmp_path / "store"), manifest["key"], str(tmp_path / "node"),
                                             str(tmp_path / "job"), start, queue)) for _ in range(8)]
    for p in procs:
        p.start()
    start.set()
    results = [queue.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    states = sorted(state for state, _ in results)
    assert states == ["present"] * 7 + ["unpacked"]
    assert sum(n for _, n in results) == 603  # every file linked once, by one process
    node = tmp_path / "node"
    assert sorted(p.name for p in node.iterdir()) == sorted([manifest["key"], f".{manifest['key']}.lock"])  # no temp tree
    for name in kc.CACHES:
        assert _files(tmp_path / "job" / name) == _files(tmp_path / "baked" / name)


# --------------------------------------------------------------------------- the launcher and the trainer


@pytest.fixture
def job_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """A job's environment as `launch`'s sbatch script sets it: per-job caches, the store, node scratch."""
    paths = {"store": tmp_path / "store", "node": tmp_path / "node", "job": tmp_path / "job"}
    monkeypatch.setenv("LAUNCH_KERNEL_ARCHIVES", str(paths["store"]))
    monkeypatch.setenv("LAUNCH_NODE_SCRATCH", str(paths["node"]))
    monkeypatch.setenv("LAUNCH_HOME", str(tmp_path / "home"))
    for name, var in kc.CACHES.items():
        monkeypatch.setenv(var, str(paths["job"] / name))
    # The job start under test writes LAUNCH_KERNEL_ARCHIVE into os.environ itself: a setenv first
    # makes monkeypatch remember it as unset, so it is removed again after the test (a later
    # in-process trainer would otherwise read this test's archive state).
    monkeypatch.setenv("LAUNCH_KERNEL_ARCHIVE", "")
    monkeypatch.delenv("LAUNCH_KERNEL_ARCHIVE")
    return paths


@pytest.mark.parametrize(("job", "preset", "want"), [
    ("stage1", "tiny", "--steps 3 --ckpt-every 0 --export off"),
    ("dflash", "online-6-1", "--steps 3"),
    ("extract", "tiny", "--stop-after 2"),
])
def test_launch_kernels_bake_takes_each_jobs_own_short_run(job_env, capsys, job, preset, want):
    """`launch kernels bake --job J`: each job spec's trainer gets arguments it knows (a short run,
    no checkpoint or export where it has them), and the bake variable; a dry run submits nothing."""
    from launch.cli import main

    assert main(["kernels", "bake", "--job", job, "--preset", preset, "--dry-run"]) == 0
    out = capsys.readouterr().out
    entry = next(line for line in out.splitlines() if line.startswith("# entrypoint:"))
    assert entry.endswith(want) and f"LAUNCH_KERNEL_BAKE={job}:{preset}" in out


def test_launch_kernels_list_and_doctor_name_the_missing_and_the_baked_archive(job_env, tmp_path: Path, capsys):
    from launch.cli import main
    from launch.doctor.results import Status
    from launch.kernel_archive import doctor_check

    assert main(["kernels", "list"]) == 0
    out = capsys.readouterr().out
    key = kc.archive_key(kc.key_fields())
    assert f"this machine's key: {key} (no archive)" in out and "launch kernels bake --preset P" in out
    result = doctor_check(dict(os.environ), gpus=None)
    assert result.status is Status.WARN and key in result.found and "launch kernels bake" in result.fix

    kc.pack(job_env["store"], kc.key_fields(), _fake_caches(tmp_path / "baked", n=2), note="stage1:tiny")
    assert main(["kernels", "list"]) == 0
    out = capsys.readouterr().out
    assert f"* {key}" in out and "stage1:tiny" in out and "(no archive)" not in out
    assert doctor_check(dict(os.environ), gpus=None).status is Status.PASS
    assert main(["kernels"]) == 2 and "an action is needed" in capsys.readouterr().err


def test_a_job_start_unpacks_and_the_trainer_fails_a_compile_despite_the_archive(job_env, tmp_path: Path):
    from types import SimpleNamespace

    from launch.kernel_archive import install_for_job
    from train.common.fastpath import FastPathError
    from train.stage1.train import check_kernel_compiles

    logged: list[str] = []
    assert install_for_job(log=logged.append).startswith("absent cpu-cpu-")
    # a CPU node without an archive is the normal case: exported for the header, not in the job's log
    assert not logged and os.environ["LAUNCH_KERNEL_ARCHIVE"].startswith("absent ")
    assert "no baked archive" in os.environ["LAUNCH_KERNEL_ARCHIVE"]

    kc.pack(job_env["store"], kc.key_fields(), _fake_caches(tmp_path / "baked", n=2))
    assert install_for_job(log=logged.append).startswith("unpacked cpu-cpu-")
    assert _files(job_env["job"] / "triton") == _files(tmp_path / "baked" / "triton")
    assert install_for_job(log=logged.append).startswith("present cpu-cpu-")  # the job's next rank

    printed: list[str] = []
    rt = SimpleNamespace(step=1, print=printed.append)
    run = SimpleNamespace(cfg=SimpleNamespace(require_warm_kernels=False),
                          kernel_entries=kc.count_entries(kc.cache_dirs()))
    first = check_kernel_compiles(run, rt)
    assert first["kernel_compiles"] == {"triton": 0, "tilelang": 0, "inductor": 0, "cute_dsl": 0}
    assert 0 < first["since_start_s"] < 3600 and "after the process started" in printed[-1]
    assert not any("WARNING" in p for p in printed)
    (job_env["job"] / "triton" / "new0000").mkdir()
    (job_env["job"] / "triton" / "new0000" / "kernel.cubin").write_bytes(b"compiled at step 1")
    assert check_kernel_compiles(run, rt)["kernel_compiles"]["triton"] == 1
    assert "WARNING: the baked kernel archive (present cpu-cpu-" in printed[-1]
    run.cfg.require_warm_kernels = True
    with pytest.raises(FastPathError, match="1 kernel cache files were compiled"):
        check_kernel_compiles(run, rt)


@pytest.mark.slurm
@pytest.mark.slow
def test_a_bake_job_packs_the_caches_and_the_next_job_unpacks_them(slurm_cluster, tmp_path: Path):
    """`launch kernels bake --preset tiny` on real Slurm: the job's main task packs its caches into
    the store under this machine's key; the next stage-1 job unpacks it at start and its trainer's
    header names it."""
    from conftest import REPO, run_launch

    env = {**os.environ, **slurm_cluster.env(), "LAUNCH_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO),
           "LAUNCH_KERNEL_ARCHIVES": str(tmp_path / "store"), "LAUNCH_NODE_SCRATCH": str(tmp_path / "node")}
    env.pop("LAUNCH_JOBS_PATH", None)
    out = run_launch(["kernels", "bake", "--preset", "tiny", "--follow"], env, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    key = kc.archive_key(kc.key_fields())
    manifest = kc.find_manifest(tmp_path / "store", key)
    assert manifest is not None and manifest["note"] == "stage1:tiny", out.stdout[-2000:]
    assert (tmp_path / "store" / manifest["archive"]).is_file()
    listed = run_launch(["kernels", "list"], env)
    assert f"* {key}" in listed.stdout, listed.stdout

    out = run_launch(["submit", "stage1", "--preset", "tiny", "--arg", "steps=1", "--arg", "row_len=128",
                      "--arg", "batch_rows=1", "--arg", "synthetic_samples=60", "--json"], env)
    assert out.returncode == 0, out.stderr
    job = json.loads(out.stdout)
    from conftest import wait_for_state

    assert wait_for_state(job["job_id"], env, {"COMPLETED", "FAILED"}, timeout=300) == "COMPLETED"
    log = Path(job["log"]).read_text()
    assert f"[launch] kernel archive: unpacked {key}" in log, log[-3000:]
    assert f"kernel_archive=unpacked {key}" in log


# ------------------------------------------------------------------ issue 47: edited and swapped archives
def test_a_rebake_under_the_same_key_is_unpacked_and_seeded_again(tmp_path: Path):
    """The store's manifest names archive B after a re-bake: the node's tree of archive A is not
    `present`; B is unpacked and a job's caches get B's files."""
    fields = kc.key_fields(gpu_arch="sm_90", driver="580", cuda="13.0", packages={})
    store, node = tmp_path / "store", tmp_path / "node"
    first = kc.pack(store, fields, _fake_caches(tmp_path / "a", n=2))
    assert kc.unpack(store, first["key"], node, {n: tmp_path / "job1" / n for n in kc.CACHES}).state == "unpacked"
    second = kc.pack(store, fields, _fake_caches(tmp_path / "b", n=3))
    assert second["key"] == first["key"] and second["sha256"] != first["sha256"]
    job = {n: tmp_path / "job2" / n for n in kc.CACHES}
    got = kc.unpack(store, second["key"], node, job)
    assert got.state == "unpacked" and (node / second["key"] / ".complete").read_text().strip() == second["sha256"]
    assert _files(job["triton"]) == _files(tmp_path / "b" / "triton")
    again = kc.unpack(store, second["key"], node, job)
    assert again.state == "present" and again.seeded == {}


def test_a_tar_bomb_is_refused_before_anything_is_written(tmp_path: Path):
    """A small archive whose one file unpacks to far more than its manifest allows (or holding
    more files than it says): refused from the tar headers, nothing left on the node."""
    big = tmp_path / "bomb" / "triton"
    big.mkdir(parents=True)
    with open(big / "zeros", "wb") as f:
        f.truncate(16 << 20)  # 16 MiB of zeros: about 16 KiB gzipped
    fields = kc.key_fields(gpu_arch="sm_90", driver="580", cuda="13.0", packages={})
    store, node = tmp_path / "store", tmp_path / "node"
    manifest = kc.pack(store, fields, {"triton": big})
    path = store / f"{manifest['key']}.json"
    for edit, why in (({"unpacked": 1 << 20}, r"unpacks to 16\.0 MiB, more than the 1\.0 MiB its manifest allows"),
                      ({"unpacked": None}, r"unpacks to 16\.0 MiB, more than the \d+\.\d MiB its manifest allows"),
                      ({"files": {"triton": 0}}, r"holds 1 files, its manifest says 0")):
        data = {**manifest, **edit}
        data = {k: v for k, v in data.items() if v is not None}
        path.write_text(json.dumps(data))
        with pytest.raises(kc.ArchiveError, match=why):
            kc.unpack(store, manifest["key"], node, {"triton": tmp_path / "job"})
        assert [p.name for p in node.iterdir()] == [f".{manifest['key']}.lock"]


def test_a_broken_manifest_never_fails_the_job_start(tmp_path: Path, monkeypatch):
    """files a list, counts not integers, archive not a string, a FIFO: the job's start says one
    line (error <key>: <the manifest's problem>) and goes on, at once."""
    import signal

    from launch.kernel_archive import install_for_job

    store = tmp_path / "store"
    store.mkdir()
    key = kc.archive_key(kc.key_fields())
    env = {"LAUNCH_KERNEL_ARCHIVES": str(store), "LAUNCH_NODE_SCRATCH": str(tmp_path / "scratch"),
           **{var: str(tmp_path / "job" / name) for name, var in kc.CACHES.items()}}
    base = {"key": key, "archive": "a" * 64 + ".tar.gz", "sha256": "a" * 64, "bytes": 1, "files": {}, "created": 0}
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("the job start hung on the manifest"))
    for edit, why in (({"files": ["triton"]}, "'files' is not a mapping"), ({"files": {"triton": 1.5}}, "'files'"),
                      ({"archive": ["x"]}, "'archive' is not"), (None, "is not a regular file")):
        (store / f"{key}.json").unlink(missing_ok=True)
        if edit is None:
            os.mkfifo(store / f"{key}.json")
        else:
            (store / f"{key}.json").write_text(json.dumps({**base, **edit}))
        signal.alarm(20)
        try:
            line = install_for_job(env, log=lambda _: None)
        finally:
            signal.alarm(0)
        assert line.startswith(f"error {key}: kernel archive manifest") and why in line, line
        assert line.endswith("the kernels compile as without an archive") and "\n" not in line


def test_another_uids_store_node_tree_or_lock_link_is_refused(tmp_path: Path):
    """A second uid (65534) pre-creating the key's tree with a .complete marker, planting a symlink
    at the key's .lock, or owning a 1777 store: each refused in one line before use; nothing of
    theirs is seeded into the job's caches and the link's target is never created."""
    if os.geteuid() != 0:
        pytest.skip("needs root to make files of another uid")
    fields = kc.key_fields(gpu_arch="sm_90", driver="580", cuda="13.0", packages={})
    store = tmp_path / "store"
    manifest = kc.pack(store, fields, _fake_caches(tmp_path / "baked", n=1))
    key, job = manifest["key"], {n: tmp_path / "job" / n for n in kc.CACHES}

    node = tmp_path / "node1"
    (node / key / "triton").mkdir(parents=True)
    (node / key / "triton" / "evil.so").write_text("theirs")
    (node / key / ".complete").write_text(manifest["sha256"] + "\n")
    for p in (node / key, node / key / "triton", node / key / "triton" / "evil.so", node / key / ".complete"):
        os.chown(p, 65534, 65534)
    with pytest.raises(kc.ArchiveError, match=rf"unpacked kernel archive \S+/{key} belongs to uid 65534, another user"):
        kc.unpack(store, key, node, job)
    assert not (tmp_path / "job").exists()

    node = tmp_path / "node2"
    node.mkdir()
    (node / f".{key}.lock").symlink_to(tmp_path / "target")
    with pytest.raises(kc.ArchiveError, match=r"lock \S+ cannot be opened .*a symbolic link there is not followed"):
        kc.unpack(store, key, node, job)
    assert not (tmp_path / "target").exists() and not (node / key).exists()

    os.chown(store, 65534, 65534)
    store.chmod(0o1777)
    with pytest.raises(kc.ArchiveError, match=r"kernel archive store \S+ belongs to uid 65534, another user"):
        kc.unpack(store, key, tmp_path / "node3", job)
    assert not (tmp_path / "job").exists()


# A process that compiles with Inductor (CPU: C++ kernels) a forward and its backward, after
# loading whatever torch cache artifacts its inductor cache holds; with `bake`, it then saves its
# artifacts and packs the caches as a bake job's end does. Prints what it loaded and its cache hits.
_COMPILE_AND_MAYBE_BAKE = r"""
import json, sys
from pathlib import Path
import torch
from toolkit import kernel_cache as kc
dirs = kc.cache_dirs()
loaded = kc.load_torch_artifacts(dirs)
f = torch.compile(lambda x, w: torch.nn.functional.gelu(x @ w).square().sum(), backend="inductor")
x, w = torch.randn(8, 16, requires_grad=True), torch.randn(16, 16, requires_grad=True)
f(x, w).backward()
if sys.argv[1] == "bake":
    kc.save_torch_artifacts(dirs)
    kc.pack(Path(sys.argv[2]), kc.key_fields(), dirs)
print(json.dumps({"loaded": loaded, "hits": kc.torch_cache_hits()}))
"""


@pytest.mark.slow  # two processes compiling with Inductor (C++ kernels): 245 s here under a load average of 20
def test_torch_artifacts_ride_in_the_archive_and_a_fresh_process_hits_its_caches(tmp_path: Path):
    """A bake saves torch's cache artifacts beside the compiled kernels; a fresh process whose
    caches hold only what the archive's unpack seeded, and of Inductor's cache only the artifact
    files, loads them before compiling, and its Inductor FX-graph and AOTAutograd lookups all hit."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]

    def run(mode: str, caches: Path) -> dict:
        env = {**os.environ, "PYTHONPATH": str(repo), "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
               "TRITON_CACHE_DIR": str(caches / "triton"), "TILELANG_CACHE_DIR": str(caches / "tilelang")}
        proc = subprocess.run([sys.executable, "-c", _COMPILE_AND_MAYBE_BAKE, mode, str(tmp_path / "store")],
                              env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])

    baked = run("bake", tmp_path / "bake")
    assert baked["loaded"] == {} and baked["hits"]["fxgraph_miss"] >= 2  # forward and backward compiled
    assert baked["hits"]["fxgraph_hit"] == 0

    fresh = tmp_path / "fresh"
    dirs = {name: fresh / name for name in kc.CACHES}
    (manifest,) = kc.manifests(tmp_path / "store")
    got = kc.unpack(tmp_path / "store", manifest["key"], tmp_path / "node", dirs)
    assert got.state == "unpacked"
    artifacts = sorted(p.name for p in kc.torch_artifacts_dir(dirs).glob("*.bin"))
    assert len(artifacts) == 1
    for path in sorted(dirs["inductor"].iterdir()):  # Inductor's own on-disk caches gone: the artifacts alone
        if path.name != kc.TORCH_ARTIFACTS and not path.name.startswith(".kernel-archive-"):
            kc._rmtree(path) if path.is_dir() else path.unlink()

    again = run("fresh", fresh)
    assert again["loaded"]["files"] == 1 and sum(v for k, v in again["loaded"].items() if k != "files") >= 2
    hits = again["hits"]
    assert hits["fxgraph_miss"] == 0 and hits["fxgraph_hit"] == baked["hits"]["fxgraph_miss"]
    assert hits["aot_autograd_miss"] == 0 and hits["aot_autograd_hit"] >= 1
