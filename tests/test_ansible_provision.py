"""The Ansible provisioning: inventory checks, the Proxmox backend, and a real LXC container.

Real: Ansible, the project's roles and playbook, Debian's LXC, a debootstrap'd bookworm rootfs,
apt and gcc inside the container.
Stand-ins, because this machine has neither a GPU nor Proxmox:
- GPU device nodes: character devices with the NVIDIA major 195, made with mknod in a temp
  dir, plus a stand-in /proc/devices listing 195 as `nvidia-frontend` (tests/ansible_fixtures.py);
- `pct`: a small script on PATH that logs its argv and keeps a CT config file (PCT_STANDIN in
  tests/ansible_fixtures.py), and tests/pct_lxc_standin.py, which maps pct verbs onto lxc-*
  commands on a real container. What runs on a real Proxmox host is tested only through them.
"""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ansible_fixtures import (
    ANSIBLE_DIR,
    CHECK_INVENTORY,
    PLAYBOOK,
    STANDIN_MAJOR,
    ansible_bin,
    cached_rootfs_tarball,
    destroy_container,
    install_pct_lxc_standin,
    install_pct_standin,
    lxc_attach,
    lxc_inventory,
    make_standin_gpus,
    run_playbook,
    write_inventory,
)

GOLDEN = Path(__file__).parent / "golden"
IS_ROOT = os.geteuid() == 0
HAS_LXC = all(shutil.which(tool) for tool in ("lxc-create", "lxc-start", "lxc-attach", "debootstrap"))
needs_root = pytest.mark.skipif(not IS_ROOT, reason="mknod of stand-in device nodes and LXC need root")
needs_lxc = pytest.mark.skipif(not (IS_ROOT and HAS_LXC), reason="needs root and Debian's lxc + debootstrap")


def check_inventory(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECK_INVENTORY), str(path), *args],
                          capture_output=True, text=True, timeout=120)


# --- inventories ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["kpro6.yml", "local.yml"])
def test_shipped_inventories_pass_the_check_and_the_syntax_check(name: str) -> None:
    inventory = ANSIBLE_DIR / "inventory" / name
    result = check_inventory(inventory)
    assert result.returncode == 0, result.stderr
    syntax = subprocess.run(
        [ansible_bin("ansible-playbook"), "-i", str(inventory), "--syntax-check", str(PLAYBOOK)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "ANSIBLE_CONFIG": str(ANSIBLE_DIR / "ansible.cfg")},
    )
    assert syntax.returncode == 0, syntax.stdout + syntax.stderr


def _kpro6_with(tmp_path: Path, **container_vars: object) -> Path:
    import yaml

    data = yaml.safe_load((ANSIBLE_DIR / "inventory" / "kpro6.yml").read_text())
    ct = data["all"]["children"]["gpu_containers"]["children"]["kpro6_containers"]["hosts"]["kpro6-ct200"]
    for key, value in container_vars.items():
        if value is None:
            ct.pop(key, None)
        else:
            ct[key] = value
    return write_inventory(tmp_path / "bad.yml", data)


@pytest.mark.parametrize(
    ("change", "names"),
    [
        ({"ct_vmid": None}, "ct_vmid is missing"),
        ({"ct_gpus": [0, 8]}, "ct_gpus=8 is out of range (0..7)"),
        ({"node_caches_root": "/mnt/lustre/cache"}, "node_caches_root=/mnt/lustre/cache is not under ct_scratch_mount"),
        ({"node_caches_fstype_hint": "nfs"}, "node_caches_root is on nfs"),
        ({"ct_cores": "many"}, "ct_cores='many' is not an integer"),
    ],
)
def test_bad_inventory_fails_early_with_one_line(tmp_path: Path, change: dict, names: str) -> None:
    result = check_inventory(_kpro6_with(tmp_path, **change))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0], result.stderr
    assert lines[0].startswith("inventory error: kpro6-ct200: ")
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_unparsable_inventory_is_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yml"
    broken.write_text("all: [this is: not an inventory\n")
    result = check_inventory(broken)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_playbook_refuses_a_bad_inventory_before_touching_hosts(tmp_path: Path) -> None:
    inventory = _kpro6_with(tmp_path, ct_vmid=None)
    proc, recap = run_playbook(inventory, "--limit", "kpro6:kpro6_containers", timeout=300)
    assert proc.returncode != 0
    assert "inventory error: kpro6-ct200: ct_vmid is missing" in proc.stdout
    assert "TASK [gpu_host" not in proc.stdout  # stopped in the first play


# --- proxmox backend (pct stand-in) -----------------------------------------------------------

@needs_root
def test_proxmox_backend_pct_commands_and_conf_block(tmp_path: Path) -> None:
    """The lxc_container role's `proxmox` backend against the logging `pct` stand-in.

    Golden files: tests/golden/pct-commands.txt and tests/golden/pve-200.conf, with the temp
    stand-in device dir written as <DEV>.
    """
    import yaml

    dev, proc_devices = make_standin_gpus(tmp_path, gpus=8)
    conf_dir, log = tmp_path / "pve-lxc", tmp_path / "pct.log"
    conf_dir.mkdir()
    install_pct_standin(tmp_path / "bin")
    data = yaml.safe_load((ANSIBLE_DIR / "inventory" / "kpro6.yml").read_text())
    data["all"]["children"]["container_hosts"]["children"]["pve_hosts"]["hosts"]["kpro6"].update({
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
        "gpu_host_proc_devices": str(proc_devices), "gpu_host_dev_dir": str(dev),
        "gpu_host_scratch_path": str(tmp_path), "gpu_host_scratch_must_be_mountpoint": False,
        "lxc_container_pve_conf_dir": str(conf_dir),
    })
    inventory = write_inventory(tmp_path / "kpro6.yml", data)
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "PCT_LOG": str(log), "PCT_CONF_DIR": str(conf_dir)}

    first, recap = run_playbook(inventory, "--limit", "kpro6", env=env, timeout=300)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr
    assert recap["kpro6"]["failed"] == 0

    def golden(name: str) -> str:
        return (GOLDEN / name).read_text().replace("<DEV>", str(dev))

    commands = [line for line in log.read_text().splitlines() if not line.startswith(("pct status", "pct exec"))]
    assert commands == golden("pct-commands.txt").splitlines()
    conf = (conf_dir / "200.conf").read_text()
    assert conf == golden("pve-200.conf")
    allow = re.findall(r"^lxc\.cgroup2?\.devices\.allow = (.*)$", conf, re.M)
    assert allow == [f"c {STANDIN_MAJOR}:* rwm"], "only the NVIDIA major from /proc/devices"

    log.write_text("")
    second, recap = run_playbook(inventory, "--limit", "kpro6", env=env, timeout=300)
    assert second.returncode == 0 and recap["kpro6"]["changed"] == 0, second.stdout[-3000:]
    assert all(line.startswith(("pct status", "pct exec")) for line in log.read_text().splitlines())
    assert (conf_dir / "200.conf").read_text() == conf


@pytest.mark.lxc
@pytest.mark.slow
@needs_lxc
def test_proxmox_backend_starts_a_real_container_through_the_pct_lxc_standin(tmp_path: Path) -> None:
    """The `proxmox` backend run against tests/pct_lxc_standin.py, a documented stand-in `pct`
    (no Proxmox here) that maps pct verbs onto real LXC and generates the LXC config from the
    emulated /etc/pve/lxc/<vmid>.conf, raw GPU block included. Real: Ansible, the role, LXC, the
    cached bookworm rootfs. Stand-ins: `pct`, the GPU nodes (major 195), /proc/devices.
    """
    vmid = "200"
    dev, proc_devices = make_standin_gpus(tmp_path, gpus=3)
    conf_dir, lxc_path, scratch, log = tmp_path / "pve-lxc", tmp_path / "lxc", tmp_path / "scratch", tmp_path / "pct.log"
    for path in (conf_dir, lxc_path, scratch):
        path.mkdir()
    template = cached_rootfs_tarball()
    install_pct_lxc_standin(tmp_path / "bin")
    inventory = write_inventory(tmp_path / "pve.yml", {"all": {"children": {
        "container_hosts": {"children": {"pve_hosts": {"hosts": {"localhost": {
            "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
            "lxc_container_backend": "proxmox", "lxc_container_pve_conf_dir": str(conf_dir),
            "gpu_host_require_gpu": False, "gpu_host_expected_gpus": 3,
            "gpu_host_proc_devices": str(proc_devices), "gpu_host_dev_dir": str(dev),
            "gpu_host_scratch_path": str(scratch), "gpu_host_scratch_must_be_mountpoint": False,
        }}}}},
        "gpu_containers": {"children": {"localhost_containers": {
            "vars": {"container_host": "localhost"},
            "hosts": {"pve-ct": {"ct_vmid": int(vmid), "ct_hostname": "trainer-standin",
                                 "ct_template": f"local:vztmpl/{template.name}", "ct_rootfs_storage": "local",
                                 "ct_cores": 2, "ct_memory_mb": 2048, "ct_gpus": [0, 1],
                                 "ct_scratch_host_path": str(scratch), "ct_scratch_mount": "/scratch"}},
        }}},
    }}})
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "PCT_LOG": str(log), "PCT_CONF_DIR": str(conf_dir),
           "PCT_LXC_PATH": str(lxc_path), "PCT_TEMPLATE_DIR": str(template.parent),
           "PCT_INIT_CMD": "/bin/sleep infinity"}  # the minimal test rootfs has no systemd

    def pct(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["pct", *args], capture_output=True, text=True, timeout=120, check=check,
                              env={**os.environ, **env})

    try:
        first, recap = run_playbook(inventory, "--limit", "localhost", env=env, timeout=600)
        assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-2000:]
        assert recap["localhost"]["failed"] == 0 and recap["localhost"]["changed"] > 0
        calls = log.read_text().splitlines()
        assert calls[0].startswith(f"pct create {vmid} local:vztmpl/{template.name} --hostname trainer-standin")
        assert f"pct set {vmid} --mp0 {scratch},mp=/scratch" in calls and f"pct start {vmid}" in calls

        assert pct("status", vmid).stdout.strip() == "status: running"
        assert subprocess.run(["lxc-info", "-P", str(lxc_path), "-n", vmid, "-s", "-H"], capture_output=True,
                              text=True, check=True).stdout.strip() == "RUNNING"
        lxc_config = (lxc_path / vmid / "config").read_text()
        assert f"lxc.rootfs.path = dir:{lxc_path / vmid / 'rootfs'}" in lxc_config.splitlines()
        assert f"lxc.mount.entry = {dev}/nvidia0 dev/nvidia0 none bind,optional,create=file" in lxc_config
        (lxc_path / vmid / "rootfs" / "etc" / "launch-rootfs-marker").write_text(vmid)
        assert pct("exec", vmid, "--", "cat", "/etc/launch-rootfs-marker").stdout == vmid  # its own rootfs
        assert pct("exec", vmid, "--", "hostname").stdout.strip() == "trainer-standin"

        nodes = pct("exec", vmid, "--", "stat", "-c", "%n %F %t", "/dev/nvidia0", "/dev/nvidia1", "/dev/nvidiactl",
                    "/dev/nvidia-uvm", "/dev/nvidia-caps/nvidia-cap1").stdout.splitlines()
        assert [line.rsplit(" ", 1)[1] for line in nodes] == [f"{STANDIN_MAJOR:x}"] * 5, nodes
        assert all("character special file" in line for line in nodes), nodes
        assert pct("exec", vmid, "--", "test", "-e", "/dev/nvidia2", check=False).returncode != 0  # not in ct_gpus
        # The raw cgroup2 allow line reached LXC: opening gets to the (absent) driver, ENXIO, not EPERM.
        probe = pct("exec", vmid, "--", "python3", "-c", "open('/dev/nvidia0', 'rb')", check=False)
        assert "No such device or address" in probe.stderr, probe.stderr
        pct("exec", vmid, "--", "sh", "-c", "echo hi > /scratch/probe")
        assert (scratch / "probe").read_text() == "hi\n"

        log.write_text("")
        second, recap = run_playbook(inventory, "--limit", "localhost", env=env, timeout=600)
        assert second.returncode == 0 and recap["localhost"]["changed"] == 0, second.stdout[-3000:]
        assert all(line.startswith(("pct status", "pct exec")) for line in log.read_text().splitlines())
    finally:
        pct("destroy", vmid, check=False)
        destroy_container(lxc_path, vmid)


# --- the project wheel python_env installs ----------------------------------------------------

PROJECT_WHEEL = ANSIBLE_DIR / "tools" / "project_wheel.py"


def test_project_wheel_hash_follows_the_sources_and_the_build_is_cached(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for name in ("launch", "train", "toolkit"):
        shutil.copytree(ANSIBLE_DIR.parent / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(ANSIBLE_DIR.parent / name, src / name)

    def tool(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, str(PROJECT_WHEEL), *args], capture_output=True, text=True, timeout=300)

    before = tool("hash", str(src)).stdout.strip()
    assert re.fullmatch(r"[0-9a-f]{64}", before)
    (src / "launch" / "__pycache__").mkdir(exist_ok=True)
    (src / "launch" / "__pycache__" / "x.pyc").write_bytes(b"bytecode")
    assert tool("hash", str(src)).stdout.strip() == before, "bytecode is not a source"
    wheel = Path(tool("build", str(src), str(tmp_path / "cache")).stdout.strip())
    assert wheel.parent.name == before and wheel.name.endswith("-py3-none-any.whl")
    assert not (src / "build").exists() and not list(src.glob("*.egg-info")), "built from a copy"
    import zipfile
    names = zipfile.ZipFile(wheel).namelist()
    assert "launch/keepalive/cli.py" in names and "launch/keepalive/slurm-hook.sh" in names and "train/__init__.py" in names
    assert "toolkit/fsutil.py" in names
    mtime = wheel.stat().st_mtime_ns
    assert tool("build", str(src), str(tmp_path / "cache")).stdout.strip() == str(wheel)
    assert wheel.stat().st_mtime_ns == mtime, "a cached wheel is not rebuilt"
    (src / "launch" / "errors.py").write_text((src / "launch" / "errors.py").read_text() + "# changed\n")
    assert tool("hash", str(src)).stdout.strip() != before
    bad = tool("hash", str(tmp_path / "nowhere"))
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "Traceback" not in bad.stderr


# --- real LXC container -----------------------------------------------------------------------

class Provisioned:
    """A provisioned container and the results of the runs against it."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.name = f"launch-test-{os.getpid()}"
        self.lxc_path = root / "lxc"
        self.scratch = root / "scratch"
        self.munge_key = base64.b64encode(os.urandom(64)).decode()
        self.runs: dict[str, tuple[subprocess.CompletedProcess[str], dict, float]] = {}

    def run(self, label: str, *args: str) -> tuple[subprocess.CompletedProcess[str], dict, float]:
        start = time.monotonic()
        proc, recap = run_playbook(self.inventory, *args)
        self.runs[label] = (proc, recap, time.monotonic() - start)
        return self.runs[label]

    def attach(self, script: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return lxc_attach(self.lxc_path, self.name, script, check=check)


@pytest.fixture(scope="module")
def provisioned(tmp_path_factory: pytest.TempPathFactory):
    if not (IS_ROOT and HAS_LXC):
        pytest.skip("needs root and Debian's lxc + debootstrap")
    ct = Provisioned(tmp_path_factory.mktemp("lxc-provision"))
    ct.lxc_path.mkdir()
    ct.scratch.mkdir()
    dev, proc_devices = make_standin_gpus(ct.root, gpus=3)
    ct.dev = dev
    ct.inventory = write_inventory(ct.root / "inventory.yml", lxc_inventory(
        ct.root, name=ct.name, lxc_path=ct.lxc_path, dev=dev, proc_devices=proc_devices,
        scratch=ct.scratch, template=cached_rootfs_tarball(), gpus=[0, 1], expected_gpus=3,
        munge_key_b64=ct.munge_key,
    ))
    try:
        ct.run("first")
        yield ct
    finally:
        destroy_container(ct.lxc_path, ct.name)


def _assert_ok(run: tuple[subprocess.CompletedProcess[str], dict, float]) -> dict:
    proc, recap, _ = run
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert all(host["failed"] == 0 and host["unreachable"] == 0 for host in recap.values()), recap
    return recap


@pytest.mark.lxc
@pytest.mark.slow
def test_first_run_provisions_the_container(provisioned: Provisioned) -> None:
    recap = _assert_ok(provisioned.runs["first"])
    assert recap[provisioned.name]["changed"] > 0 and recap["localhost"]["changed"] > 0


@pytest.mark.lxc
@pytest.mark.slow
def test_container_runs_on_its_own_rootfs_not_the_hosts(provisioned: Provisioned) -> None:
    rootfs = provisioned.lxc_path / provisioned.name / "rootfs"
    (rootfs / "etc" / "launch-rootfs-marker").write_text(provisioned.name)
    assert provisioned.attach("cat /etc/launch-rootfs-marker").stdout == provisioned.name
    assert provisioned.attach(f"test -e {ANSIBLE_DIR}", check=False).returncode != 0  # the host's files
    for path in ("etc/slurm/slurm.conf", "etc/profile.d/launch-caches.sh", "opt/launch/venv/bin/python"):
        assert (rootfs / path).exists(), path


@pytest.mark.lxc
@pytest.mark.slow
def test_gpu_block_has_only_nvidia_majors_and_the_chosen_nodes(provisioned: Provisioned) -> None:
    config = (provisioned.lxc_path / provisioned.name / "config").read_text()
    block = config.split("# BEGIN launch managed: gpu passthrough\n")[1].split("# END launch managed: gpu passthrough")[0]
    allow = re.findall(r"^(lxc\.cgroup2?\.devices\.allow) = (.*)$", block, re.M)
    assert allow == [("lxc.cgroup.devices.allow", f"c {STANDIN_MAJOR}:* rwm"),
                     ("lxc.cgroup2.devices.allow", f"c {STANDIN_MAJOR}:* rwm")]
    assert "*:* rwm" not in config
    dev = provisioned.dev
    assert set(re.findall(r"^lxc\.mount\.entry = (.*)$", block, re.M)) == {
        f"{dev}/nvidia0 dev/nvidia0 none bind,optional,create=file",
        f"{dev}/nvidia1 dev/nvidia1 none bind,optional,create=file",  # ct_gpus [0, 1]: not nvidia2
        f"{dev}/nvidiactl dev/nvidiactl none bind,optional,create=file",
        f"{dev}/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file",
        f"{dev}/nvidia-caps dev/nvidia-caps none bind,optional,create=dir",
    }
    assert config.count("# BEGIN launch managed: gpu passthrough") == 1


@pytest.mark.lxc
@pytest.mark.slow
def test_gpu_nodes_inside_have_major_195_and_the_cgroup_lets_them_open(provisioned: Provisioned) -> None:
    out = provisioned.attach("stat -c '%n %t' /dev/nvidia0 /dev/nvidia1 /dev/nvidiactl /dev/nvidia-caps/nvidia-cap1").stdout
    assert [line.split()[1] for line in out.splitlines()] == [f"{STANDIN_MAJOR:x}"] * 4
    assert provisioned.attach("test -e /dev/nvidia2", check=False).returncode != 0
    # The device cgroup allows major 195: opening reaches the (absent) driver, ENXIO, not EPERM.
    probe = provisioned.attach("python3 -c 'open(\"/dev/nvidia0\", \"rb\")'", check=False)
    assert "No such device or address" in probe.stderr, probe.stderr


@pytest.mark.lxc
@pytest.mark.slow
def test_c_extension_compiles_inside(provisioned: Provisioned) -> None:
    script = r"""set -e
    cd "$(mktemp -d)"
    printf '#include <Python.h>\nstatic struct PyModuleDef m = {PyModuleDef_HEAD_INIT, "tiny", NULL, -1, NULL};\nPyMODINIT_FUNC PyInit_tiny(void) { return PyModule_Create(&m); }\n' > tiny.c
    gcc -shared -fPIC $(python3 -c 'import sysconfig; print("-I" + sysconfig.get_paths()["include"])') tiny.c \
        -o tiny$(python3 -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    python3 -c 'import tiny; print("imported", tiny.__name__)'
    """
    assert "imported tiny" in provisioned.attach(script).stdout


@pytest.mark.lxc
@pytest.mark.slow
def test_caches_point_at_local_scratch(provisioned: Provisioned) -> None:
    env = provisioned.attach(". /etc/profile.d/launch-caches.sh; env").stdout
    values = dict(line.split("=", 1) for line in env.splitlines() if "=" in line)
    for name, leaf in [("TRITON_CACHE_DIR", "triton"), ("HF_HOME", "huggingface"),
                       ("TORCHINDUCTOR_CACHE_DIR", "torchinductor"), ("XDG_CACHE_HOME", "xdg")]:
        assert values[name] == f"/scratch/cache/root/{leaf}"
    fstype = provisioned.attach("findmnt -n -o FSTYPE --target /scratch/cache").stdout.strip()
    assert fstype and fstype not in {"nfs", "nfs4", "lustre", "gpfs", "beegfs", "cifs"}
    provisioned.attach("mkdir -p /scratch/cache/root/triton && echo hi > /scratch/cache/root/triton/probe")
    assert (provisioned.scratch / "cache" / "root" / "triton" / "probe").read_text() == "hi\n"


@pytest.mark.lxc
@pytest.mark.slow
def test_slurm_config_and_keepalive_hooks_inside(provisioned: Provisioned) -> None:
    from launch.keepalive.systemd import render_unit

    slurm_conf = provisioned.attach("cat /etc/slurm/slurm.conf").stdout
    assert "launch/cluster/templates" in slurm_conf.splitlines()[0]  # the embedded cluster's template
    assert re.search(rf"^NodeName={provisioned.name} CPUs=2 RealMemory=1945 Gres=gpu:2 State=UNKNOWN$", slurm_conf, re.M)
    assert "Prolog=/etc/slurm/launch-keepalive-prolog" in slurm_conf.splitlines()
    assert "Epilog=/etc/slurm/launch-keepalive-epilog" in slurm_conf.splitlines()
    assert "TaskProlog=/etc/slurm/launch-task-prolog.sh" in slurm_conf.splitlines()
    gres = provisioned.attach("cat /etc/slurm/gres.conf").stdout
    assert f"NodeName={provisioned.name} Name=gpu File=/dev/nvidia0,/dev/nvidia1" in gres.splitlines()
    task_env = provisioned.attach("SLURM_JOB_USER=alice /etc/slurm/launch-task-prolog.sh").stdout
    assert "export TRITON_CACHE_DIR=/scratch/cache/alice/triton" in task_env.splitlines()
    hook = (ANSIBLE_DIR.parent / "launch" / "keepalive" / "slurm-hook.sh").read_text()
    for name in ("launch-keepalive-prolog", "launch-keepalive-epilog"):
        assert provisioned.attach(f"cat /etc/slurm/{name}").stdout == hook
    assert "LAUNCH_KEEPALIVE_PYTHON=/opt/launch/venv/bin/python" in provisioned.attach("cat /etc/default/launch-keepalive").stdout
    unit = provisioned.attach("cat /etc/systemd/system/launch-keepalive.service").stdout
    unit_body = "\n".join(line for line in unit.splitlines() if not line.startswith("# Ansible managed")
                          and not line.startswith("# Same text as")) + "\n"
    assert unit_body == render_unit("/opt/launch/venv/bin/python")
    key = provisioned.attach("stat -c '%a %U' /etc/munge/munge.key; base64 -w0 /etc/munge/munge.key").stdout.split("\n")
    assert key[0] == "400 root" and key[1] == provisioned.munge_key
    proc, _, _ = provisioned.runs["first"]
    assert provisioned.munge_key not in proc.stdout + proc.stderr  # no_log


@pytest.mark.lxc
@pytest.mark.slow
def test_project_is_installed_in_the_venv_the_keepalive_runs(provisioned: Provisioned) -> None:
    """python_env installs `launch` and `train` (a wheel built on the controller, --no-deps, offline):
    the keepalive unit and the Slurm hooks run `<venv>/bin/python -m launch.keepalive.cli`."""
    from launch.keepalive.systemd import render_unit

    venv_python = "/opt/launch/venv/bin/python"
    assert provisioned.attach(f"cd / && {venv_python} -m launch.keepalive.cli unit").stdout == render_unit(venv_python)
    paths = provisioned.attach(f"cd / && {venv_python} -c 'import launch, train; print(launch.__file__, train.__file__)'")
    assert all(path.startswith("/opt/launch/venv/lib/python3.") and "/site-packages/" in path
               for path in paths.stdout.split()), paths.stdout
    wanted = subprocess.run([sys.executable, str(ANSIBLE_DIR / "tools" / "project_wheel.py"), "hash", str(ANSIBLE_DIR.parent)],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert provisioned.attach("cat /opt/launch/venv/launch-project.sha256").stdout.strip() == wanted


@pytest.mark.lxc
@pytest.mark.slow
def test_second_run_changes_nothing(provisioned: Provisioned) -> None:
    recap = _assert_ok(provisioned.run("second"))
    assert {host: counts["changed"] for host, counts in recap.items()} == {"localhost": 0, provisioned.name: 0}


@pytest.mark.lxc
@pytest.mark.slow
def test_check_mode_on_the_provisioned_container_reports_no_change(provisioned: Provisioned) -> None:
    recap = _assert_ok(provisioned.run("check", "--check", "--diff"))
    assert {host: counts["changed"] for host, counts in recap.items()} == {"localhost": 0, provisioned.name: 0}


@pytest.mark.lxc
@pytest.mark.slow
def test_node_caches_refuses_a_network_file_system(provisioned: Provisioned, tmp_path: Path) -> None:
    """The fs-type check, with the container's real scratch fs type declared forbidden (no NFS here)."""
    fstype = provisioned.attach("findmnt -n -o FSTYPE --target /scratch").stdout.strip()
    play = tmp_path / "caches.yml"
    play.write_text(f"- hosts: {provisioned.name}\n  gather_facts: false\n  roles: [node_caches]\n")
    proc, recap = run_playbook(provisioned.inventory, "-e", f'{{"node_caches_forbidden_fstypes": ["{fstype}"]}}',
                               playbook=play)
    assert proc.returncode != 0 and recap[provisioned.name]["failed"] == 1
    assert f"node_caches_root=/scratch/cache is on {fstype}, a network file system" in proc.stdout


def test_make_provision_limits_to_the_host_and_its_containers() -> None:
    venv = str(Path(sys.executable).parent.parent)

    def dry_run(*args: str) -> str:
        return subprocess.run(["make", "-n", "provision", *args, f"VENV={venv}"], cwd=ANSIBLE_DIR.parent,
                              capture_output=True, text=True, timeout=60, check=True).stdout

    checked = dry_run("host=kpro6", "check=1")
    assert "check_inventory.py --quiet --limit 'kpro6' 'ansible/inventory/kpro6.yml'" in checked
    assert "--limit 'kpro6:kpro6_containers' --check --diff" in checked
    assert "--check" not in dry_run("host=kpro6")
    assert "-i 'ansible/inventory/local.yml'" in dry_run("host=localhost")
