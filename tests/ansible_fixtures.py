"""Fixtures for the Ansible tests: a cached Debian rootfs, stand-in GPU nodes, a `pct` stand-in.

The rootfs (minbase plus python3 and python3-apt, which Ansible's apt module needs) is built once with debootstrap and cached as a .tar.zst under $LAUNCH_CACHE (or
~/.cache/launch-tests). The test container has no network (`lxc.net.0.type = empty`), so the
cache build also runs `apt-get update` and `apt-get install --download-only` for the small
package set the roles install in tests, inside the rootfs through chroot: apt inside the
container then installs them for real, from its own local archive, with no mirror access.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

from images.rootfs import BaseSpec, cached_base_rootfs, debian_mirror  # noqa: F401 -- re-exported
from images.rootfs import cache_dir as rootfs_cache_dir

SUITE = "bookworm"
# The packages the roles install in the tests (toolchain's and python_env's small test set; systemd-sysv
# for the image test flavour, which boots systemd).
TEST_APT_PACKAGES = ("gcc", "libc6-dev", "python3-dev", "python3-venv", "systemd-sysv")


def cache_dir() -> Path:
    return rootfs_cache_dir()


# The test rootfs; `make image`'s test flavour (images/trainer/image.yml) names the same spec.
TEST_BASE = BaseSpec(suite=SUITE, variant="minbase", include=("python3", "python3-apt"), download=TEST_APT_PACKAGES)


# The unprivileged-CT Slurm test's rootfs: the same, plus Debian's Slurm, munge and dbus (what
# the slurm role installs on a node and controller), downloaded for an offline apt inside.
SLURM_APT_PACKAGES = ("slurmd", "slurmctld", "slurm-client", "munge", "dbus")
TEST_SLURM_BASE = BaseSpec(suite=SUITE, variant="minbase", include=("python3", "python3-apt"),
                           download=TEST_APT_PACKAGES + SLURM_APT_PACKAGES)

# The KVM guest's CT (tests/test_kvm_guest_ct.py): a CT that boots systemd as its init (systemd-sysv
# and dbus installed), with slurmdbd and MariaDB beside Slurm and munge in its offline apt archive.
ACCOUNTING_APT_PACKAGES = ("slurmdbd", "mariadb-server", "mariadb-client")
TEST_SYSTEMD_SLURM_BASE = BaseSpec(suite=SUITE, variant="minbase",
                                   include=("python3", "python3-apt", "systemd-sysv", "dbus"),
                                   download=TEST_APT_PACKAGES + SLURM_APT_PACKAGES + ACCOUNTING_APT_PACKAGES)


def cached_rootfs_tarball(spec: BaseSpec = TEST_BASE) -> Path:
    """Path of the cached rootfs tarball, building it (about a minute) when absent."""
    return cached_base_rootfs(spec, cache_dir())


REPO = Path(__file__).resolve().parents[1]
ANSIBLE_DIR = REPO / "ansible"
PLAYBOOK = ANSIBLE_DIR / "playbooks" / "provision.yml"
CHECK_INVENTORY = ANSIBLE_DIR / "tools" / "check_inventory.py"
# The stand-in NVIDIA major. A real host's majors come from /proc/devices; this machine has no
# NVIDIA driver, so the tests give gpu_host a stand-in /proc/devices that lists 195 (the
# number the NVIDIA driver registers for nvidia-frontend) among ordinary devices.
STANDIN_MAJOR = 195
STANDIN_PROC_DEVICES = f"""Character devices:
  1 mem
  4 /dev/vc/0
  5 /dev/tty
 10 misc
{STANDIN_MAJOR} nvidia-frontend
226 drm

Block devices:
  8 sd
259 blkext
"""
RECAP = re.compile(r"^(\S+)\s*: ok=(\d+)\s+changed=(\d+)\s+unreachable=(\d+)\s+failed=(\d+)", re.M)


def ansible_bin(name: str) -> str:
    """An Ansible executable from the interpreter's own venv (the project's `provision` extra)."""
    candidate = Path(sys.executable).parent / name
    return str(candidate) if candidate.exists() else name


def make_standin_gpus(root: Path, gpus: int) -> tuple[Path, Path]:
    """Stand-in device nodes (major 195, made with mknod; root only) and a stand-in /proc/devices.

    Returns (dev_dir, proc_devices). dev_dir holds nvidia0..N-1, nvidiactl, nvidia-uvm and an
    nvidia-caps directory, like a real GPU host's /dev.
    """
    dev = root / "dev"
    (dev / "nvidia-caps").mkdir(parents=True)
    nodes = {f"nvidia{i}": i for i in range(gpus)} | {"nvidiactl": 255, "nvidia-uvm": 254,
                                                       "nvidia-caps/nvidia-cap1": 1}
    for name, minor in nodes.items():
        os.mknod(dev / name, 0o666 | stat.S_IFCHR, os.makedev(STANDIN_MAJOR, minor))
    # As nvidia-modprobe makes it on a real host: the MIG config capability is root-only.
    (dev / "nvidia-caps" / "nvidia-cap1").chmod(0o400)
    proc_devices = root / "proc-devices"
    proc_devices.write_text(STANDIN_PROC_DEVICES)
    return dev, proc_devices


def write_inventory(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def write_vaulted_vars(path: Path, variables: dict, password_file: Path) -> Path:
    """An ansible-vault encrypted vars file (real ansible-vault), as secrets are kept in group_vars."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(variables))
    path.chmod(0o600)
    subprocess.run([ansible_bin("ansible-vault"), "encrypt", "--vault-password-file", str(password_file), str(path)],
                   check=True, capture_output=True, timeout=60)
    return path


def run_playbook(inventory: Path, *args: str, playbook: Path = PLAYBOOK, timeout: int = 600,
                 env: dict[str, str] | None = None) -> tuple[subprocess.CompletedProcess[str], dict[str, dict[str, int]]]:
    """Run ansible-playbook the way `make provision` does; returns the process and the recap per host."""
    full_env = {**os.environ, "ANSIBLE_CONFIG": str(ANSIBLE_DIR / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
                "ANSIBLE_FORCE_COLOR": "0", "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run([ansible_bin("ansible-playbook"), "-i", str(inventory), *args, str(playbook)],
                          capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)
    recap = {m[0]: {"ok": int(m[1]), "changed": int(m[2]), "unreachable": int(m[3]), "failed": int(m[4])}
             for m in RECAP.findall(proc.stdout)}
    return proc, recap


def lxc_inventory(tmp: Path, *, name: str, lxc_path: Path, dev: Path, proc_devices: Path, scratch: Path,
                  template: Path, gpus: list[int], expected_gpus: int) -> dict:
    """The inventory of inventory/local.yml's shape, for a throwaway container in tmp. The munge
    key is not in it: it goes in an ansible-vault file, as the README says (`write_vaulted_vars`).

    Small package sets (toolchain: gcc, libc6-dev, python3-dev; python_env: venv only) keep the
    run short; the container has no network, so apt installs from the .debs cached in the rootfs.
    """
    return {"all": {"children": {
        "container_hosts": {"children": {"lxc_hosts": {"hosts": {"localhost": {
            "ansible_connection": "local",
            "ansible_python_interpreter": sys.executable,
            "lxc_container_backend": "lxc",
            "lxc_container_lxc_path": str(lxc_path),
            # The minimal test rootfs has no systemd; a sleeping init keeps the container up.
            "lxc_container_init_cmd": "/bin/sleep infinity",
            "gpu_host_require_gpu": False,
            "gpu_host_expected_gpus": expected_gpus,
            "gpu_host_proc_devices": str(proc_devices),
            "gpu_host_dev_dir": str(dev),
            "gpu_host_scratch_path": str(scratch),
            "gpu_host_scratch_must_be_mountpoint": False,
        }}}}},
        "gpu_containers": {"children": {"localhost_containers": {
            "vars": {
                "container_host": "localhost",
                "ansible_connection": "lxc_attach",
                "lxc_attach_lxc_path": str(lxc_path),
                "python_env_flavour": "cpu",
                "python_env_packages": [],
                "toolchain_packages": ["gcc", "libc6-dev", "python3-dev"],
                "toolchain_apt_update_cache": False,
                "slurm_install_packages": False,
                "slurm_manage_services": False,
                "slurm_munge_user": "root",
                "slurm_user": "root",  # no slurm user in the test rootfs (no Slurm packages)
                "slurm_job_users": [{"name": "alice", "uid": 1000}],
            },
            "hosts": {name: {
                "ct_unprivileged": False,  # the lxc backend makes privileged containers only
                "ct_template": str(template),
                "ct_cores": 2,
                "ct_memory_mb": 2048,
                "ct_gpus": gpus,
                "ct_scratch_host_path": str(scratch),
                "ct_scratch_mount": "/scratch",
                "node_caches_root": "/scratch/cache",
            }},
        }}},
        "slurm_controllers": {"hosts": {name: None}},
    }}}


def lxc_attach(lxc_path: Path, name: str, script: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run a shell script inside the container (as the lxc_attach connection does)."""
    return subprocess.run(
        ["lxc-attach", "-P", str(lxc_path), "-n", name, "--clear-env", "-v",
         "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "--", "/bin/sh", "-c", script],
        capture_output=True, text=True, check=check, timeout=120,
    )


# TEST STAND-IN for nvidia-smi inside the container (no GPU here): it lists as GPUs the
# /dev/nvidiaN nodes the container may open (the stand-in nodes answer ENXIO, "no driver", when
# the device cgroup lets them through, EPERM when it does not) and reports the userspace driver
# version written in /etc/nvidia-standin-version.
NVIDIA_SMI_STANDIN = """#!/usr/bin/python3
import errno, glob, os, sys
version = open("/etc/nvidia-standin-version").read().strip()
gpus = []
for node in sorted(glob.glob("/dev/nvidia[0-9]*"), key=lambda p: int(p[len("/dev/nvidia"):])):
    try:
        os.close(os.open(node, os.O_RDWR))
    except OSError as err:
        if err.errno != errno.ENXIO:
            continue
    gpus.append(int(node[len("/dev/nvidia"):]))
if "-L" in sys.argv:
    for i, gpu in enumerate(gpus):
        print(f"GPU {i}: NVIDIA H200 (UUID: GPU-standin-{gpu:04d})")
elif "--query-gpu=driver_version" in sys.argv:
    print("\\n".join([version] * len(gpus)))
else:
    sys.exit("nvidia-smi stand-in: only -L and --query-gpu=driver_version")
"""


# Job scripts the container tests run with srun: the probe opens each GPU Slurm gave the step
# (ENXIO: the device cgroup let it through; EPERM: not), the other prints what hides GPUs.
GPU_PROBE_JOB = ("import errno, os\n"
                 "gpus = os.environ.get('SLURM_STEP_GPUS') or os.environ.get('SLURM_JOB_GPUS') or ''\n"
                 "for g in gpus.split(','):\n"
                 "    try:\n"
                 "        open('/dev/nvidia' + g, 'rb')\n"
                 "    except OSError as e:\n"
                 "        print('open', g, errno.errorcode[e.errno])\n")
NO_GPU_JOB = "#!/bin/sh\nenv | grep -E '^(CUDA|NVIDIA)_VISIBLE_DEVICES=' | sort\n"


def install_nvidia_smi_standin(rootfs: Path, version: str) -> None:
    (rootfs / "usr" / "local" / "bin" / "nvidia-smi").write_text(NVIDIA_SMI_STANDIN)
    (rootfs / "usr" / "local" / "bin" / "nvidia-smi").chmod(0o755)
    (rootfs / "etc" / "nvidia-standin-version").write_text(version + "\n")


def destroy_container(lxc_path: Path, name: str) -> None:
    subprocess.run(["lxc-stop", "-P", str(lxc_path), "-n", name, "-k"], capture_output=True, check=False)
    subprocess.run(["lxc-destroy", "-P", str(lxc_path), "-n", name], capture_output=True, check=False)


# The stand-in `pct` and `pveversion` (tests/pct_lxc_standin.py; see its docstring): no Proxmox
# here. Without $PCT_LXC_PATH it keeps state only (command and config tests); with it, it runs
# real LXC containers.
PCT_LXC_STANDIN = Path(__file__).with_name("pct_lxc_standin.py")


def install_pct_standin(bin_dir: Path) -> Path:
    """Put `pct` and `pveversion` (tests/pct_lxc_standin.py, run by this interpreter) in bin_dir."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, extra in (("pct", ""), ("pveversion", " --pveversion")):
        tool = bin_dir / name
        tool.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{PCT_LXC_STANDIN}"{extra} "$@"\n')
        tool.chmod(0o755)
    return bin_dir / "pct"


install_pct_lxc_standin = install_pct_standin


# An unprivileged Proxmox CT, as the kernel sees it: a user namespace in which container uid/gid
# 0..65535 are host 100000..165535 (PVE's default `lxc.idmap: u 0 100000 65536`). Entered with
# LXC's own lxc-usernsexec (as root it writes the maps itself, no newuidmap needed). What it does
# not model: the CT's mount, pid and network namespaces, AppArmor, seccomp; file access, the
# bind mount's (unshifted) ownership and capabilities are the kernel's own.
PVE_IDMAP_BASE = 100000
HAS_USERNSEXEC = bool(shutil.which("lxc-usernsexec") and shutil.which("setpriv"))


def in_unprivileged_ct(argv: list[str], *, uid: int = 0, base: int = PVE_IDMAP_BASE, timeout: int = 60,
                       env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run argv as container uid `uid` (0: the CT's root) of an unprivileged CT mapped at `base`."""
    inner = argv if uid == 0 else ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--", *argv]
    return subprocess.run(["lxc-usernsexec", "-m", f"b:0:{base}:65536", "--", *inner],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def traversable_tmp_dir(prefix: str) -> Path:
    """A fresh 0755 directory under /tmp: pytest's own tmp_path sits below a 0700 root-owned
    directory that a mapped uid (host 100000) cannot even traverse. The caller removes it."""
    path = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    path.chmod(0o755)
    return path


def userns_python() -> tuple[str, dict[str, str]] | None:
    """An interpreter a mapped uid can run and the PYTHONPATH that gives it the repo and this venv's
    packages: this interpreter when every directory to it is world-traversable, else the system
    python3 of the same minor version. None when neither is reachable."""
    def reachable(path: Path) -> bool:
        return all(p.stat().st_mode & 0o001 for p in path.resolve().parents)
    paths = [str(REPO), *(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())]
    for python in (Path(sys.executable), Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")):
        if python.exists() and reachable(python) and all(reachable(Path(p) / "x") for p in paths):
            return str(python), {"PYTHONPATH": os.pathsep.join(paths)}
    return None
