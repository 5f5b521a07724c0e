"""`launch doctor`: every check in its PASS and its FAIL form.

The FAIL forms come from a really broken environment, not from patched results: a package on
PYTHONPATH whose import raises, a PATH with no C compiler, a cache on a read-only or full
tmpfs mounted in a private mount namespace, a mount table reporting nfs (the
LAUNCH_DOCTOR_MOUNTINFO seam: no NFS server here), Slurm variables that disagree, a lock the
installed versions do not meet.

Stand-ins, where this CPU machine cannot have the real thing (each test says so):
- `fla`: the real package needs Triton and a CUDA GPU to import, so the PASS form of the
  import check uses a package with fla's module layout (fla.ops.gated_delta_rule,
  fla.modules.convolution). The real fla is exercised on the H200 (bench/RESULTS.md).
- `nvidia-smi`: there is no NVIDIA driver here; a script on PATH answers the two queries the
  doctor makes, in nvidia-smi's CSV format, to test the foreign-process check.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from launch.doctor import fast_subset, run_checks
from launch.doctor.context import DoctorContext
from launch.doctor.fabric import fabric_manager_pids
from launch.doctor.gpus import check_gpus
from launch.doctor.results import Status
from launch.errors import LaunchError
from tests.conftest import RUN_CWD

REPO = Path(__file__).resolve().parents[1]
LIBZ3_ERROR = "libz3.so.4.15: cannot open shared object file: No such file or directory"


# ---------------------------------------------------------------- helpers
def clean_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    """This process's environment minus anything that would steer the checks, with caches in tmp."""
    drop = ("SLURM_", "CUDA_VISIBLE_DEVICES", "CC", "TRITON_", "HF_HOME", "TORCHINDUCTOR_", "LAUNCH_", "XDG_CACHE_HOME")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env.update({
        "PYTHONPATH": str(REPO),
        "TRITON_CACHE_DIR": str(tmp_path / "cache" / "triton"),
        "HF_HOME": str(tmp_path / "cache" / "hf"),
        "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "cache" / "inductor"),
        "LAUNCH_KEEPALIVE_STATE": str(tmp_path / "no-keepalive" / "state.json"),
        "LAUNCH_HOME": str(tmp_path / "launch-home"),
    })
    env.update(extra)
    return env


def by_check(results) -> dict:
    return {r.check: r for r in results}


def run_doctor_cli(args: list[str], env: dict[str, str], prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*(prefix or []), sys.executable, "-m", "launch", "doctor", *args],
                          env=env, capture_output=True, text=True, timeout=180, cwd=RUN_CWD)


def write_job(tmp_path: Path, gpus: int = 1, lock: dict[str, str] | None = None,
              args: dict[str, str] | None = None) -> Path:
    spec: dict = {"name": "doctorjob", "entrypoint": "train.stage1",
                  "resources": {"nodes": 1, "gpus_per_node": gpus, "cpus_per_task": 1, "time": "00:05:00"}}
    if lock is not None:
        spec["lock"] = lock
    if args is not None:
        spec["args"] = args
    path = tmp_path / "jobs" / "doctorjob.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(spec))  # JSON is YAML
    return path


def write_package(root: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(textwrap.dedent(text))
    return root


def said_in_cell(table: str, check: str, text: str, column: int = 2) -> bool:
    """`text` in a cell of the doctor's table. A long cell wraps at its width, between words or
    inside a path (whose length is the temporary directory's): its pieces are joined as they were
    cut and compared without whitespace, so the verdict is the same wherever the cut fell."""
    rows = table.splitlines()
    first = next(i for i, line in enumerate(rows) if line.startswith(check + " "))
    pieces = [rows[first], *itertools.takewhile(lambda ln: ln.startswith(" "), rows[first + 1:])]
    cell = "".join(line.split("|")[column] for line in pieces if line.count("|") > column)
    return re.sub(r"\s+", "", text) in re.sub(r"\s+", "", cell)


def broken_fla(tmp_path: Path) -> Path:
    """An `fla` whose import fails the way fla+tilelang did on the H200 without z3's library."""
    return write_package(tmp_path / "broken", {"fla/__init__.py": f"raise ImportError({LIBZ3_ERROR!r})\n"})


def standin_fla(tmp_path: Path) -> Path:
    """Stand-in with fla's module layout (the real fla needs Triton + CUDA to import)."""
    return write_package(tmp_path / "standin", {
        "fla/__init__.py": "",
        "fla/ops/__init__.py": "",
        "fla/ops/gated_delta_rule/__init__.py": "def chunk_gated_delta_rule(*a, **k): ...\n",
        "fla/modules/__init__.py": "",
        "fla/modules/convolution.py": "def causal_conv1d(*a, **k): ...\n",
    })


def real_mountinfo() -> str:
    return Path("/proc/self/mountinfo").read_text()


def can_unshare_mounts() -> bool:
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


needs_mount_ns = pytest.mark.skipif(not can_unshare_mounts(), reason="needs root and unshare -m (private mount namespace)")


def doctor_over_tmpfs(mount_dir: Path, options: str, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], dict]:
    """`launch doctor --json` in a private mount namespace, with a tmpfs (`options`) over mount_dir."""
    script = f"mount -t tmpfs -o {options} tmpfs {mount_dir} && exec \"$@\""
    out = run_doctor_cli(["--json"], env, prefix=["unshare", "-m", "sh", "-c", script, "sh"])
    return out, {r["check"]: r for r in json.loads(out.stdout)["checks"]}


# ---------------------------------------------------------------- kernels
def test_fla_import_error_shows_real_exception_and_fails_for_gpu_job(tmp_path):
    env = clean_env(tmp_path, PYTHONPATH=f"{broken_fla(tmp_path)}{os.pathsep}{REPO}")
    job = write_job(tmp_path, gpus=1)
    out = run_doctor_cli(["--job", str(job)], env)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stdout + out.stderr
    fla_row = next(line for line in out.stdout.splitlines() if line.startswith("kernels.fla"))
    assert "FAIL" in fla_row and "not installed" not in fla_row
    flat = " ".join(out.stdout.split())  # the table wraps long cells
    assert "ImportError: libz3.so.4.15: cannot open shared object file" in flat
    assert said_in_cell(out.stdout, "kernels.fla", "fla/__init__.py:1)")  # where it was raised


@pytest.mark.parametrize("exit_call", ["os._exit(0)", "sys.exit(0)"])
def test_an_fla_whose_import_ends_the_process_is_named_in_the_rows(tmp_path, exit_call):
    """`import fla` that ends the interpreter with status 0: the rows say the probe exited while
    importing fla, not a bare "not checked"."""
    fla = write_package(tmp_path / "exits", {"fla/__init__.py": f"import os, sys\n{exit_call}\n"})
    res = by_check(run_checks(str(write_job(tmp_path, gpus=1)), clean_env(tmp_path, PYTHONPATH=f"{fla}{os.pathsep}{REPO}")))
    assert res["kernels.fla"].status is Status.FAIL
    found = res["kernels.fla"].found
    assert "not checked" not in found and "fla" in found, found
    assert "exited while importing fla" in found or "SystemExit: 0" in found, found


def test_the_kernel_probe_never_imports_from_the_working_directory(tmp_path, planted_cwd):
    """`launch doctor` run from a world-writable directory holding another uid's `fla/`: its kernel
    probe (`python -c`) does not import it (the control: a plain `python -c 'import fla'` there does)."""
    shared, marker = planted_cwd
    env = clean_env(tmp_path)
    subprocess.run([sys.executable, "-c", "import fla"], cwd=shared, env=env, check=True, timeout=60)
    assert marker.read_text() == "fla"  # the control: the planted package is importable from there
    marker.unlink()
    out = subprocess.run([sys.executable, "-P", "-m", "launch", "doctor", "--job", str(write_job(tmp_path, gpus=1))],
                         env=env, capture_output=True, text=True, timeout=180, cwd=shared)
    fla_row = next(line for line in out.stdout.splitlines() if line.startswith("kernels.fla"))
    assert "not installed" in fla_row, out.stdout + out.stderr
    assert not marker.exists(), f"the probe imported the planted {marker.read_text()}"


def test_fla_import_error_is_a_warning_on_cpu_without_gpu_job(tmp_path):
    env = clean_env(tmp_path, PYTHONPATH=f"{broken_fla(tmp_path)}{os.pathsep}{REPO}")
    res = by_check(run_checks(env=env))
    assert res["kernels.fla"].status is Status.WARN
    assert LIBZ3_ERROR in res["kernels.fla"].found
    assert res["kernels.gdn_fwd_bwd"].status is Status.SKIP


def test_fla_not_installed_fails_for_gpu_job_and_skips_on_cpu(tmp_path):
    env = clean_env(tmp_path)
    gpu_job = by_check(run_checks(str(write_job(tmp_path, gpus=2)), env))
    assert gpu_job["kernels.fla"].status is Status.FAIL
    assert gpu_job["kernels.fla"].found == "not installed"
    assert "flash-linear-attention" in gpu_job["kernels.fla"].fix
    assert gpu_job["kernels.causal_conv"].status is Status.FAIL
    cpu = by_check(run_checks(env=env))
    assert cpu["kernels.fla"].status is Status.SKIP


def test_fla_and_varlen_conv_import_pass(tmp_path):
    """Stand-in fla (see module docstring): the import checks PASS and name fla's conv."""
    env = clean_env(tmp_path, PYTHONPATH=f"{standin_fla(tmp_path)}{os.pathsep}{REPO}")
    res = by_check(run_checks(str(write_job(tmp_path, gpus=1)), env))
    assert res["kernels.fla"].status is Status.PASS, res["kernels.fla"]
    assert res["kernels.causal_conv"].status is Status.PASS
    assert "fla's Triton causal_conv1d" in res["kernels.causal_conv"].found


def test_broken_causal_conv1d_shows_its_error(tmp_path):
    """causal-conv1d built for another torch fails with an undefined symbol; show that text."""
    bad_conv = write_package(tmp_path / "conv", {
        "causal_conv1d/__init__.py": "raise ImportError('causal_conv1d_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice')\n"})
    env = clean_env(tmp_path, PYTHONPATH=os.pathsep.join([str(bad_conv), str(standin_fla(tmp_path)), str(REPO)]))
    res = by_check(run_checks(str(write_job(tmp_path, gpus=1)), env))
    assert res["kernels.causal_conv"].status is Status.WARN
    assert "undefined symbol: _ZN3c104cuda9SetDevice" in res["kernels.causal_conv"].found


def test_the_jobs_kernel_set_is_checked_through_the_trainers_own_selection(tmp_path):
    """`--job stage1` on a GPU node: one row per kernel of stage-1's set (GDN, its backend, conv,
    loss, attention), as train.common.fastpath selects them at start. fla is the stand-in (with
    the module layout the trainer probes); cut_cross_entropy is really not installed here, so
    the loss row FAILs with the real import error and the install at the lock's pin. A preset
    that asks for the logits loss on purpose passes; the in-job preflight leaves these rows to
    the trainer (which knows --allow-slow-path)."""
    fla = write_package(tmp_path / "fla-layout", {
        "fla/__init__.py": "",
        "fla/ops/__init__.py": "",
        "fla/ops/gated_delta_rule/__init__.py": "def chunk_gated_delta_rule(*a, **k): ...\n",
        "fla/modules/__init__.py": "",
        "fla/modules/causal_conv1d/__init__.py": "def causal_conv1d(*a, **k): ...\n",
    })
    env = clean_env(tmp_path, PYTHONPATH=f"{fla}{os.pathsep}{REPO}")
    res = by_check(run_checks(str(write_job(tmp_path, gpus=1)), env, run_gdn=False))
    rows = {k: v for k, v in res.items() if k.startswith("kernels.job.")}
    assert sorted(rows) == ["kernels.job." + n for n in ("attention", "backend", "conv", "gdn", "loss")]
    assert rows["kernels.job.gdn"].status is Status.PASS
    assert "fla.ops.gated_delta_rule.chunk_gated_delta_rule" in rows["kernels.job.gdn"].found
    assert "cu_seqlens" in rows["kernels.job.conv"].found
    assert rows["kernels.job.attention"].status is Status.PASS
    loss = rows["kernels.job.loss"]
    assert loss.status is Status.FAIL and "No module named 'cut_cross_entropy'" in loss.found
    assert "full logits" in loss.found and "1.7x the peak memory" in loss.found
    assert loss.fix.startswith("pip install 'cut-cross-entropy==25.1.1'")
    on_purpose = by_check(run_checks(str(write_job(tmp_path, gpus=1, args={"loss_impl": "logits"})), env,
                                     run_gdn=False))
    assert on_purpose["kernels.job.loss"].status is Status.PASS and "logits" in on_purpose["kernels.job.loss"].found
    preflight = run_checks(str(write_job(tmp_path, gpus=1)), env, run_gdn=False, preflight=True)
    assert not [r for r in preflight if r.check.startswith("kernels.job")]


def test_old_transformers_fails_packing_check(tmp_path):
    """A transformers below 5.9 on the path: really installed metadata, really too old."""
    site = tmp_path / "old"
    dist = site / "transformers-5.8.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 5.8.0\n")
    (site / "transformers").mkdir()
    (site / "transformers" / "__init__.py").write_text("")
    env = clean_env(tmp_path, PYTHONPATH=f"{site}{os.pathsep}{REPO}")
    out = run_doctor_cli(["--json"], env)
    rows = {r["check"]: r for r in json.loads(out.stdout)["checks"]}
    assert out.returncode == 1
    assert rows["kernels.transformers"]["status"] == "FAIL"
    assert "5.8.0 < 5.9" in rows["kernels.transformers"]["found"]
    assert rows["kernels.transformers"]["fix"] == "pip install 'transformers>=5.9'"
    ok = {r["check"]: r for r in json.loads(run_doctor_cli(["--json"], clean_env(tmp_path)).stdout)["checks"]}
    assert ok["kernels.transformers"]["status"] == "PASS"


# ---------------------------------------------------------------- compiler
def test_compiler_pass(tmp_path):
    res = by_check(run_checks(env=clean_env(tmp_path)))
    assert res["triton.cc"].status is Status.PASS, res["triton.cc"]
    assert "built and loaded" in res["triton.cc"].found


def test_no_compiler_on_path_fails(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    env = clean_env(tmp_path, PATH=str(bin_dir))
    out = run_doctor_cli([], env)
    assert out.returncode == 1
    row = next(line for line in out.stdout.splitlines() if line.startswith("triton.cc"))
    assert "FAIL" in row and "no C compiler" in row
    assert "Traceback" not in out.stderr


def test_cc_pointing_nowhere_fails(tmp_path):
    res = by_check(run_checks(env=clean_env(tmp_path, CC=str(tmp_path / "no-such-cc"))))
    assert res["triton.cc"].status is Status.FAIL
    assert "CC=" in res["triton.cc"].found


# ---------------------------------------------------------------- caches
def test_caches_pass_on_local_disk(tmp_path):
    res = by_check(run_checks(env=clean_env(tmp_path)))
    for name in ("cache.triton", "cache.hf", "cache.inductor"):
        assert res[name].status is Status.PASS, res[name]
    assert (tmp_path / "cache" / "triton").is_dir()


def test_cache_defaults_follow_the_libraries(tmp_path):
    from launch.doctor.caches import resolve_cache_dirs

    dirs = resolve_cache_dirs({"HOME": "/h", "USER": "al/ice", "TMPDIR": "/scratch/tmp"})
    assert dirs["cache.triton"][1] == Path("/h/.triton/cache")
    assert dirs["cache.hf"][1] == Path("/h/.cache/huggingface")
    assert dirs["cache.inductor"][1] == Path("/scratch/tmp/torchinductor_al_ice")
    assert resolve_cache_dirs({"HOME": "/h", "TRITON_HOME": "/t"})["cache.triton"][1] == Path("/t/.triton/cache")


def test_cache_on_nfs_fails(tmp_path):
    nfs_dir = tmp_path / "shared"
    nfs_dir.mkdir()
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(real_mountinfo() + f"999 1 0:99 / {nfs_dir} rw,relatime - nfs4 fileserver:/export rw,vers=4.2\n")
    env = clean_env(tmp_path, LAUNCH_DOCTOR_MOUNTINFO=str(mountinfo), TRITON_CACHE_DIR=str(nfs_dir / "triton"))
    out = run_doctor_cli([], env)
    assert out.returncode == 1
    assert said_in_cell(out.stdout, "cache.triton", "FAIL", column=1)
    assert said_in_cell(out.stdout, "cache.triton", "nfs4 (fileserver:/export")
    assert "export TRITON_CACHE_DIR=" in out.stdout
    res = by_check(run_checks(env=env))
    assert res["cache.triton"].status is Status.FAIL
    assert res["cache.hf"].status is Status.PASS  # only the cache on that mount


def test_mountinfo_escapes_and_longest_prefix(tmp_path):
    from launch.doctor.mounts import mount_of, parse_mountinfo

    share = tmp_path / "my share"
    (share / "x").mkdir(parents=True)
    (tmp_path / "my shareX").mkdir()
    escaped = str(share).replace(" ", "\\040")
    mounts = parse_mountinfo(
        "1 0 8:1 / / rw - ext4 /dev/sda1 rw\n"
        f"2 1 0:50 / {escaped} rw,relatime shared:5 - lustre 10.0.0.1@tcp:/fs rw\n"
    )
    assert mounts[1].mount_point == str(share) and mounts[1].is_network
    assert mount_of(share / "x" / "not-yet-created", mounts).fstype == "lustre"
    assert mount_of(tmp_path / "my shareX", mounts).fstype == "ext4"


@needs_mount_ns
def test_unwritable_cache_fails(tmp_path):
    """A read-only tmpfs over the cache dir, in a private mount namespace (root cannot write it)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    out, rows = doctor_over_tmpfs(ro, "ro,size=1m", clean_env(tmp_path, HF_HOME=str(ro / "hf")))
    assert out.returncode == 1, out.stderr
    assert rows["cache.hf"]["status"] == "FAIL"
    assert "not writable: Read-only file system" in rows["cache.hf"]["found"]
    assert rows["cache.triton"]["status"] == "PASS"


@needs_mount_ns
def test_cache_without_free_space_fails(tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    _, rows = doctor_over_tmpfs(small, "size=1m", clean_env(tmp_path, TORCHINDUCTOR_CACHE_DIR=str(small / "inductor")))
    assert rows["cache.inductor"]["status"] == "FAIL"
    assert "GiB free < 2 GiB" in rows["cache.inductor"]["found"]
    assert "tmpfs" in rows["cache.inductor"]["found"]


def test_cache_path_under_a_file_fails(tmp_path):
    blocker = tmp_path / "afile"
    blocker.write_text("x")
    res = by_check(run_checks(env=clean_env(tmp_path, TRITON_CACHE_DIR=str(blocker / "triton"))))
    assert res["cache.triton"].status is Status.FAIL
    assert "Not a directory" in res["cache.triton"].found


# ---------------------------------------------------------------- GPUs and Slurm
SLURM_2GPU = {"SLURM_JOB_ID": "4242", "SLURM_JOB_GPUS": "0,1", "SLURM_GPUS_ON_NODE": "2"}


def gpu_ctx(tmp_path: Path, **env: str) -> DoctorContext:
    return DoctorContext(env=clean_env(tmp_path, **env))


def test_gpu_count_matches_allocation(tmp_path):
    res = by_check(check_gpus(gpu_ctx(tmp_path, CUDA_VISIBLE_DEVICES="0,1", **SLURM_2GPU)))
    assert res["gpus.count"].status is Status.PASS, res["gpus.count"]


def test_gpu_count_mismatch_fails(tmp_path):
    res = by_check(check_gpus(gpu_ctx(tmp_path, CUDA_VISIBLE_DEVICES="0", **SLURM_2GPU)))
    assert res["gpus.count"].status is Status.FAIL
    assert "1 visible" in res["gpus.count"].found and "2 allocated" in res["gpus.count"].found


def test_slurm_context_pass_and_renumbered_pass(tmp_path):
    res = by_check(run_checks(env=clean_env(tmp_path, CUDA_VISIBLE_DEVICES="0,1", **SLURM_2GPU)))
    assert res["slurm.context"].status is Status.PASS, res["slurm.context"]
    # ConstrainDevices=yes: Slurm renumbers the job's GPUs 2,3 to 0,1; still consistent.
    env = clean_env(tmp_path, CUDA_VISIBLE_DEVICES="0,1", SLURM_JOB_ID="7", SLURM_JOB_GPUS="2,3")
    assert by_check(run_checks(env=env))["slurm.context"].status is Status.PASS


def test_slurm_gres_mismatch_fails_via_cli(tmp_path):
    env = clean_env(tmp_path, CUDA_VISIBLE_DEVICES="3", **SLURM_2GPU)
    out = run_doctor_cli([], env)
    assert out.returncode == 1
    flat = " ".join(out.stdout.split())
    assert "SLURM_JOB_GPUS=0,1 but CUDA_VISIBLE_DEVICES=3" in flat
    assert "Traceback" not in out.stderr


# ---------------------------------------------------------------- slurm.devices (the kernel's answer)
def _userns_ready() -> bool:
    from tests.ansible_fixtures import HAS_USERNSEXEC
    return os.geteuid() == 0 and HAS_USERNSEXEC


needs_userns = pytest.mark.skipif(not _userns_ready(), reason="needs root and lxc-usernsexec (a mapped user namespace)")


@needs_userns
def test_cgroup_device_program_loads_as_root_and_is_eperm_in_an_unprivileged_ct():
    """Why an unprivileged CT cannot have ConstrainDevices=yes: slurmd's cgroup-device eBPF program
    (the trivial allow-all one, bpf(2) BPF_PROG_LOAD via ctypes) loads as real root, and fails with
    EPERM as root of a user namespace mapped like PVE's (0 -> 100000). Real kernel, no stand-in."""
    from launch.doctor.bpf_probe import load_cgroup_device_program
    from tests.ansible_fixtures import in_unprivileged_ct

    assert load_cgroup_device_program() == 0
    probe = in_unprivileged_ct(["/usr/bin/python3", str(REPO / "launch" / "doctor" / "bpf_probe.py")])
    assert (probe.returncode, probe.stdout.strip()) == (1, "EPERM"), probe


@needs_userns
def test_device_policy_row_says_which_policy_the_node_has(tmp_path):
    """`slurm.devices`: ConstrainDevices=yes PASSes where the program loads (real root) and FAILs in
    the unprivileged CT (user namespace 0 -> 100000) with the fix; ConstrainDevices=no PASSes there
    and WARNs where confinement would work; no task/cgroup says devices are not confined."""
    from launch.doctor.device_policy import check_device_policy
    from tests.ansible_fixtures import in_unprivileged_ct, traversable_tmp_dir, userns_python

    found = userns_python()
    if found is None:
        pytest.skip("no interpreter a mapped uid can reach")
    python, pythonpath = found
    conf_dir = traversable_tmp_dir("launch-doctor-")
    try:
        def row(constrain: str, task_plugin: str = "task/cgroup,task/affinity", in_ct: bool = False):
            (conf_dir / "slurm.conf").write_text(f"ClusterName=x\nTaskPlugin={task_plugin}\n")
            (conf_dir / "cgroup.conf").write_text(f"# why\nConstrainDevices={constrain}\n")
            env = {"SLURM_CONF": str(conf_dir / "slurm.conf")}
            if not in_ct:
                (result,) = check_device_policy(DoctorContext(env=env))
                return result.status, result.found, result.fix
            code = ("import json, sys; from launch.doctor.device_policy import check_device_policy; "
                    "from launch.doctor.context import DoctorContext; "
                    f"r, = check_device_policy(DoctorContext(env={env!r})); print(json.dumps([r.status.value, r.found, r.fix]))")
            out = in_unprivileged_ct([python, "-c", code], env=pythonpath)
            assert out.returncode == 0, out.stderr
            status, text, fix = json.loads(out.stdout)
            return Status(status), text, fix

        status, text, _ = row("yes")
        assert status is Status.PASS and "a cgroup device program loads here (the initial user namespace)" in text
        status, text, fix = row("yes", in_ct=True)
        assert status is Status.FAIL, text
        assert "fails with EPERM (a user namespace (uid 0 is host uid 100000))" in text and "ConstrainDevices=no" in fix
        status, text, _ = row("no", in_ct=True)
        assert status is Status.PASS and text.startswith("ConstrainDevices=no: a job can open every GPU"), text
        status, text, _ = row("no")
        assert status is Status.WARN and "though confinement would work" in text
        status, text, _ = row("yes", task_plugin="task/none")
        assert status is Status.PASS and "devices not confined by Slurm (TaskPlugin=task/none)" in text
    finally:
        shutil.rmtree(conf_dir, ignore_errors=True)


def test_outside_allocation_fails_only_when_expected(tmp_path):
    env = clean_env(tmp_path)
    assert by_check(run_checks(env=env))["slurm.context"].status is Status.SKIP
    res = by_check(run_checks(env=env, expect_allocation=True))
    assert res["slurm.context"].status is Status.FAIL
    assert "keepalive yields GPUs only to Slurm jobs" in res["slurm.context"].fix


def test_keepalive_released_passes_and_still_held_fails(tmp_path):
    state = tmp_path / "keepalive.json"
    state.write_text(json.dumps({"held": [2, 3], "released": {"4242": [0, 1]}}))
    env = {"CUDA_VISIBLE_DEVICES": "0,1", "LAUNCH_KEEPALIVE_STATE": str(state), **SLURM_2GPU}
    res = by_check(check_gpus(gpu_ctx(tmp_path, **env)))
    assert res["gpus.keepalive"].status is Status.PASS
    assert "released to job 4242" in res["gpus.keepalive"].found
    # The holder (`launch keepalive run`) writes its pid too; this process stands for a live one.
    state.write_text(json.dumps({"pid": os.getpid(), "held": [0, 1, 2, 3], "released": {}}))
    res = by_check(check_gpus(gpu_ctx(tmp_path, **env)))
    assert res["gpus.keepalive"].status is Status.FAIL
    assert "still holds GPUs [0, 1]" in res["gpus.keepalive"].found
    dead = subprocess.Popen(["true"])
    dead.wait()
    state.write_text(json.dumps({"pid": dead.pid, "held": [0, 1, 2, 3], "released": {}}))
    res = by_check(check_gpus(gpu_ctx(tmp_path, **env)))
    assert res["gpus.keepalive"].status is Status.WARN and "is stale" in res["gpus.keepalive"].found


def test_keepalive_state_absent_warns_in_gpu_allocation(tmp_path):
    res = by_check(check_gpus(gpu_ctx(tmp_path, CUDA_VISIBLE_DEVICES="0,1", **SLURM_2GPU)))
    assert res["gpus.keepalive"].status is Status.WARN
    assert by_check(check_gpus(gpu_ctx(tmp_path)))["gpus.keepalive"].status is Status.SKIP


def fake_nvidia_smi(bin_dir: Path, apps: list[tuple[int, str]]) -> None:
    """Stand-in nvidia-smi (no NVIDIA driver here): 4 H200s; compute apps as (pid, gpu uuid)."""
    gpus = "\n".join(f"{i}, GPU-{i}aaa, NVIDIA H200, 9.0, 580.159.04" for i in range(4))
    procs = "\n".join(f"{pid}, {uuid}, 1024" for pid, uuid in apps)
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "nvidia-smi"
    script.write_text(f"#!/bin/sh\ncase \"$1\" in\n  --query-gpu=*) printf '%s\\n' '{gpus}' ;;\n"
                      f"  --query-compute-apps=*) printf '%s' '{procs}' ;;\n  *) exit 9 ;;\nesac\n")
    script.chmod(0o755)


def test_foreign_process_on_job_gpu_fails(tmp_path):
    """Stand-in nvidia-smi reports a real, unrelated process (a sleep) on GPU 1 of the job."""
    stray = subprocess.Popen(["sleep", "60"])
    try:
        fake_nvidia_smi(tmp_path / "bin", [(stray.pid, "GPU-1aaa"), (999999, "GPU-3aaa")])
        path = f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"
        res = by_check(check_gpus(gpu_ctx(tmp_path, PATH=path, CUDA_VISIBLE_DEVICES="0,1", **SLURM_2GPU)))
        assert res["gpus.foreign_procs"].status is Status.FAIL
        assert f"GPU 1: pid {stray.pid} (sleep" in res["gpus.foreign_procs"].found
        assert "999999" not in res["gpus.foreign_procs"].found  # GPU 3 is not the job's
        assert res["gpus.count"].status is Status.PASS  # 2 of the 4 GPUs visible
    finally:
        stray.kill()
        stray.wait()


def test_no_foreign_process_passes(tmp_path):
    fake_nvidia_smi(tmp_path / "bin", [(os.getpid(), "GPU-0aaa")])  # the doctor itself is not foreign
    path = f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"
    res = by_check(check_gpus(gpu_ctx(tmp_path, PATH=path, CUDA_VISIBLE_DEVICES="0,1", **SLURM_2GPU)))
    assert res["gpus.foreign_procs"].status is Status.PASS
    # CUDA_VISIBLE_DEVICES naming a GPU the node lacks: fewer visible than allocated.
    res = by_check(check_gpus(gpu_ctx(tmp_path, PATH=path, CUDA_VISIBLE_DEVICES="0,7", **SLURM_2GPU)))
    assert res["gpus.count"].status is Status.FAIL


# ---------------------------------------------------------------- versions
def test_version_lock_pass_and_mismatch(tmp_path):
    env = clean_env(tmp_path)
    ok = by_check(run_checks(str(write_job(tmp_path, gpus=0, lock={"torch": ">=2.0", "pyyaml": ">=6"})), env))
    assert ok["versions.lock"].status is Status.PASS, ok["versions.lock"]
    assert "torch 2." in ok["versions.recorded"].found
    job = write_job(tmp_path, gpus=0, lock={"torch": "==0.0.1", "flash-linear-attention": ">=0.6 ; extra == 'gpu'"})
    out = run_doctor_cli(["--job", str(job)], env)
    assert out.returncode == 1
    flat = " ".join(out.stdout.split())
    assert "versions.lock | FAIL" in flat and "torch 2." in flat and "(lock: ==0.0.1)" in flat
    assert "flash-linear-attention" not in flat.split("versions.lock")[1]  # gpu-only entry skipped on CPU job


def test_lock_file_option_and_bad_lock_line(tmp_path):
    lock = tmp_path / "constraints.txt"
    lock.write_text("# pins\ntransformers>=99\n")
    out = run_doctor_cli(["--lock", str(lock)], clean_env(tmp_path))
    assert out.returncode == 1 and "transformers 5." in " ".join(out.stdout.split())
    lock.write_text("torch >>> 2\n")
    out = run_doctor_cli(["--lock", str(lock)], clean_env(tmp_path))
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and f"{lock}:1: not a requirement line" in out.stderr
    assert "Traceback" not in out.stderr


# ---------------------------------------------------------------- CLI and fast subset
def test_cli_healthy_machine_exits_zero_with_table(tmp_path):
    out = run_doctor_cli(["--job", "stage1", "--preset", "tiny"], clean_env(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    header = out.stdout.splitlines()[0]
    assert [c.strip() for c in header.split("|")] == ["check", "status", "found", "fix"]
    assert "0 FAIL" in out.stdout


def test_cli_user_errors_are_one_line(tmp_path):
    env = clean_env(tmp_path)
    for args, text in ((["--job", "nosuchjob"], "unknown job 'nosuchjob'"),
                       (["--job", "stage1", "--preset", "nope"], "unknown preset 'nope'"),
                       (["--lock", str(tmp_path / "missing.txt")], "no such file")):
        out = run_doctor_cli(args, env)
        assert out.returncode == 2, args
        assert text in out.stderr and "Traceback" not in out.stderr
        assert len(out.stderr.strip().splitlines()) == 1


def test_fast_subset_returns_results_and_skips_gdn(tmp_path):
    env = clean_env(tmp_path, CUDA_VISIBLE_DEVICES="0,1", **SLURM_2GPU)
    results = fast_subset("stage1", env=env, stream=None)
    res = by_check(results)
    assert not any(r.status is Status.FAIL for r in results)
    assert res["slurm.context"].status is Status.PASS
    assert res["versions.lock"].status is Status.PASS  # stage1's lock, CPU entries only


def test_fast_subset_raises_doctor_message_on_fail(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    env = clean_env(tmp_path, PATH=str(bin_dir), CUDA_VISIBLE_DEVICES="0", **SLURM_2GPU)
    with pytest.raises(LaunchError) as err:
        fast_subset("stage1", env=env, stream=None)
    msg = str(err.value)
    assert "\n" not in msg
    assert "triton.cc: no C compiler" in msg and "apt-get install gcc python3-dev" in msg
    assert "gpus.count: 1 visible" in msg
    assert err.value.exit_code == 1
    with pytest.raises(LaunchError, match="slurm.context: not inside a Slurm allocation"):
        fast_subset(None, env=clean_env(tmp_path), stream=None)


def test_fast_subset_with_spec_not_found_warns_instead_of_failing(tmp_path):
    env = clean_env(tmp_path, CUDA_VISIBLE_DEVICES="0,1", **SLURM_2GPU)
    res = by_check(fast_subset("job-not-on-this-node", env=env, stream=None))
    assert res["versions.lock"].status is Status.WARN
    assert "unknown job 'job-not-on-this-node'" in res["versions.lock"].found


def test_gdn_reference_matches_transformers_recurrence():
    """The oracle the GPU check compares fla against equals transformers' own token-by-token
    gated delta rule (real transformers, CPU, float32)."""
    torch = pytest.importorskip("torch")
    qwen = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
    from launch.doctor.kernel_probe import reference_gdn

    torch.manual_seed(1)
    T, H, K, V = 24, 2, 8, 6
    q, k, v = torch.randn(1, T, H, K), torch.nn.functional.normalize(torch.randn(1, T, H, K), dim=-1), torch.randn(1, T, H, V)
    g, beta = torch.nn.functional.logsigmoid(torch.randn(1, T, H)), torch.rand(1, T, H)
    expected, _ = qwen.torch_recurrent_gated_delta_rule(q, k, v, g, beta)
    got = reference_gdn(q[0], k[0], v[0], g[0], beta[0], scale=K**-0.5)
    torch.testing.assert_close(got, expected[0], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- --on-cluster (real embedded Slurm)
@pytest.mark.slurm
def test_on_cluster_runs_inside_an_allocation_with_the_jobs_gpus(slurm_cluster, tmp_path):
    """The doctor as a Slurm job on the embedded cluster (stand-in GPUs, see conftest): it sees
    the GRES binding Slurm made for the job's 2 GPUs, and still fails the missing GPU kernels."""
    env = {**clean_env(tmp_path), **slurm_cluster.env()}
    job = write_job(tmp_path, gpus=2, lock={"torch": ">=2.0"})
    out = run_doctor_cli(["--on-cluster", "--job", str(job), "--json"], env)
    assert "Traceback" not in out.stderr, out.stderr
    assert "doctor submitted as Slurm job" in out.stderr
    rows = {r["check"]: r for r in json.loads(out.stdout)["checks"]}
    assert out.returncode == 1
    assert rows["slurm.context"]["status"] == "PASS", rows["slurm.context"]
    assert rows["gpus.count"]["status"] == "PASS" and "2 visible = 2 allocated" in rows["gpus.count"]["found"]
    assert rows["kernels.fla"]["status"] == "FAIL"  # the job wants GPUs; fla is not installed here
    # In the job, caches are where `launch submit` puts them: per-job node-local scratch.
    assert "/launch-" in rows["cache.triton"]["found"] and rows["cache.triton"]["status"] == "PASS"
    assert rows["versions.lock"]["status"] == "PASS"


@pytest.mark.slurm
def test_on_cluster_cpu_job_passes(slurm_cluster, tmp_path):
    env = {**clean_env(tmp_path), **slurm_cluster.env()}
    out = run_doctor_cli(["--on-cluster", "--job", str(write_job(tmp_path, gpus=0))], env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "slurm.context         | PASS   | job " in out.stdout


def test_on_cluster_without_slurm_is_one_line(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    out = run_doctor_cli(["--on-cluster"], clean_env(tmp_path, PATH=str(bin_dir)))
    assert out.returncode == 2 and "'sbatch' not found" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1


@pytest.mark.slurm
def test_submit_preflight_fails_the_job_early_with_the_doctors_message(launch_env, tmp_path):
    """`launch submit` runs fast_subset inside the job (launch.runner); a job whose environment
    names a C compiler that does not exist stops before its entrypoint, and the doctor's
    message reaches `launch logs`. The same job with a working compiler runs."""
    from conftest import run_launch

    spec = tmp_path / "preflightjob.yaml"
    body = {"name": "preflightjob", "entrypoint": "fixture_entry",
            "resources": {"nodes": 1, "gpus_per_node": 2, "cpus_per_task": 1, "time": "00:05:00"}}
    spec.write_text(json.dumps(body))
    # CC chooses a program the job runs: a spec may not set it, `--env` only with --allow-loader-env
    out = run_launch(["submit", str(spec), "--env", "CC=/nonexistent/cc", "--allow-loader-env", "--follow"], launch_env)
    assert out.returncode != 0, out.stdout + out.stderr
    job_id = out.stdout.splitlines()[0].split()[-1]
    logs = run_launch(["logs", job_id], launch_env)
    text = logs.stdout + logs.stderr
    assert "triton.cc: no C compiler: CC=/nonexistent/cc names no executable" in " ".join(text.split())
    assert "fixture done" not in text and "SLURM_JOB_ID=" not in text  # the entrypoint never ran

    out = run_launch(["submit", str(spec), "--follow"], launch_env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fixture done" in out.stdout


def test_per_task_gpu_binding_is_consistent(tmp_path):
    """8 GPUs, 8 tasks on the node, each bound to one: task 3 sees GPU 3 only."""
    env = {"SLURM_JOB_ID": "9", "SLURM_JOB_GPUS": "0,1,2,3,4,5,6,7", "SLURM_GPUS_ON_NODE": "8",
           "SLURM_NTASKS_PER_NODE": "8", "CUDA_VISIBLE_DEVICES": "3"}
    res = by_check(run_checks(env=clean_env(tmp_path, **env)))
    assert res["gpus.count"].status is Status.PASS, res["gpus.count"]
    assert res["slurm.context"].status is Status.PASS, res["slurm.context"]
    env["CUDA_VISIBLE_DEVICES"] = "3,4"  # two per task when each should have one
    res = by_check(run_checks(env=clean_env(tmp_path, **env)))
    assert res["gpus.count"].status is Status.FAIL and res["slurm.context"].status is Status.FAIL


def test_kernel_import_that_kills_the_interpreter_is_reported(tmp_path):
    """An extension that segfaults on import (ABI mismatch) must not take the doctor down."""
    crashing = write_package(tmp_path / "crash", {"fla/__init__.py": "import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)\n"})
    env = clean_env(tmp_path, PYTHONPATH=f"{crashing}{os.pathsep}{REPO}")
    res = by_check(run_checks(str(write_job(tmp_path, gpus=1)), env))
    assert res["kernels.fla"].status is Status.FAIL
    assert "killed by SIGSEGV" in res["kernels.fla"].found


def test_old_driver_without_compute_cap_field_still_lists_gpus(tmp_path):
    """Stand-in nvidia-smi of a pre-510 driver: the compute_cap query fails, the plain one works."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / "nvidia-smi"
    script.write_text("#!/bin/sh\ncase \"$1\" in\n"
                      "  *compute_cap*) echo 'Field \"compute_cap\" is not a valid field to query.'; exit 2 ;;\n"
                      "  --query-gpu=*) echo '0, GPU-0aaa, Tesla V100, 470.82.01' ;;\n  *) exit 0 ;;\nesac\n")
    script.chmod(0o755)
    ctx = gpu_ctx(tmp_path, PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert [(g.index, g.compute_cap, g.driver) for g in ctx.gpus] == [(0, None, "470.82.01")]


def fake_dist(site: Path, name: str, version: str) -> None:
    """Installed-package metadata for `name` (what importlib.metadata reads), without the code."""
    dist = site / f"{name}-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_hopper_with_bad_triton_needs_tilelang(tmp_path):
    """Stand-in nvidia-smi reporting an H200 (sm_90) and triton 3.6.0's metadata on the path:
    without tilelang the row FAILs with the fix; a tilelang whose import fails shows its real
    error; an importable tilelang (stand-in: the real one needs CUDA) makes it PASS."""
    fake_nvidia_smi(tmp_path / "bin", [])
    site = tmp_path / "site"
    fake_dist(site, "triton", "3.6.0")
    path = f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}"

    def hopper_row(*extra: Path) -> dict:
        env = clean_env(tmp_path, PATH=path, PYTHONPATH=os.pathsep.join([*map(str, extra), str(site), str(REPO)]))
        out = run_doctor_cli(["--json", "--no-gdn"], env)
        assert "Traceback" not in out.stderr, out.stderr
        return {r["check"]: r for r in json.loads(out.stdout)["checks"]}["kernels.hopper_triton"]

    row = hopper_row()
    assert row["status"] == "FAIL"
    assert "Hopper with triton 3.6.0 (>=3.4,<3.7.1)" in row["found"] and "tilelang: not installed" in row["found"]
    assert "triton>=3.7.1" in row["fix"] and "tilelang" in row["fix"]
    broken = write_package(tmp_path / "broken_tl", {"tilelang/__init__.py": f"raise OSError({LIBZ3_ERROR!r})\n"})
    row = hopper_row(broken)
    assert row["status"] == "FAIL" and f"OSError: {LIBZ3_ERROR}" in row["found"]
    working = write_package(tmp_path / "tl", {"tilelang/__init__.py": ""})
    assert hopper_row(working)["status"] == "PASS"


# ---------------------------------------------------------------- NVSwitch: Fabric Manager
def test_fabric_manager_skips_without_nvswitch_and_fails_without_the_daemon(tmp_path):
    """Stand-in /dev/nvidia-nvswitch* nodes (no NVSwitch here; LAUNCH_DOCTOR_DEV_DIR); the process
    table is this machine's real /proc, where no nv-fabricmanager runs."""
    dev = tmp_path / "dev"
    dev.mkdir()
    env = clean_env(tmp_path, LAUNCH_DOCTOR_DEV_DIR=str(dev))
    res = by_check(run_checks(env=env, run_gdn=False))
    assert res["gpus.fabricmanager"].status is Status.SKIP
    for name in ("nvidia-nvswitch0", "nvidia-nvswitch1", "nvidia-nvswitch10", "nvidia-nvswitchctl"):
        (dev / name).write_text("")
    proc = run_doctor_cli(["--json", "--no-gdn"], env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    row = {r["check"]: r for r in json.loads(proc.stdout)["checks"]}["gpus.fabricmanager"]
    assert row["status"] == "FAIL"
    assert "3 NVSwitch nodes (nvidia-nvswitch0..nvidia-nvswitch10)" in row["found"]
    assert "error 802" in row["found"] and "no nv-fabricmanager process" in row["found"]
    assert "nvidia-fabricmanager of the driver's exact version" in row["fix"]
    assert "systemctl enable --now nvidia-fabricmanager" in row["fix"]


def test_fabric_manager_passes_when_the_daemon_runs(tmp_path):
    """A real process whose argv[0] is nv-fabricmanager (a sleep under that name: no NVSwitch)."""
    dev = tmp_path / "dev"
    dev.mkdir()
    (dev / "nvidia-nvswitch0").write_text("")
    daemon = subprocess.Popen(["bash", "-c", "exec -a nv-fabricmanager sleep 60"])
    try:
        for _ in range(100):  # until bash has exec'd under the new name
            if daemon.pid in fabric_manager_pids():
                break
            time.sleep(0.05)
        res = by_check(run_checks(env=clean_env(tmp_path, LAUNCH_DOCTOR_DEV_DIR=str(dev)), run_gdn=False))
    finally:
        daemon.kill()
        daemon.wait()
    assert res["gpus.fabricmanager"].status is Status.PASS, res["gpus.fabricmanager"]
    assert f"nv-fabricmanager runs (pid {daemon.pid})" in res["gpus.fabricmanager"].found


# ---------------------------------------------------------------- driver branch vs CUDA runtime
@pytest.mark.parametrize(("driver", "cuda", "ok"), [
    ("575.57.08", "13.0", False), ("580.65.06", "13.0", True),  # CUDA 13 needs R580+
    ("520.61.05", "12.1", False), ("525.60.13", "12.8", True),  # CUDA 12.x needs R525+ (minor-version compat)
    ("550.54.15", "12.4", True), ("440.33.01", "11.8", False),
])
def test_driver_branch_against_the_cuda_runtime(driver, cuda, ok):
    from launch.doctor.versions import check_driver_cuda

    row = check_driver_cuda({"nvidia-driver": driver, "cuda": cuda})
    assert row.status is (Status.PASS if ok else Status.FAIL), row
    if not ok:
        assert f"driver {driver} (R{driver.split('.')[0]}) is too old for CUDA {cuda}" in row.found
        assert "error 35" in row.found and "upgrade the host's NVIDIA driver" in row.fix
    cli = subprocess.run([sys.executable, "-m", "launch.doctor.driver_cuda", driver, cuda], capture_output=True,
                         text=True, cwd=REPO, timeout=60)
    assert cli.returncode == (0 if ok else 1) and len(cli.stdout.strip().splitlines()) == 1


def test_driver_cuda_skips_without_a_driver_and_refuses_a_malformed_version():
    from launch.doctor.versions import check_driver_cuda

    assert check_driver_cuda({"nvidia-driver": None, "cuda": "12.4"}).status is Status.SKIP
    assert check_driver_cuda({"nvidia-driver": "550.54.15", "cuda": None}).status is Status.SKIP
    cli = subprocess.run([sys.executable, "-m", "launch.doctor.driver_cuda", "R550", "12.4"], capture_output=True,
                         text=True, cwd=REPO, timeout=60)
    assert cli.returncode == 2 and cli.stderr.strip() == "error: driver version 'R550' is not N.N"
    assert "Traceback" not in cli.stderr


# ---------------------------------------------------------------- slurm.cgroup, slurm.gpu_isolation

def test_cgroup_row_fails_on_cgroup_v2_without_a_system_bus_and_passes_with_one(tmp_path):
    """`slurm.cgroup`: cgroup v2 (a root with cgroup.controllers) and no D-Bus system bus FAILs
    naming the fix; a real listening Unix socket at the bus path, IgnoreSystemd=yes, or cgroup v1
    PASS."""
    import socket

    from launch.doctor.slurm_node import check_cgroup_plugin

    (tmp_path / "slurm.conf").write_text("ClusterName=x\nTaskPlugin=task/cgroup\n")
    (tmp_path / "cgroup.conf").write_text("CgroupPlugin=autodetect\nConstrainDevices=no\n")
    v2, v1 = tmp_path / "cg2", tmp_path / "cg1"
    v2.mkdir(), v1.mkdir()
    (v2 / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    bus = tmp_path / "system_bus_socket"
    ctx = DoctorContext(env={"SLURM_CONF": str(tmp_path / "slurm.conf")})

    row = check_cgroup_plugin(ctx, cgroup_root=v2, bus=bus)
    assert row.status is Status.FAIL and "no D-Bus system bus" in row.found and "dbus" in row.fix, row
    assert check_cgroup_plugin(ctx, cgroup_root=v1, bus=bus).status is Status.PASS
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(str(bus))
        listener.listen(1)
        row = check_cgroup_plugin(ctx, cgroup_root=v2, bus=bus)
        assert row.status is Status.PASS and "the D-Bus system bus answers" in row.found
    bus.unlink()  # a stale socket file with nobody listening is no bus
    bus.touch()
    assert check_cgroup_plugin(ctx, cgroup_root=v2, bus=bus).status is Status.FAIL
    (tmp_path / "cgroup.conf").write_text("CgroupPlugin=autodetect\nIgnoreSystemd=yes\nEnableControllers=yes\n")
    assert check_cgroup_plugin(ctx, cgroup_root=v2, bus=bus).status is Status.PASS


def test_gpu_isolation_row_runs_the_task_prolog_for_a_step_without_gpus(tmp_path):
    """`slurm.gpu_isolation`: the slurm role's own TaskProlog template (rendered with Ansible's
    Jinja) PASSes: run as for a step without GPUs it empties both variables; for a step with GPUs
    it exports neither. A TaskProlog that prints nothing, or none, WARNs; ConstrainDevices=yes
    PASSes without one."""
    import jinja2

    from launch.doctor.slurm_node import check_gpu_isolation

    template = REPO / "ansible" / "roles" / "slurm" / "templates" / "task-prolog.sh.j2"
    prolog = tmp_path / "task-prolog.sh"
    prolog.write_text(jinja2.Template(template.read_text()).render(ansible_managed="test",
                                                                   slurm_task_env={"HF_HOME": "/scratch/hf"}))
    prolog.chmod(0o755)
    (tmp_path / "cgroup.conf").write_text("ConstrainDevices=no\n")
    conf = tmp_path / "slurm.conf"
    env = {"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "0,1"}

    conf.write_text(f"TaskPlugin=task/cgroup,task/affinity\nTaskProlog={prolog}\n")
    row = check_gpu_isolation(DoctorContext(env=env))
    assert row.status is Status.PASS, row
    with_gpus = subprocess.run([str(prolog)], env={**env, "SLURM_STEP_GPUS": "2", "SLURM_JOB_GPUS": "2",
                                                    "SLURM_GPUS_ON_NODE": "1"},
                               capture_output=True, text=True, check=True).stdout
    assert with_gpus.splitlines() == ["export HF_HOME=/scratch/hf"]
    # The batch step of a GPU job: Slurm sets SLURM_JOB_GPUS and SLURM_GPUS_ON_NODE, no SLURM_STEP_GPUS.
    batch = subprocess.run([str(prolog)], env={**env, "SLURM_JOB_GPUS": "2", "SLURM_GPUS_ON_NODE": "1"},
                           capture_output=True, text=True, check=True).stdout
    assert batch.splitlines() == ["export HF_HOME=/scratch/hf"]
    # `srun --gres=none` inside a GPU job: Slurm unsets the step's own variables, SLURM_JOB_GPUS
    # stays inherited; the step sees no GPU.
    gres_none = subprocess.run([str(prolog)], env={"PATH": "/usr/bin:/bin", "SLURM_JOB_GPUS": "2"},
                               capture_output=True, text=True, check=True).stdout
    assert gres_none.splitlines() == ["export HF_HOME=/scratch/hf", "export CUDA_VISIBLE_DEVICES=",
                                      "export NVIDIA_VISIBLE_DEVICES="]
    without = subprocess.run([str(prolog)], env={"PATH": "/usr/bin:/bin"}, capture_output=True, text=True,
                             check=True).stdout
    assert without.splitlines() == ["export HF_HOME=/scratch/hf", "export CUDA_VISIBLE_DEVICES=",
                                    "export NVIDIA_VISIBLE_DEVICES="]

    silent = tmp_path / "silent.sh"
    silent.write_text("#!/bin/sh\necho export HF_HOME=/x\n")
    silent.chmod(0o755)
    conf.write_text(f"TaskPlugin=task/cgroup\nTaskProlog={silent}\n")
    row = check_gpu_isolation(DoctorContext(env=env))
    assert row.status is Status.WARN and "leaves CUDA_VISIBLE_DEVICES and NVIDIA_VISIBLE_DEVICES set" in row.found
    # The old rule (keyed on the job's SLURM_JOB_GPUS) passes a job without GPUs but not a --gres=none step.
    job_keyed = tmp_path / "job-keyed.sh"
    job_keyed.write_text('#!/bin/sh\nif [ -z "${SLURM_STEP_GPUS:-}${SLURM_JOB_GPUS:-}" ]; then\n'
                         '  echo "export CUDA_VISIBLE_DEVICES="; echo "export NVIDIA_VISIBLE_DEVICES="\nfi\n')
    job_keyed.chmod(0o755)
    conf.write_text(f"TaskPlugin=task/cgroup\nTaskProlog={job_keyed}\n")
    row = check_gpu_isolation(DoctorContext(env=env))
    assert row.status is Status.WARN and "a --gres=none step inside a GPU job" in row.found, row
    conf.write_text("TaskPlugin=task/cgroup\n")
    row = check_gpu_isolation(DoctorContext(env=env))
    assert row.status is Status.WARN and "sees every GPU" in row.found and "TaskProlog" in row.fix
    (tmp_path / "cgroup.conf").write_text("ConstrainDevices=yes\n")
    assert check_gpu_isolation(DoctorContext(env=env)).status is Status.PASS
