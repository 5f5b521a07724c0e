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
import functools
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.ansible_fixtures import (
    ANSIBLE_DIR,
    CHECK_INVENTORY,
    HAS_USERNSEXEC,
    PLAYBOOK,
    PVE_IDMAP_BASE,
    STANDIN_MAJOR,
    ansible_bin,
    cached_rootfs_tarball,
    destroy_container,
    in_unprivileged_ct,
    install_nvidia_smi_standin,
    install_pct_lxc_standin,
    install_pct_standin,
    lxc_attach,
    lxc_inventory,
    make_standin_gpus,
    run_playbook,
    traversable_tmp_dir,
    write_inventory,
    write_vaulted_vars,
)
from tests.test_cpu_topology import epyc_lscpu

GOLDEN = Path(__file__).parent / "golden"
IS_ROOT = os.geteuid() == 0
HAS_LXC = all(shutil.which(tool) for tool in ("lxc-create", "lxc-start", "lxc-attach", "debootstrap"))
needs_root = pytest.mark.skipif(not IS_ROOT, reason="mknod of stand-in device nodes and LXC need root")
needs_userns = pytest.mark.skipif(not (IS_ROOT and HAS_USERNSEXEC),
                                  reason="needs root and lxc-usernsexec (LXC) + setpriv for a mapped user namespace")
needs_lxc = pytest.mark.skipif(not (IS_ROOT and HAS_LXC), reason="needs root and Debian's lxc + debootstrap")


def check_inventory(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECK_INVENTORY), str(path), *args],
                          capture_output=True, text=True, timeout=120)


# --- inventories ------------------------------------------------------------------------------

# A well-formed checksum for the userspace installer of the stand-in driver version (tests only:
# no installer is downloaded here).
USERSPACE_SHA = {"550.54.15": "ab" * 32}


def _with_userspace_sha(tmp_path: Path, name: str) -> Path:
    """A shipped inventory as its README says to complete it: the GPU containers get the
    installer's checksum for the host's driver (nvidia_userspace_sha256)."""
    import yaml

    data = yaml.safe_load((ANSIBLE_DIR / "inventory" / name).read_text())
    for group in data["all"]["children"]["gpu_containers"]["children"].values():
        for ct in group["hosts"].values():
            ct.setdefault("nvidia_userspace_sha256", USERSPACE_SHA)
    return write_inventory(tmp_path / name, data)


@pytest.mark.parametrize("name", ["kpro6.yml", "pve9.yml", "local.yml"])
def test_shipped_inventories_pass_the_check_and_the_syntax_check(tmp_path: Path, name: str) -> None:
    inventory = _with_userspace_sha(tmp_path, name)
    result = check_inventory(inventory)
    assert result.returncode == 0, result.stderr
    syntax = subprocess.run(
        [ansible_bin("ansible-playbook"), "-i", str(inventory), "--syntax-check", str(PLAYBOOK)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, "ANSIBLE_CONFIG": str(ANSIBLE_DIR / "ansible.cfg")},
    )
    assert syntax.returncode == 0, syntax.stdout + syntax.stderr


def test_a_gpu_container_venv_is_pinned_unless_the_inventory_says_otherwise(tmp_path: Path) -> None:
    """kpro6.yml installs CT 200's venv from the cp312 GPU lock. Without a lock or a wheelhouse the
    check refuses it (tests/badinputs: gpu-venv-unpinned); a wheelhouse, or
    python_env_allow_network_install: true on purpose, passes. A CPU container is not held to it."""
    import yaml

    data = yaml.safe_load(_with_userspace_sha(tmp_path, "kpro6.yml").read_text())
    ct = data["all"]["children"]["gpu_containers"]["children"]["kpro6_containers"]["hosts"]["kpro6-ct200"]
    group = data["all"]["children"]["gpu_containers"]["children"]["kpro6_containers"]["vars"]
    assert group["python_env_lock_file"].endswith("/images/trainer/requirements-gpu-cp312.lock")
    assert (ANSIBLE_DIR / "playbooks" / group["python_env_lock_file"].replace("{{ playbook_dir }}/", "")).is_file()
    del group["python_env_lock_file"]
    refused = check_inventory(write_inventory(tmp_path / "unpinned.yml", data))
    assert refused.returncode == 2 and "python_env_allow_network_install: true on purpose" in refused.stderr
    for name, changes in {"wheelhouse": {"python_env_wheelhouse": "build/wheelhouse/gpu-cp312"},
                          "on-purpose": {"python_env_allow_network_install": True},
                          "cpu": {"python_env_flavour": "cpu", "ct_gpus": []}}.items():
        variant = yaml.safe_load(yaml.safe_dump(data))
        variant["all"]["children"]["gpu_containers"]["children"]["kpro6_containers"]["hosts"]["kpro6-ct200"].update(
            changes)
        result = check_inventory(write_inventory(tmp_path / f"{name}.yml", variant))
        assert result.returncode == 0, (name, result.stderr)
    assert ct["ct_gpus"]


def test_shipped_kpro6_without_the_userspace_checksum_is_refused_with_the_command_that_prints_it(tmp_path: Path) -> None:
    """kpro6.yml as shipped has no nvidia_userspace_sha256: the play would change the host and the
    CT, then stop in nvidia_userspace. The check refuses it first, in one line giving the command
    that prints the checksum of the installer the role downloads (its first URL); with the host's
    driver version in the inventory, that command names the exact URL."""
    result = check_inventory(ANSIBLE_DIR / "inventory" / "kpro6.yml")
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.stderr
    assert lines[0].startswith("inventory error: kpro6-ct200: nvidia_userspace_sha256 is not set"), lines
    assert lines[0].endswith('v=$(ssh root@kpro6.lan cat /sys/module/nvidia/version) && echo "$v" && curl -fsSL '
                             '"https://us.download.nvidia.com/tesla/$v/NVIDIA-Linux-x86_64-$v.run" | sha256sum'), lines
    import yaml

    data = yaml.safe_load((ANSIBLE_DIR / "inventory" / "kpro6.yml").read_text())
    data["all"]["children"]["container_hosts"]["children"]["pve_hosts"]["hosts"]["kpro6"][
        "gpu_host_expected_driver_version"] = "570.172.08"
    ct = data["all"]["children"]["gpu_containers"]["children"]["kpro6_containers"]["hosts"]["kpro6-ct200"]
    ct["nvidia_userspace_sha256"] = USERSPACE_SHA  # another version's: still refused
    result = check_inventory(write_inventory(tmp_path / "pinned.yml", data))
    assert result.returncode == 2
    assert result.stderr.strip().endswith(
        "with what this prints: curl -fsSL https://us.download.nvidia.com/tesla/570.172.08/"
        "NVIDIA-Linux-x86_64-570.172.08.run | sha256sum"), result.stderr
    ct["nvidia_userspace_sha256"] = {"570.172.08": "cd" * 32}
    assert check_inventory(write_inventory(tmp_path / "pinned.yml", data)).returncode == 0
    ct["nvidia_userspace_install"] = False  # an image that brings its own userspace: nothing to download
    ct.pop("nvidia_userspace_sha256")
    assert check_inventory(write_inventory(tmp_path / "pinned.yml", data)).returncode == 0


def _kpro6_with(tmp_path: Path, **container_vars: object) -> Path:
    import yaml

    data = yaml.safe_load(_with_userspace_sha(tmp_path, "kpro6.yml").read_text())
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
        ({"ct_cores": None}, "ct_cores is missing; set the CT's cores (also slurm.conf's CPUs= for it)"),
        ({"lxc_container_nvidia_majors": ["*"]}, "lxc_container_nvidia_majors is read from the host's /proc/devices"),
        ({"lxc_container_nvidia_majors": [1]}, "lxc_container_nvidia_majors is read from the host's /proc/devices"),
        ({"lxc_container_nvidia_majors": "a *:* rwm"}, "lxc_container_nvidia_majors is read from the host's /proc/devices"),
        ({"ct_unprivileged": "maybe"}, "ct_unprivileged='maybe' is not a boolean"),
        ({"ct_cpuset": "0-15,socket1"}, "ct_cpuset='0-15,socket1' is not a CPU list of the host"),
        ({"slurm_cgroup_ignore_systemd": True}, "slurm_cgroup_ignore_systemd was removed: IgnoreSystemd=yes cannot "
                                                "start slurmd in a CT"),
    ],
)
def test_bad_inventory_fails_early_with_one_line(tmp_path: Path, change: dict, names: str) -> None:
    result = check_inventory(_kpro6_with(tmp_path, **change))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0], result.stderr
    assert lines[0].startswith("inventory error: kpro6-ct200: ")
    assert "Traceback" not in result.stderr and result.stdout == ""


def test_a_node_whose_template_ships_another_slurm_release_than_the_controllers_is_refused(tmp_path: Path) -> None:
    """A second PVE host's CT on Debian 13 (Slurm 24.11) under kpro6's controller (Ubuntu 24.04,
    23.11): refused by the inventory check, also with --limit naming the second host only (the
    controller is not in that run, its facts never exist there)."""
    import yaml

    data = yaml.safe_load(_with_userspace_sha(tmp_path, "kpro6.yml").read_text())
    kpro6 = data["all"]["children"]["container_hosts"]["children"]["pve_hosts"]["hosts"]["kpro6"]
    data["all"]["children"]["container_hosts"]["children"]["pve_hosts"]["hosts"]["kpro7"] = {**kpro6,
                                                                                              "ansible_host": "kpro7.lan"}
    containers = data["all"]["children"]["gpu_containers"]["children"]
    ct = containers["kpro6_containers"]["hosts"]["kpro6-ct200"]
    containers["kpro7_containers"] = {"vars": {**containers["kpro6_containers"]["vars"], "container_host": "kpro7"},
                                      "hosts": {"kpro7-ct300": {**ct, "ct_vmid": 300, "proxmox_vmid": 300,
                                                                "ct_hostname": "trainer300"}}}
    same = write_inventory(tmp_path / "same.yml", data)
    assert check_inventory(same, "--limit", "kpro7").returncode == 0, check_inventory(same, "--limit", "kpro7").stderr
    containers["kpro7_containers"]["hosts"]["kpro7-ct300"]["ct_template"] = \
        "nvme-scratch:vztmpl/debian-13-standard_13.1-2_amd64.tar.zst"
    other = write_inventory(tmp_path / "other.yml", data)
    for args in ((), ("--limit", "kpro7")):
        result = check_inventory(other, *args)
        assert result.returncode == 2 and result.stderr.strip().startswith(
            "inventory error: kpro7-ct300: ct_template nvme-scratch:vztmpl/debian-13-standard_13.1-2_amd64.tar.zst "
            "ships Slurm 24.11, but the controller kpro6-ct200's ships 23.11"), result.stderr


def test_unparsable_inventory_is_one_line(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yml"
    broken.write_text("all: [this is: not an inventory\n")
    result = check_inventory(broken)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr


def test_check_reads_a_vaulted_munge_key_and_refuses_a_plain_one(tmp_path: Path) -> None:
    """The documented place of the munge key, an ansible-vault file in group_vars: the check reads
    it with the password file Ansible's own config names, says how when none is given, and
    refuses the key in plain text. Real ansible-vault encryption."""
    inventory = _kpro6_with(tmp_path)
    secrets = tmp_path / "group_vars" / "gpu_containers" / "vault.yml"
    secrets.parent.mkdir(parents=True)
    secrets.write_text("slurm_munge_key_b64: c2VjcmV0\n")
    password = tmp_path / "vault-password"
    password.write_text("correct horse\n")
    subprocess.run([ansible_bin("ansible-vault"), "encrypt", "--vault-password-file", str(password), str(secrets)],
                   check=True, capture_output=True, timeout=60)
    assert secrets.read_bytes().startswith(b"$ANSIBLE_VAULT")
    env = {**os.environ, "ANSIBLE_VAULT_PASSWORD_FILE": str(password)}
    ok = subprocess.run([sys.executable, str(CHECK_INVENTORY), str(inventory)], capture_output=True, text=True,
                        timeout=120, env=env)
    assert ok.returncode == 0, ok.stderr
    no_password = check_inventory(inventory)
    assert no_password.returncode == 2 and "set ANSIBLE_VAULT_PASSWORD_FILE" in no_password.stderr
    assert len(no_password.stderr.strip().splitlines()) == 1
    secrets.write_text("slurm_munge_key_b64: c2VjcmV0\n")  # the same key, not encrypted
    plain = check_inventory(inventory)
    assert plain.returncode == 2 and "slurm_munge_key_b64 is a secret in plain text (vault.yml line 1)" in plain.stderr


def test_playbook_refuses_a_bad_inventory_before_touching_hosts(tmp_path: Path) -> None:
    inventory = _kpro6_with(tmp_path, ct_vmid=None)
    proc, recap = run_playbook(inventory, "--limit", "kpro6:kpro6_containers", timeout=300)
    assert proc.returncode != 0
    assert "inventory error: kpro6-ct200: ct_vmid is missing" in proc.stdout
    assert "TASK [gpu_host" not in proc.stdout  # stopped in the first play


# --- proxmox backend (pct stand-in) -----------------------------------------------------------

class PveHost:
    """kpro6.yml run against the state-only `pct` stand-in (tests/pct_lxc_standin.py) on this
    machine: stand-in GPU nodes (major 195), /proc/devices, storage.cfg and PVE version."""

    def __init__(self, tmp_path: Path, gpus: int = 8, pve_version: str = "8.2.4", scratch: Path | None = None,
                 **container_vars: object) -> None:
        import yaml

        self.tmp = tmp_path
        # The host's NVMe scratch (kpro6.yml: /mnt/nvme-scratch, gpu_host_scratch_path and ct_scratch_host_path),
        # created by gpu_host (no mount point needed here) and given to the CT's root by lxc_container.
        self.scratch = scratch or tmp_path / "nvme-scratch"
        self.dev, proc_devices = make_standin_gpus(tmp_path, gpus=gpus)
        self.conf_dir, self.log = tmp_path / "pve-lxc", tmp_path / "pct.log"
        self.conf_dir.mkdir()
        self.conf = self.conf_dir / "200.conf"
        # The host's CPUs (2 sockets of 64 cores, 2 threads each, numbered as on an EPYC host) and
        # its GPUs' NUMA nodes (the driver's per-GPU directory, the PCI devices' numa_node):
        # GPUs 0-3 on socket 0, the others on socket 1.
        lscpu, gpus_dir, pci_dir = tmp_path / "lscpu.txt", tmp_path / "nvidia-gpus", tmp_path / "pci"
        lscpu.write_text(epyc_lscpu())
        for minor in range(gpus):
            addr = f"0000:{0x10 + minor:02x}:00.0"
            (gpus_dir / addr).mkdir(parents=True)
            (gpus_dir / addr / "information").write_text(f"Model: \t\t NVIDIA H200\nDevice Minor: \t {minor}\n")
            (pci_dir / addr).mkdir(parents=True)
            (pci_dir / addr / "numa_node").write_text(f"{0 if minor < 4 else 1}\n")
        self.topology_dir = tmp_path / "topology"
        storage_cfg = tmp_path / "storage.cfg"
        storage_cfg.write_text("dir: local\n\tpath /var/lib/vz\n\tcontent vztmpl,iso\n\n"
                               "lvmthin: local-lvm\n\tthinpool data\n\tvgname pve\n\tcontent rootdir,images\n")
        install_pct_standin(tmp_path / "bin")
        data = yaml.safe_load((ANSIBLE_DIR / "inventory" / "kpro6.yml").read_text())
        data["all"]["children"]["container_hosts"]["children"]["pve_hosts"]["hosts"]["kpro6"].update({
            "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
            "gpu_host_proc_devices": str(proc_devices), "gpu_host_dev_dir": str(self.dev),
            "gpu_host_scratch_path": str(self.scratch), "gpu_host_scratch_must_be_mountpoint": False,
            "lxc_container_pve_conf_dir": str(self.conf_dir), "lxc_container_pve_storage_cfg": str(storage_cfg),
            "lxc_container_pending_dir": str(tmp_path / "pending"),
            "lxc_container_lscpu_argv": ["cat", str(lscpu)], "lxc_container_nvidia_gpus_dir": str(gpus_dir),
            "lxc_container_pci_devices_dir": str(pci_dir), "lxc_container_topology_dir": str(self.topology_dir),
            # NVIDIA's redistrib file is not reachable from a test: a closed local port answers at once.
            "gpu_host_fabricmanager_redistrib_url": "http://127.0.0.1:9/redistrib_{version}.json",
        })
        ct = data["all"]["children"]["gpu_containers"]["children"]["kpro6_containers"]["hosts"]["kpro6-ct200"]
        ct.update({"ct_scratch_host_path": str(self.scratch), "nvidia_userspace_sha256": USERSPACE_SHA,
                   **container_vars})
        self.data = data
        self.inventory = write_inventory(tmp_path / "kpro6.yml", data)
        # `pct exec` "inside" the state-only CT finds these stand-ins: squeue prints the ids in
        # self.jobs, the jobs Slurm runs on the node (none while the file is empty), or fails as
        # with an unreachable controller while self.controller_down exists; pgrep finds a
        # slurmstepd while self.steps is not empty.
        self.jobs, self.controller_down, self.steps = tmp_path / "ct-jobs", tmp_path / "ct-controller-down", tmp_path / "ct-steps"
        ct_tools = tmp_path / "ct-bin"
        self.jobs.write_text("")
        self.steps.write_text("")
        ct_tools.mkdir()
        (ct_tools / "squeue").write_text(
            f"#!/bin/sh\nif [ -e {self.controller_down} ]; then\n"
            "  echo 'slurm_load_jobs error: Unable to contact slurm controller (connect failure)' >&2; exit 1\nfi\n"
            f"cat {self.jobs}\n")
        (ct_tools / "pgrep").write_text(f"#!/bin/sh\n[ -s {self.steps} ]\n")
        for tool in ("squeue", "pgrep"):
            (ct_tools / tool).chmod(0o755)
        self.env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "PCT_LOG": str(self.log),
                    "PCT_CONF_DIR": str(self.conf_dir), "PCT_DEV_ROOT": str(self.dev), "PCT_PVE_VERSION": pve_version,
                    "PCT_STATE_EXEC_PATH": str(ct_tools)}

    def loaded_driver(self, version: str) -> None:
        """The host's loaded NVIDIA driver, as gpu_host reads it (a stand-in version file)."""
        path = self.tmp / "nvidia-version"
        path.write_text(version + "\n")
        self.data["all"]["children"]["container_hosts"]["children"]["pve_hosts"]["hosts"]["kpro6"][
            "gpu_host_driver_version_file"] = str(path)
        write_inventory(self.inventory, self.data)

    def container(self, **changes: object) -> None:
        ct = self.data["all"]["children"]["gpu_containers"]["children"]["kpro6_containers"]["hosts"]["kpro6-ct200"]
        ct.update(changes)
        write_inventory(self.inventory, self.data)

    def run(self, *args: str) -> tuple[subprocess.CompletedProcess[str], dict]:
        self.log.write_text("")
        return run_playbook(self.inventory, "--limit", "kpro6", *args, env=self.env, timeout=300)

    def commands(self) -> list[str]:
        """The pct calls that change something (not status/config/pending/exec)."""
        return [line for line in self.log.read_text().splitlines()
                if not line.startswith(("pct status", "pct exec", "pct config", "pct pending"))]


def _ok(run: tuple[subprocess.CompletedProcess[str], dict], host: str = "kpro6") -> dict:
    proc, recap = run
    assert proc.returncode == 0 and recap[host]["failed"] == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return recap[host]


def _golden(name: str, pve: PveHost) -> str:
    return (GOLDEN / name).read_text().replace("<DEV>", str(pve.dev)).replace("<SCRATCH>", str(pve.scratch))


@needs_root
def test_proxmox_backend_devn_entries_survive_proxmox_rewrites(tmp_path: Path) -> None:
    """PVE 8.2: passthrough through devN entries. Golden files tests/golden/pct-commands.txt and
    tests/golden/pve-200.conf. Then the CT config goes through Proxmox's own rewrite (what a
    GUI edit, snapshot or backup lock does): the next run changes nothing and reboots nothing."""
    from tests.pct_lxc_standin import proxmox_rewrite

    pve = PveHost(tmp_path)
    _ok(pve.run())
    assert pve.commands() == _golden("pct-commands.txt", pve).splitlines()
    # The scratch mount's host side belongs to the unprivileged CT's root (PVE maps it to 100000).
    owner = pve.scratch.stat()
    assert (owner.st_uid, owner.st_gid, stat.S_IMODE(owner.st_mode)) == (PVE_IDMAP_BASE, PVE_IDMAP_BASE, 0o1777)
    conf = pve.conf.read_text()
    assert conf == _golden("pve-200.conf", pve)
    # CT 200's 64 CPUs are 32 whole cores, 16 on each socket (its GPUs are on both), kept for slurm.conf.
    topology = json.loads((pve.topology_dir / "kpro6-ct200.json").read_text())
    assert (topology["sockets"], topology["cores_per_socket"], topology["threads_per_core"]) == (2, 16, 2)
    assert topology["gpu_cores"] == {**{str(i): "0-15" for i in range(4)}, **{str(i): "16-31" for i in range(4, 8)}}
    raw = [line for line in conf.splitlines() if line.startswith("lxc.")]
    assert raw == ["lxc.cgroup2.cpuset.cpus: 0-15,64-79,128-143,192-207"], "devN entries need no raw device lines"

    pve.conf.write_text("# CT 200: trainer\n" + conf)  # a note added in the GUI
    proxmox_rewrite(pve.conf)
    subprocess.run(["pct", "set", "200", "--lock", "backup"], env={**os.environ, **pve.env}, check=True)
    subprocess.run(["pct", "unlock", "200"], env={**os.environ, **pve.env}, check=True)
    rewritten = pve.conf.read_text()
    assert rewritten.startswith("# CT 200%3A trainer\n")
    assert _ok(pve.run())["changed"] == 0
    assert pve.commands() == [], "no set, no reboot"
    assert pve.conf.read_text() == rewritten

    # --check --diff after an inventory change shows exactly the device diff, and changes nothing.
    pve.container(ct_gpus=[0, 1, 2, 3, 4, 5])
    proc, recap = pve.run("--check", "--diff")
    assert _ok((proc, recap))["changed"] == 1 and pve.commands() == []
    assert pve.conf.read_text() == rewritten
    shown = re.findall(r"^\s+- '([+-] [a-z0-9]+: .*)'$", proc.stdout, re.M)
    opts = "gid=0,mode=0666,uid=0"
    assert shown == [f"- dev6: /dev/nvidia6,{opts}", f"- dev7: /dev/nvidia7,{opts}"], proc.stdout[-3000:]
    _ok(pve.run())
    assert pve.commands() == ["pct set 200 --delete dev6,dev7", "pct reboot 200"]


def test_pct_standin_hot_plugs_a_new_devn_from_pve_9_and_keeps_it_pending_on_8(tmp_path: Path) -> None:
    """pve-container 6.0.4 (PVE 9.0) hot-plugs a new devN into a running CT; PVE 8.x keeps it in
    [pve:pending] until the next start (memory is hot-plugged on both)."""
    from tests.pct_lxc_standin import parse_conf

    (tmp_path / "dev").mkdir()
    (tmp_path / "dev" / "nvidia0").write_text("")
    (tmp_path / "dev" / "nvidia1").write_text("")
    for version, hot in (("8.4.1", False), ("9.0.3", True)):
        conf_dir = tmp_path / version
        conf_dir.mkdir()
        env = {**os.environ, "PCT_CONF_DIR": str(conf_dir), "PCT_DEV_ROOT": str(tmp_path / "dev"),
               "PCT_PVE_VERSION": version}

        def pct(*args: str, env: dict[str, str] = env) -> subprocess.CompletedProcess[str]:
            return subprocess.run([sys.executable, "-m", "tests.pct_lxc_standin", *args], capture_output=True,
                                  text=True, env=env, cwd=ANSIBLE_DIR.parent, timeout=60)

        assert pct("create", "200", "local:vztmpl/x.tar.zst", "--memory", "2048", "--dev0", "/dev/nvidia0").returncode == 0
        assert pct("start", "200").returncode == 0
        assert pct("set", "200", "--memory", "4096", "--dev1", "/dev/nvidia1").returncode == 0
        main = parse_conf((conf_dir / "200.conf").read_text())
        assert main.options["memory"] == "4096", version
        assert ("dev1" in main.options) is hot, version
        assert ("new dev1: /dev/nvidia1" in pct("pending", "200").stdout.splitlines()) is not hot, version
        assert pct("reboot", "200").returncode == 0
        assert parse_conf((conf_dir / "200.conf").read_text()).options["dev1"] == "/dev/nvidia1"


def test_pct_standin_locks_value_checks_and_pending_changes(tmp_path: Path) -> None:
    """The stand-in itself (no Ansible): a locked CT refuses `pct set` and `pct start` as Proxmox
    does; cores/memory below the schema's minimum are refused; on a running CT (PVE 9) memory and
    a new devN apply at once, a devN delete waits in [pve:pending] until the next start."""
    from tests.pct_lxc_standin import parse_conf

    (tmp_path / "dev").mkdir()
    for name in ("nvidia0", "nvidia1"):
        (tmp_path / "dev" / name).write_text("")  # state-only mode checks only that the node exists
    conf = tmp_path / "200.conf"
    env = {**os.environ, "PCT_CONF_DIR": str(tmp_path), "PCT_DEV_ROOT": str(tmp_path / "dev"),
           "PCT_PVE_VERSION": "9.0.3"}

    def pct(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tests.pct_lxc_standin", *args], capture_output=True, text=True,
                              env=env, cwd=ANSIBLE_DIR.parent, timeout=60)

    for bad, message in ((["--cores", "0"], "cores: value must have a minimum value of 1"),
                         (["--memory", "8"], "memory: value must have a minimum value of 16")):
        proc = pct("create", "200", "local:vztmpl/x.tar.zst", *bad)
        assert proc.returncode != 0 and message in proc.stderr and not conf.exists()
    assert pct("create", "200", "local:vztmpl/x.tar.zst", "--cores", "2", "--memory", "2048",
               "--dev0", "/dev/nvidia0").returncode == 0
    assert pct("start", "200").returncode == 0
    assert pct("set", "200", "--memory", "4096", "--dev1", "/dev/nvidia1").returncode == 0  # hot-plugged
    assert pct("set", "200", "--delete", "dev0").returncode == 0  # pending
    main = parse_conf(conf.read_text())
    assert main.options["memory"] == "4096" and main.options["dev1"] == "/dev/nvidia1"
    assert main.options["dev0"] == "/dev/nvidia0" and main.sections == "[pve:pending]\ndelete: dev0\n"
    assert pct("pending", "200").stdout.splitlines() == [
        "cur arch: amd64", "cur cores: 2", "del dev0: /dev/nvidia0", "cur dev1: /dev/nvidia1", "cur memory: 4096",
        "cur ostype: ubuntu", "cur unprivileged: 0"]
    assert "dev0" not in pct("config", "200").stdout and "dev0" in pct("config", "200", "--current").stdout

    conf.write_text(conf.read_text().replace("arch: amd64", "arch: amd64\nlock: backup"))  # vzdump holds it
    for args in (("set", "200", "--cores", "4"), ("reboot", "200")):
        proc = pct(*args)
        assert proc.returncode != 0 and "CT is locked (backup)" in proc.stderr, proc.stderr
    assert "cores: 2\n" in conf.read_text() and "[pve:pending]" in conf.read_text()
    assert pct("unlock", "200").returncode == 0 and pct("reboot", "200").returncode == 0
    after = parse_conf(conf.read_text())
    assert "dev0" not in after.options and after.sections == "" and after.options["dev1"] == "/dev/nvidia1"


@needs_root
def test_new_gpus_on_pve_8_stay_pending_and_reboot_only_once_drained(tmp_path: Path) -> None:
    """PVE 8.x does not hot-plug a new devN (pve-container < 6.0.4): adding two GPUs while Slurm
    runs a job sets them (memory hot-plugged), the reboot they need is refused naming them, and
    the run after draining reboots exactly once; then changed=0."""
    pve = PveHost(tmp_path, pve_version="8.4.1", ct_gpus=[0, 1, 2, 3, 4, 5])
    _ok(pve.run())
    pve.jobs.write_text("4242\n")
    pve.container(ct_gpus=[0, 1, 2, 3, 4, 5, 6, 7], ct_memory_mb=262144)
    proc, _ = pve.run()
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0
    [added] = pve.commands()
    new_devs = sorted(re.findall(r"--(dev\d+) /dev/nvidia[67],", added))
    assert len(new_devs) == 2 and "memory: 262144\n" in pve.conf.read_text()
    assert "CT 200: it needs a reboot (" in out and "but Slurm runs jobs 4242" in out, proc.stdout[-3000:]
    assert all(f"new {key}" in out for key in new_devs), out[-2000:]
    pve.jobs.write_text("")
    _ok(pve.run())
    assert pve.commands() == ["pct reboot 200"]
    conf = pve.conf.read_text()
    assert "[pve:pending]" not in conf and "/dev/nvidia7," in conf
    assert _ok(pve.run())["changed"] == 0 and pve.commands() == []


@needs_root
def test_a_new_hostname_is_set_and_a_reboot_waits_until_the_jobs_can_be_counted(tmp_path: Path) -> None:
    """A changed ct_hostname (slurm.conf's NodeName follows it) is set on the CT (`pct set
    --hostname`, written at once on PVE 8) and owes a reboot. With the controller unreachable
    (squeue fails) and a slurmstepd in the CT the jobs cannot be counted: the reboot is refused,
    not done under running steps; once no slurmstepd runs, the CT reboots exactly once."""
    pve = PveHost(tmp_path, pve_version="8.2.4")
    _ok(pve.run())
    pve.controller_down.write_text("")
    pve.steps.write_text("1234\n")
    pve.container(ct_hostname="trainer201")
    proc, _ = pve.run()
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0
    assert pve.commands() == ["pct set 200 --hostname trainer201"]
    assert "hostname: trainer201\n" in pve.conf.read_text() and "[pve:pending]" not in pve.conf.read_text()
    assert ("CT 200: it needs a reboot (hostname pending) but its Slurm jobs cannot be counted: squeue failed "
            "(slurm_load_jobs error: Unable to contact slurm controller (connect failure)) and slurmstepd runs job "
            "steps in it") in out, proc.stdout[-3000:]
    pve.steps.write_text("")  # the steps ended; the controller is still down
    _ok(pve.run())
    assert pve.commands() == ["pct reboot 200"]
    assert _ok(pve.run())["changed"] == 0 and pve.commands() == []


@needs_root
def test_check_on_a_fresh_host_says_which_container_plays_it_skips_and_why(tmp_path: Path) -> None:
    """`make provision host=kpro6 check=1` before the first run: CT 200 does not exist, so the
    in-container plays have nothing to connect to. Each says it is skipped and why; the run
    succeeds and creates nothing."""
    pve = PveHost(tmp_path)
    pve.log.write_text("")
    proc, recap = run_playbook(pve.inventory, "--limit", "kpro6:kpro6_containers", "--check", "--diff",
                               env=pve.env, timeout=300)
    assert proc.returncode == 0 and recap["kpro6-ct200"]["failed"] == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert recap["kpro6-ct200"]["unreachable"] == 0 and pve.commands() == [] and not pve.conf.exists()
    out = " ".join(proc.stdout.split())
    for play in ("In-container environment", "Slurm, then the keepalive that its Prolog/Epilog call", "Verify"):
        assert (f'kpro6-ct200: play "{play}" skipped in check mode: the container does not exist yet (this run would '
                "create it from nvme-scratch:vztmpl/ubuntu-24.04-standard_24.04-2_amd64.tar.zst)") in out, out[-3000:]


@needs_root
def test_a_refused_reboot_stays_pending_until_the_node_is_drained(tmp_path: Path) -> None:
    """PVE 9 hot-plugs memory and new devN entries into a running CT (no reboot, even with jobs
    on it) and keeps a devN delete in [pve:pending] until the next start. A reboot refused while
    Slurm runs jobs is therefore not lost: the next run, with nothing left to `pct set`, reboots
    the drained CT exactly once; the run after it and --check change nothing."""
    pve = PveHost(tmp_path, pve_version="9.0.3", ct_gpus=[0, 1, 2, 3, 4, 5])
    _ok(pve.run())
    pve.jobs.write_text("4242\n")  # Slurm runs job 4242 on the node

    pve.container(ct_gpus=[0, 1, 2, 3, 4, 5, 6, 7], ct_memory_mb=262144)
    _ok(pve.run())
    [hotplug] = pve.commands()
    assert re.fullmatch(r"pct set 200 --memory 262144 --dev(\d+) /dev/nvidia6,\S+ --dev(\d+) /dev/nvidia7,\S+", hotplug)
    new_devs = sorted(re.findall(r"--(dev\d+) /dev/nvidia[67],", hotplug))  # as pct config sorts keys
    assert "[pve:pending]" not in pve.conf.read_text() and "memory: 262144\n" in pve.conf.read_text()

    pve.container(ct_gpus=[0, 1, 2, 3, 4, 5])
    proc, _ = pve.run()
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0
    dels = ", ".join(f"del {key}" for key in new_devs)
    assert f"CT 200: it needs a reboot ({dels} pending) but Slurm runs jobs 4242" in out, proc.stdout[-3000:]
    assert pve.commands() == [f"pct set 200 --delete {','.join(new_devs)}"]
    pending = pve.conf.read_text().split("[pve:pending]\n")[1]
    assert pending == f"delete: {','.join(new_devs)}\n", "PVE keeps the delete for the next start"

    pve.jobs.write_text("")  # drained
    _ok(pve.run())
    assert pve.commands() == ["pct reboot 200"], "exactly one reboot, nothing set again"
    conf = pve.conf.read_text()
    assert "[pve:pending]" not in conf and "/dev/nvidia6" not in conf and "/dev/nvidia7" not in conf
    assert _ok(pve.run())["changed"] == 0 and pve.commands() == []
    assert _ok(pve.run("--check", "--diff"))["changed"] == 0 and pve.commands() == []


@needs_root
def test_proxmox_backend_raw_lines_below_pve_8_1_are_managed_by_key_and_value(tmp_path: Path) -> None:
    """PVE 7.4 has no devN: raw lxc.* lines with exact major:minor, no `optional` mount. Lines an
    older version wrote between comment markers are replaced; after Proxmox's rewrite (markers
    in the description, `lxc.key: value` at the end) the next run changes nothing."""
    from tests.pct_lxc_standin import proxmox_rewrite

    pve = PveHost(tmp_path, pve_version="7.4-3", ct_gpus=[0, 1])
    subprocess.run(["pct", "create", "200", "local:vztmpl/x.tar.zst", "--cores", "64", "--memory", "502784",
                    "--unprivileged", "1"], env={**os.environ, **pve.env}, check=True)
    with pve.conf.open("a") as conf:  # what this role wrote before: markers, a wildcard major, optional mounts
        conf.write("# BEGIN launch managed: gpu passthrough\nlxc.cgroup2.devices.allow = c 195:* rwm\n"
                   f"lxc.mount.entry = {pve.dev}/nvidia5 dev/nvidia5 none bind,optional,create=file\n"
                   "# END launch managed: gpu passthrough\nlxc.apparmor.profile = unconfined\n")
    proxmox_rewrite(pve.conf)
    _ok(pve.run())
    conf = pve.conf.read_text()
    raw = re.findall(r"^(lxc\.[a-z0-9.]+): (.*)$", conf, re.M)
    nodes = {"nvidia0": 0, "nvidia1": 1, "nvidia-caps/nvidia-cap1": 1, "nvidia-uvm": 254, "nvidiactl": 255}
    assert raw == [("lxc.apparmor.profile", "unconfined")] + [
        pair for name, minor in nodes.items()
        for pair in (("lxc.cgroup2.devices.allow", f"c {STANDIN_MAJOR}:{minor} rwm"),
                     ("lxc.mount.entry", f"{pve.dev}/{name} dev/{name} none bind,create=file 0 0"))] + [
        ("lxc.cgroup2.cpuset.cpus", "0-31,128-159")]  # 32 whole cores of socket 0, its GPUs' socket
    assert "launch managed" not in conf and "optional" not in conf and "*" not in conf
    assert not any(re.match(r"dev\d+:", line) for line in conf.splitlines())

    proxmox_rewrite(pve.conf)
    rewritten = pve.conf.read_text()
    assert _ok(pve.run())["changed"] == 0 and pve.commands() == []
    assert pve.conf.read_text() == rewritten

    # Raw lines are edited in the file, where Proxmox records nothing pending: the host's marker
    # keeps the reboot refused while jobs run, and the run after draining does it once.
    pve.jobs.write_text("77\n")
    pve.container(ct_gpus=[0])
    proc, _ = pve.run()
    marker = tmp_path / "pending" / "200.restart"
    assert proc.returncode != 0 and "but Slurm runs jobs 77" in proc.stdout and marker.is_file()
    assert f"{pve.dev}/nvidia1" not in pve.conf.read_text() and pve.commands() == []
    pve.jobs.write_text("")
    _ok(pve.run())
    assert pve.commands() == ["pct reboot 200"] and not marker.exists()


@needs_root
def test_nvswitch_host_needs_fabric_manager_and_keeps_the_switches(tmp_path: Path) -> None:
    """An HGX host (stand-in /dev/nvidia-nvswitch* nodes, major 195): with no Fabric Manager
    running (this machine's real systemctl says so) the run stops before any CT is made, naming
    error 802 and the driver's version; with one running (stand-in `systemctl is-active` and
    `nv-fabricmanager --version` on PATH: no NVSwitch here) the CT gets its GPUs and no switch."""
    pve = PveHost(tmp_path)
    for name, minor in (("nvidia-nvswitch0", 100), ("nvidia-nvswitch1", 101), ("nvidia-nvswitchctl", 102)):
        os.mknod(pve.dev / name, 0o666 | stat.S_IFCHR, os.makedev(STANDIN_MAJOR, minor))
    pve.loaded_driver("550.54.15")
    # No pinned source for Fabric Manager (Debian/PVE packages none): refused, naming the archive.
    proc, _ = pve.run()
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0 and pve.commands() == []
    archive = ("https://developer.download.nvidia.com/compute/nvidia-driver/redist/fabricmanager/linux-x86_64/"
               "fabricmanager-linux-x86_64-550.54.15-archive.tar.xz")
    assert ("kpro6: NVSwitch devices (nvidia-nvswitch0, nvidia-nvswitch1) need Fabric Manager of the driver's exact "
            f"version (550.54.15), installed from NVIDIA's archive {archive}; set gpu_host_fabricmanager_sha256: "
            f'{{"550.54.15": "<sha256>"}} with what this prints: curl -fsSL {archive} | sha256sum') in out, out[-3000:]

    pve.data["all"]["children"]["container_hosts"]["children"]["pve_hosts"]["hosts"]["kpro6"][
        "gpu_host_fabricmanager_sha256"] = {"550.54.15": "cd" * 32}
    write_inventory(pve.inventory, pve.data)
    proc, _ = pve.run()
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0
    assert ("kpro6: the host has NVSwitch devices (nvidia-nvswitch0, nvidia-nvswitch1) but "
            "nvidia-fabricmanager.service is not active") in out, proc.stdout[-3000:]
    assert "error 802" in out and "Install Fabric Manager of the driver's exact version (550.54.15)" in out
    assert pve.commands() == []

    for tool, body in (("systemctl", 'test "$1 $2" = "is-active nvidia-fabricmanager.service" && echo active'),
                       ("nv-fabricmanager", "echo 'Fabric Manager version is : 550.54.15'")):
        (tmp_path / "bin" / tool).write_text(f"#!/bin/sh\n{body}\n")
        (tmp_path / "bin" / tool).chmod(0o755)
    _ok(pve.run())
    conf = pve.conf.read_text()
    assert "/dev/nvidia-nvswitch" not in conf and all(f"/dev/nvidia{i}," in conf for i in range(8))


def _fabricmanager_archive(root: Path, version: str) -> Path:
    """A Fabric Manager archive in NVIDIA's layout (bin, lib with its .so link, include, etc,
    share/nvidia/nvswitch, systemd, sbin), whose daemon prints `version` and whose own
    fm_run_package_installer.sh copies nothing and exits 0 (as older copies of it did)."""
    import tarfile

    top = root / f"fabricmanager-linux-x86_64-{version}-archive"
    files = {"bin/nv-fabricmanager": f"#!/bin/sh\necho 'Fabric Manager version is : {version}'\n",
             "bin/nvswitch-audit": "#!/bin/sh\n", "lib/libnvfm.so.1": "elf", "include/nv_fm_agent.h": "/* h */\n",
             "etc/fabricmanager.cfg": "LOG_LEVEL=4\n", "share/nvidia/nvswitch/dgx2_hgx2_topology": "topology",
             "systemd/nvidia-fabricmanager.service": "[Service]\nExecStart=/usr/bin/nv-fabricmanager\n",
             "sbin/fm_run_package_installer.sh": "#!/bin/sh\nexit 0\n"}
    for rel, text in files.items():
        (top / rel).parent.mkdir(parents=True, exist_ok=True)
        (top / rel).write_text(text)
        (top / rel).chmod(0o755 if rel.startswith(("bin/", "sbin/")) else 0o644)
    (top / "lib" / "libnvfm.so").symlink_to("libnvfm.so.1")
    archive = root / "fabricmanager" / "linux-x86_64" / f"{top.name}.tar.xz"
    archive.parent.mkdir(parents=True)
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(top, arcname=top.name)
    return archive


@needs_root
def test_fabric_manager_is_installed_from_the_archives_own_folders(tmp_path: Path) -> None:
    """Fabric Manager of the driver's version from NVIDIA's archive, served over HTTP with its
    redistrib_<version>.json: the sha256 comes from that file (the inventory pins none), the
    role's own tasks place each folder's files (the archive's installer, which here copies
    nothing and exits 0, is not trusted), `nv-fabricmanager --version` is checked, a second run
    changes nothing and keeps the admin's fabricmanager.cfg; a tampered archive is refused."""
    import hashlib
    import http.server
    import threading

    import yaml

    version = "550.54.15"
    served = tmp_path / "served"
    archive = _fabricmanager_archive(served, version)
    sha = hashlib.sha256(archive.read_bytes()).hexdigest()
    (served / f"redistrib_{version}.json").write_text(json.dumps({"release_date": "2024-02-23", "fabricmanager": {
        "name": "NVIDIA Fabric Manager", "version": version, "linux-x86_64": {
            "relative_path": f"fabricmanager/linux-x86_64/{archive.name}", "sha256": sha}}}))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(served))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    root, cache = tmp_path / "root", tmp_path / "cache"
    play = tmp_path / "fm.yml"
    play.write_text(yaml.safe_dump([{"hosts": "localhost", "gather_facts": False, "vars": {
        "gpu_host_driver_version": version, "gpu_host_nvswitch_nodes": ["nvidia-nvswitch0"],
        "gpu_host_fabricmanager_url": f"{base}/fabricmanager/linux-x86_64/fabricmanager-linux-x86_64-{{version}}-archive.tar.xz",
        "gpu_host_fabricmanager_redistrib_url": f"{base}/redistrib_{{version}}.json",
        "gpu_host_fabricmanager_dir": str(cache), "gpu_host_fabricmanager_root": str(root)}, "tasks": [
        {"ansible.builtin.include_role": {"name": "gpu_host", "tasks_from": name}}
        for name in ("fabricmanager_source.yml", "fabricmanager_install.yml")]}]))
    inventory = write_inventory(tmp_path / "inv.yml", {"all": {"hosts": {"localhost": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}})
    env = {"ANSIBLE_ROLES_PATH": str(ANSIBLE_DIR / "roles")}
    try:
        proc, recap = run_playbook(inventory, playbook=play, env=env)
        assert proc.returncode == 0 and recap["localhost"]["failed"] == 0, proc.stdout[-4000:]
        daemon = root / "usr" / "bin" / "nv-fabricmanager"
        assert subprocess.run([str(daemon), "--version"], capture_output=True, text=True).stdout.strip().endswith(version)
        assert os.readlink(root / "usr" / "lib" / "x86_64-linux-gnu" / "libnvfm.so") == "libnvfm.so.1"
        assert (root / "lib" / "systemd" / "system" / "nvidia-fabricmanager.service").is_file()
        assert (root / "usr" / "share" / "nvidia" / "nvswitch" / "dgx2_hgx2_topology").is_file()
        assert (root / "usr" / "include" / "nv_fm_agent.h").is_file()
        cfg = root / "usr" / "share" / "nvidia" / "nvswitch" / "fabricmanager.cfg"
        cfg.write_text("LOG_LEVEL=1\n")  # the admin's change
        proc, recap = run_playbook(inventory, playbook=play, env=env)
        assert recap["localhost"]["failed"] == 0 and recap["localhost"]["changed"] == 0, proc.stdout[-4000:]
        assert cfg.read_text() == "LOG_LEVEL=1\n"

        # The archive on the server no longer matches NVIDIA's sha256: refused before anything is unpacked.
        shutil.rmtree(cache)
        archive.write_bytes(archive.read_bytes() + b"tampered")
        proc, recap = run_playbook(inventory, playbook=play, env=env)
        assert recap["localhost"]["failed"] == 1 and "checksum" in proc.stdout.lower(), proc.stdout[-3000:]
        assert not (cache / f"fabricmanager-linux-x86_64-{version}-archive").exists()
    finally:
        server.shutdown()


@needs_root
def test_the_role_waits_for_the_cts_route_and_dns_before_the_first_apt(tmp_path: Path) -> None:
    """After `pct start` the CT's DHCP lease and DNS come later: the role waits for a default
    route and for the host of the CT's first apt source to resolve. `pct exec` of the state-only
    stand-in runs on this machine (its /proc/net/route and apt sources) with a stand-in `getent`
    first on PATH that fails twice before it resolves; one that never does fails the run, named."""
    pve = PveHost(tmp_path)
    calls = tmp_path / "getent-calls"
    getent = tmp_path / "ct-bin" / "getent"
    getent.write_text(f"#!/bin/sh\necho x >> {calls}\n[ $(wc -l < {calls}) -ge 3 ]\n")
    getent.chmod(0o755)
    _ok(pve.run())
    assert len(calls.read_text().splitlines()) == 3  # waited through two failures, then went on

    getent.write_text("#!/bin/sh\nexit 2\n")
    pve.container(ct_vmid=200)
    pve.data["all"]["children"]["container_hosts"]["children"]["pve_hosts"]["hosts"]["kpro6"]["lxc_container_wait_timeout"] = 2
    write_inventory(pve.inventory, pve.data)
    proc, _ = pve.run()
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0
    assert "kpro6-ct200: after 2 s the CT has cannot resolve " in out and "apt inside would fail" in out, out[-2000:]


@needs_root
def test_scratch_that_is_a_proxmox_storage_directory_is_refused(tmp_path: Path) -> None:
    """kpro6's template lives on storage `nvme-scratch`: when the scratch path is that storage's
    own directory, the role would hand template/ and dump/ (other guests' backups) to every CT
    user with mode 1777. Refused before the CT is touched, the storage named."""
    pve = PveHost(tmp_path)
    pve.scratch.mkdir()
    cfg = tmp_path / "storage.cfg"
    cfg.write_text(cfg.read_text() + f"\ndir: nvme-scratch\n\tpath {pve.scratch}/\n\tcontent vztmpl,backup\n")
    proc, _ = pve.run()
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0
    assert (f"kpro6-ct200: ct_scratch_host_path={pve.scratch} is the directory of Proxmox storage nvme-scratch "
            f"({pve.scratch}: its templates, backups and volumes)") in out, proc.stdout[-3000:]
    assert pve.commands() == [] and pve.scratch.stat().st_uid == 0
    pve.container(ct_scratch_host_path=str(pve.scratch / "ct200"))  # a directory of its own there: fine
    _ok(pve.run())
    assert (pve.scratch / "ct200").stat().st_uid == PVE_IDMAP_BASE and pve.scratch.stat().st_uid == 0


@needs_root
def test_mount_options_a_user_added_to_mp0_are_kept(tmp_path: Path) -> None:
    """mp0 is the role's by its volume and mount point, not its literal string: options a user
    adds (`mountoptions=`, `backup=`) survive the next run with no `pct set` and no reboot; a
    changed mount point is still set."""
    pve = PveHost(tmp_path)
    _ok(pve.run())
    env = {**os.environ, **pve.env}
    subprocess.run(["pct", "set", "200", "--mp0", f"{pve.scratch},mp=/scratch,mountoptions=noatime,backup=0"],
                   env=env, check=True, capture_output=True)
    # A changed mpN of a running CT is pending until its restart: the user restarted it.
    subprocess.run(["pct", "reboot", "200"], env=env, check=True, capture_output=True)
    before = pve.conf.read_text()
    assert "mountoptions=noatime" in before
    assert _ok(pve.run())["changed"] == 0
    assert pve.commands() == [] and pve.conf.read_text() == before
    pve.container(ct_scratch_mount="/nvme", node_caches_root="/nvme/cache")
    _ok(pve.run())
    assert any(c.startswith("pct set 200") and "mp=/nvme" in c for c in pve.commands()), pve.commands()


@needs_root
def test_a_host_driver_without_the_userspace_checksum_is_refused_before_any_host_change(tmp_path: Path) -> None:
    """The inventory has a checksum, but for another driver than the one the host has loaded (only
    the host knows it): gpu_host stops before it changes anything (no scratch made, no pct call
    that changes something), naming the CT, the version and the command that prints the checksum."""
    pve = PveHost(tmp_path, nvidia_userspace_sha256={"550.54.14": "ab" * 32})
    pve.loaded_driver("550.54.15")
    proc, _ = pve.run()
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0
    assert ("kpro6-ct200: nvidia_userspace_sha256 has no checksum for kpro6's driver 550.54.15; add \"550.54.15\": "
            "\"<sha256>\" with what this prints: curl -fsSL https://us.download.nvidia.com/tesla/550.54.15/"
            "NVIDIA-Linux-x86_64-550.54.15.run | sha256sum") in out, proc.stdout[-3000:]
    assert pve.commands() == [] and not pve.scratch.exists()
    pve.container(nvidia_userspace_sha256=USERSPACE_SHA)
    _ok(pve.run())


@needs_root
def test_proxmox_backend_refuses_missing_gpus_and_foreign_majors(tmp_path: Path) -> None:
    pve = PveHost(tmp_path, gpus=6, gpu_host_expected_gpus=0)
    pve.data["all"]["children"]["container_hosts"]["children"]["pve_hosts"]["hosts"]["kpro6"]["gpu_host_expected_gpus"] = 0
    write_inventory(pve.inventory, pve.data)
    proc, _ = pve.run()
    assert proc.returncode != 0
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "kpro6-ct200: ct_gpus=[0, 1, 2, 3, 4, 5, 6, 7] but the host has no /dev/nvidia6, /dev/nvidia7" in out
    assert not any(c.startswith("pct start") for c in pve.commands())
    # An override past the inventory check (-e): the role still takes only /proc/devices' majors.
    proc, _ = pve.run("-e", '{"lxc_container_nvidia_majors": [1, 195]}')
    assert proc.returncode != 0 and "only those may pass through" in proc.stdout, proc.stdout[-2000:]
    # Memory 0 past the inventory check: refused before `pct create`, never `--memory 0`.
    proc, _ = pve.run("-e", '{"ct_memory_mb": 0, "ct_gpus": [0]}')
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0 and "ct_memory_mb=0 (>= 16, required: Proxmox would give 512 MB)" in out, out[-2000:]
    assert pve.commands() == []


@needs_root
def test_scratch_on_the_rootfs_storage_or_a_network_fs_is_refused(tmp_path: Path) -> None:
    pve = PveHost(tmp_path, ct_scratch_host_path=str(tmp_path / "scratch"))
    (tmp_path / "storage.cfg").write_text(f"dir: local-lvm\n\tpath {tmp_path / 'images'}\n\tcontent rootdir\n")
    proc, _ = pve.run()
    assert proc.returncode != 0 and f"ct_scratch_host_path={tmp_path / 'scratch'} is on " in proc.stdout
    assert "the storage of the container rootfs" in proc.stdout and pve.commands() == []
    pve.container(ct_scratch_allow_rootfs_storage=True)
    fstype = subprocess.run(["findmnt", "-n", "-o", "FSTYPE", "--target", str(tmp_path)], capture_output=True,
                            text=True, check=True).stdout.strip()
    proc, _ = pve.run("-e", f'{{"lxc_container_network_fstypes": ["{fstype}"]}}')
    assert proc.returncode != 0 and "a network file system (set ct_scratch_allow_network_fs: true" in proc.stdout
    assert pve.commands() == []


# --- the unprivileged CT, against the kernel --------------------------------------------------

@pytest.fixture
def open_tmp():
    path = traversable_tmp_dir("launch-userns-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@needs_userns
def test_unprivileged_ct_root_can_use_the_scratch_the_role_owns(open_tmp: Path) -> None:
    """The kernel's answer, in a user namespace mapped as PVE maps an unprivileged CT (0 -> 100000):
    a scratch directory owned by host root (what the host had before; PVE does not shift a bind
    mount's owner) refuses container root with EACCES; after lxc_container's own scratch task
    (scratch_owner.yml, run for real), the real node_caches role run as container root creates the
    cache root, and a job user (container uid 1000) writes both /scratch and its cache. A CT with an
    `lxc.idmap` of its own (0 -> 200000) gets its scratch owned by that uid."""
    import yaml

    scratch, own_map = open_tmp / "nvme-scratch", open_tmp / "scratch-200"
    scratch.mkdir(mode=0o755)
    before = in_unprivileged_ct(["mkdir", str(scratch / "cache")])
    assert before.returncode != 0 and "Permission denied" in before.stderr, before

    play = open_tmp / "owner.yml"
    ct = {"name": "ct200", "unprivileged": True, "scratch_mode": "1777"}
    idmap = ["lxc.idmap: u 0 200000 65536", "lxc.idmap: g 0 200000 65536"]
    play.write_text(yaml.safe_dump([{"hosts": "localhost", "gather_facts": False, "tasks": [
        {"ansible.builtin.include_role": {"name": "lxc_container", "tasks_from": "scratch_owner.yml"},
         "vars": {"lxc_container_ct": {**ct, "scratch_host_path": str(scratch)}}},
        {"ansible.builtin.include_role": {"name": "lxc_container", "tasks_from": "scratch_owner.yml"},
         "vars": {"lxc_container_ct": {**ct, "scratch_host_path": str(own_map)},
                  "lxc_container_pct_config": {"stdout_lines": idmap}}},
    ]}]))
    inventory = write_inventory(open_tmp / "inv.yml", {"all": {"hosts": {"localhost": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}})
    proc, recap = run_playbook(inventory, playbook=play, env={"ANSIBLE_ROLES_PATH": str(ANSIBLE_DIR / "roles")})
    assert recap["localhost"]["failed"] == 0 and recap["localhost"]["changed"] == 2, proc.stdout[-3000:]
    assert (own_map.stat().st_uid, own_map.stat().st_gid) == (200000, 200000)

    # node_caches' task as the CT's root, its exact effect (`file: state=directory owner=root group=root
    # mode=1777`): Ansible itself cannot run in the namespace here, its interpreter lives under
    # a 0700 /root that the mapped uid cannot traverse.
    cache_root = scratch / "cache"
    made = in_unprivileged_ct(["sh", "-c", f"mkdir {cache_root} && chown 0:0 {cache_root} && chmod 1777 {cache_root}"])
    assert made.returncode == 0, made.stderr
    cache = (scratch / "cache").stat()
    assert (cache.st_uid, stat.S_IMODE(cache.st_mode)) == (PVE_IDMAP_BASE, 0o1777)
    job = in_unprivileged_ct(["sh", "-c", f"mkdir {scratch}/cache/alice && echo hi > {scratch}/cache/alice/probe"
                                          f" && echo out > {scratch}/run.log"], uid=1000)
    assert job.returncode == 0, job.stderr
    assert (scratch / "cache" / "alice").stat().st_uid == PVE_IDMAP_BASE + 1000
    assert (scratch / "run.log").read_text() == "out\n"


def test_an_unprivileged_ct_whose_idmap_maps_root_to_host_root_is_refused(open_tmp: Path) -> None:
    """A CT config with `lxc.idmap: u 0 0 65536` (its root is host root: a privileged CT that says
    it is not): scratch_owner.yml stops with one message naming the line, and the scratch
    directory is never made (it would have gone to host root)."""
    import yaml

    scratch = open_tmp / "scratch-root0"
    play = open_tmp / "owner-root0.yml"
    play.write_text(yaml.safe_dump([{"hosts": "localhost", "gather_facts": False, "tasks": [
        {"ansible.builtin.include_role": {"name": "lxc_container", "tasks_from": "scratch_owner.yml"},
         "vars": {"lxc_container_ct": {"name": "ct200", "unprivileged": True, "scratch_mode": "1777",
                                       "scratch_host_path": str(scratch)},
                  "lxc_container_pct_config": {"stdout_lines": ["lxc.idmap: u 0 0 65536", "lxc.idmap: g 0 0 65536"]}}},
    ]}]))
    inventory = write_inventory(open_tmp / "inv-root0.yml", {"all": {"hosts": {"localhost": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}})
    proc, recap = run_playbook(inventory, playbook=play, env={"ANSIBLE_ROLES_PATH": str(ANSIBLE_DIR / "roles")})
    assert recap["localhost"]["failed"] == 1, proc.stdout[-3000:]
    assert "maps container root to host uid/gid 0/0" in " ".join(proc.stdout.split()), proc.stdout[-3000:]
    assert not scratch.exists()


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
    storage_cfg = tmp_path / "storage.cfg"
    storage_cfg.write_text(f"dir: local\n\tpath {lxc_path}\n\tcontent rootdir,vztmpl\n")
    # Scratch on storage of its own (a tmpfs), not on the rootfs storage `local`.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "launch-test-scratch", str(scratch)], check=True)
    inventory = write_inventory(tmp_path / "pve.yml", {"all": {"children": {
        "container_hosts": {"children": {"pve_hosts": {"hosts": {"localhost": {
            "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
            "lxc_container_backend": "proxmox", "lxc_container_pve_conf_dir": str(conf_dir),
            "lxc_container_pve_storage_cfg": str(storage_cfg),
            "gpu_host_require_gpu": False, "gpu_host_expected_gpus": 3,
            "gpu_host_proc_devices": str(proc_devices), "gpu_host_dev_dir": str(dev),
            "gpu_host_scratch_path": str(scratch), "gpu_host_scratch_must_be_mountpoint": False,
        }}}}},
        "gpu_containers": {"children": {"localhost_containers": {
            "vars": {"container_host": "localhost"},
            "hosts": {"pve-ct": {"ct_vmid": int(vmid), "ct_hostname": "trainer-standin",
                                 "ct_template": f"local:vztmpl/{template.name}", "ct_rootfs_storage": "local",
                                 "ct_unprivileged": False,  # the stand-in runs real LXC privileged only
                                 "ct_cores": 2, "ct_memory_mb": 2048, "ct_gpus": [0, 1],
                                 "ct_scratch_host_path": str(scratch), "ct_scratch_mount": "/scratch",
                                 # no lock or wheelhouse here: said on purpose, as the check asks
                                 "python_env_allow_network_install": True}},
        }}},
    }}})
    env = {"PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}", "PCT_LOG": str(log), "PCT_CONF_DIR": str(conf_dir),
           "PCT_LXC_PATH": str(lxc_path), "PCT_TEMPLATE_DIR": str(template.parent), "PCT_DEV_ROOT": str(dev),
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
        assert any(c.startswith(f"pct set {vmid} --mp0 {scratch},mp=/scratch --dev0 /dev/nvidia0,") for c in calls), calls
        assert f"pct start {vmid}" in calls

        assert pct("status", vmid).stdout.strip() == "status: running"
        assert subprocess.run(["lxc-info", "-P", str(lxc_path), "-n", vmid, "-s", "-H"], capture_output=True,
                              text=True, check=True).stdout.strip() == "RUNNING"
        lxc_config = (lxc_path / vmid / "config").read_text()
        assert f"lxc.rootfs.path = dir:{lxc_path / vmid / 'rootfs'}" in lxc_config.splitlines()
        assert f"lxc.mount.entry = {dev}/nvidia0 dev/nvidia0 none bind,create=file 0 0" in lxc_config
        assert "optional" not in lxc_config and "195:*" not in lxc_config
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
        # Least privilege: a node made for another GPU's minor cannot be opened (the cgroup denies it).
        other = pct("exec", vmid, "--", "sh", "-c", f"mknod /tmp/gpu2 c {STANDIN_MAJOR} 2 && python3 -c "
                    "\"open('/tmp/gpu2', 'rb')\"", check=False)
        assert other.returncode != 0 and "Operation not permitted" in other.stderr, other.stderr
        pct("exec", vmid, "--", "sh", "-c", "echo hi > /scratch/probe")
        assert (scratch / "probe").read_text() == "hi\n"

        log.write_text("")
        second, recap = run_playbook(inventory, "--limit", "localhost", env=env, timeout=600)
        assert second.returncode == 0 and recap["localhost"]["changed"] == 0, second.stdout[-3000:]
        assert all(line.startswith(("pct status", "pct exec", "pct config", "pct pending")) for line in log.read_text().splitlines())
    finally:
        pct("destroy", vmid, check=False)
        destroy_container(lxc_path, vmid)
        subprocess.run(["umount", str(scratch)], check=False)


# --- gpu_host: a packaged nvidia-persistenced that disables persistence mode ------------------

def test_a_packaged_persistenced_without_persistence_mode_gets_an_execstart_override(tmp_path: Path) -> None:
    """Debian/Ubuntu's nvidia-persistenced.service runs `--no-persistence-mode`; gpu_host asserts
    persistence mode on, so it overrides ExecStart with the packaged command and
    --persistence-mode, and restarts the daemon. A stand-in `systemctl` (no NVIDIA driver here)
    prints the packaged unit's ExecStart as systemd shows it and logs the other calls; a unit that
    already runs in persistence mode gets no drop-in."""
    import yaml

    bin_dir, log = tmp_path / "bin", tmp_path / "systemctl.log"
    bin_dir.mkdir()
    exec_start = tmp_path / "exec-start"
    (bin_dir / "systemctl").write_text(f"""#!/bin/sh
echo "$*" >> {log}
case "$*" in
  "show -p ExecStart --value nvidia-persistenced.service") cat {exec_start} ;;
  show*) printf 'Id=nvidia-persistenced.service\nLoadState=loaded\nActiveState=active\nSubState=running\nUnitFileState=enabled\n' ;;
esac
""")
    (bin_dir / "systemctl").chmod(0o755)
    play = tmp_path / "play.yml"
    play.write_text(yaml.safe_dump([{"hosts": "localhost", "gather_facts": False, "tasks": [
        {"ansible.builtin.include_role": {"name": "gpu_host", "tasks_from": "persistenced_mode.yml"}}]}]))
    inventory = write_inventory(tmp_path / "inv.yml", {"all": {"hosts": {"localhost": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
        "gpu_host_systemd_dir": str(tmp_path / "systemd")}}}})
    (tmp_path / "systemd" / "nvidia-persistenced.service.d").mkdir(parents=True)
    dropin = tmp_path / "systemd" / "nvidia-persistenced.service.d" / "launch-persistence-mode.conf"
    env = {"ANSIBLE_ROLES_PATH": str(ANSIBLE_DIR / "roles"), "PATH": f"{bin_dir}:{os.environ['PATH']}"}

    exec_start.write_text("{ path=/usr/bin/nvidia-persistenced ; argv[]=/usr/bin/nvidia-persistenced --user "
                          "nvidia-persistenced --no-persistence-mode --verbose ; ignore_errors=no ; start_time=[n/a] ; "
                          "stop_time=[n/a] ; pid=0 ; code=(null) ; status=0/0 }\n")
    proc, recap = run_playbook(inventory, playbook=play, env=env)
    assert recap["localhost"]["failed"] == 0, proc.stdout[-3000:]
    lines = dropin.read_text().splitlines()
    assert lines[-3:] == ["[Service]", "ExecStart=", "ExecStart=/usr/bin/nvidia-persistenced --user nvidia-persistenced "
                          "--persistence-mode --verbose"], lines
    assert "daemon-reload" in log.read_text() and "restart nvidia-persistenced.service" in log.read_text()

    dropin.unlink()
    exec_start.write_text("{ path=/usr/bin/nvidia-persistenced ; argv[]=/usr/bin/nvidia-persistenced --user "
                          "nvidia-persistenced --persistence-mode --verbose ; ignore_errors=no }\n")
    proc, recap = run_playbook(inventory, playbook=play, env=env)
    assert recap["localhost"]["failed"] == 0 and recap["localhost"]["changed"] == 0, proc.stdout[-3000:]
    assert not dropin.exists()


# --- the slurm role's GPU policy and gres.conf --------------------------------------------------

@needs_root
def test_slurm_role_device_policy_and_gres_from_the_cts_own_minors(tmp_path: Path) -> None:
    """The slurm role's config files alone (tasks/config.yml, no packages, no services): an
    unprivileged CT with ct_gpus [4..7] of a split host gets gres.conf File=/dev/nvidia4..7 (its
    real nodes) and ConstrainDevices=no with the reason (the eBPF limit the doctor test shows);
    a privileged CT gets ConstrainDevices=yes; a forced yes in an unprivileged CT is refused."""
    import yaml

    def ct(**extra: object) -> dict:
        conf_dir = tmp_path / str(extra.pop("name"))
        conf_dir.mkdir()  # the role's main tasks make it
        return {"ct_cores": 8, "ct_memory_mb": 4096, "slurm_conf_dir": str(conf_dir), **extra}

    # ct-split's CPUs as lxc_container pinned them on its host: 4 whole cores of socket 1, next to its GPUs.
    topology = tmp_path / "topology"
    topology.mkdir()
    (topology / "ct-split.json").write_text(json.dumps({
        "cpus": "64-67,192-195", "sockets": 1, "cores_per_socket": 4, "threads_per_core": 2,
        "gpu_cores": {"4": "0-3", "5": "0-3", "6": "0-3", "7": "0-3"}}))
    inventory = write_inventory(tmp_path / "inv.yml", {"all": {"children": {
        "container_hosts": {"hosts": {"pvehost": {"ansible_connection": "local",
                                                  "ansible_python_interpreter": sys.executable,
                                                  "lxc_container_topology_dir": str(topology)}}},
        "gpu_containers": {
            "vars": {"container_host": "pvehost", "ansible_connection": "local", "ansible_python_interpreter": sys.executable,
                     "slurm_manage_services": False, "slurm_version_argv": ["echo", "slurm 23.11.4"]},
            "hosts": {"ct-split": ct(name="ct-split", ct_gpus=[4, 5, 6, 7]),
                      "ct-priv": ct(name="ct-priv", ct_gpus=[0], ct_unprivileged=False),
                      "ct-forced": ct(name="ct-forced", ct_gpus=[1], slurm_constrain_devices=True),
                      # A Debian 13 CT under a controller of another release (a stand-in slurmd -V).
                      "ct-trixie": ct(name="ct-trixie", ct_gpus=[3], slurm_version_argv=["echo", "slurm 24.11.5"])}},
        "slurm_controllers": {"hosts": {"ct-split": None}},
    }}})
    play = tmp_path / "config.yml"
    play.write_text(yaml.safe_dump([{"hosts": "gpu_containers", "gather_facts": False, "tasks": [
        {"ansible.builtin.include_role": {"name": "slurm", "tasks_from": "config.yml"}}]}]))
    proc, recap = run_playbook(inventory, playbook=play, env={"ANSIBLE_ROLES_PATH": str(ANSIBLE_DIR / "roles")})
    assert recap["ct-split"]["failed"] == 0 and recap["ct-priv"]["failed"] == 0, proc.stdout[-3000:]
    assert recap["ct-forced"]["failed"] == 1
    assert recap["ct-trixie"]["failed"] == 1 and not (tmp_path / "ct-trixie" / "slurm.conf").exists()
    refused = ("ct-trixie: Slurm 24.11 here but 23.11 on the controller ct-split: a node of another release "
               "than slurmctld is unsupported")
    assert refused in " ".join(proc.stdout.split()), proc.stdout[-3000:]
    # `make provision host=H` limits the play to H's containers: the controller is not in it, and
    # is asked itself (delegated) rather than through facts it never gathered there.
    alone, alone_recap = run_playbook(inventory, "--limit", "ct-trixie", playbook=play,
                                      env={"ANSIBLE_ROLES_PATH": str(ANSIBLE_DIR / "roles")})
    assert alone_recap["ct-trixie"]["failed"] == 1 and refused in " ".join(alone.stdout.split()), alone.stdout[-3000:]
    out = " ".join(proc.stdout.split())
    assert "ct-forced: slurm_constrain_devices=yes, but this node is an unprivileged container" in out, out[-2000:]

    # gres.conf: each GPU with the cores next to it; a node whose host kept no topology has File= only.
    gres = (tmp_path / "ct-split" / "gres.conf").read_text().splitlines()
    assert [line for line in gres if line.startswith("NodeName=ct-split ")] == [
        f"NodeName=ct-split Name=gpu File=/dev/nvidia{i} Cores=0-3" for i in (4, 5, 6, 7)]
    assert "NodeName=ct-priv Name=gpu File=/dev/nvidia0" in gres
    slurm_conf_text = (tmp_path / "ct-split" / "slurm.conf").read_text()
    assert re.search(r"^NodeName=ct-split CPUs=8 Sockets=1 CoresPerSocket=4 ThreadsPerCore=2 RealMemory=3891 Gres=gpu:4 "
                     r"State=UNKNOWN$", slurm_conf_text, re.M), slurm_conf_text
    assert re.search(r"^NodeName=ct-priv CPUs=8 RealMemory=3891 Gres=gpu:1 State=UNKNOWN$", slurm_conf_text, re.M)
    unpriv = (tmp_path / "ct-split" / "cgroup.conf").read_text()
    assert "ConstrainDevices=no" in unpriv.splitlines() and "ConstrainDevices=yes" not in unpriv
    assert "unprivileged container" in unpriv and "EPERM" in unpriv
    priv = (tmp_path / "ct-priv" / "cgroup.conf").read_text().splitlines()
    assert "ConstrainDevices=yes" in priv and "ConstrainDevices=no" not in priv
    assert not (tmp_path / "ct-forced" / "cgroup.conf").exists()
    # cgroup v2: systemd manages slurmd's scope over D-Bus (the role starts dbus; no IgnoreSystemd route).
    assert not any(line.startswith(("IgnoreSystemd", "EnableControllers", "CgroupAutomount")) for line in unpriv.splitlines())
    # Job accounting: each step's memory and CPU use, the GPUs as a TRES (sacct per job).
    slurm_conf = (tmp_path / "ct-split" / "slurm.conf").read_text().splitlines()
    assert "JobAcctGatherType=jobacct_gather/linux" in slurm_conf and "AccountingStorageTRES=gres/gpu" in slurm_conf
    # Every node's slurm.conf names the TaskProlog (GPU isolation for steps without GPUs).
    assert f"TaskProlog={tmp_path / 'ct-priv'}/launch-task-prolog.sh" in (tmp_path / "ct-priv" / "slurm.conf").read_text()


# --- role argument specs -----------------------------------------------------------------------

BAD_ROLE_ARGS = {  # role: (variable, bad value, what the error names)
    "gpu_host": ("gpu_host_expected_gpus", "eight", "int"),
    "lxc_container": ("lxc_container_backend", "docker", "proxmox, lxc"),
    "toolchain": ("toolchain_verify", "sometimes", "bool"),
    "nvidia_userspace": ("nvidia_userspace_expected_gpus", "all", "int"),
    "node_caches": ("node_caches_vars", "TRITON_CACHE_DIR", "dict"),
    "python_env": ("python_env_flavour", "tpu", "cpu, gpu"),
    "slurm": ("slurm_slurmctld_port", "sixty", "int"),
    "keepalive": ("keepalive_manage_service", "perhaps", "bool"),
}


def test_every_role_rejects_a_bad_argument_before_any_task(tmp_path: Path) -> None:
    import yaml

    for role in BAD_ROLE_ARGS:
        assert (ANSIBLE_DIR / "roles" / role / "meta" / "argument_specs.yml").is_file(), role
    assert sorted(BAD_ROLE_ARGS) == sorted(p.name for p in (ANSIBLE_DIR / "roles").iterdir()), "every role"
    # block/rescue: the failed validation ends the role (no later task of it runs, nothing touches
    # this machine), and the play goes on to the next role.
    tasks = [{"name": f"bad {role}", "block": [{"ansible.builtin.include_role": {"name": role}, "vars": {var: value}}],
              "rescue": [{"ansible.builtin.debug": {"msg": f"rescued {role}"}}]}
             for role, (var, value, _) in BAD_ROLE_ARGS.items()]
    play = tmp_path / "bad-args.yml"
    play.write_text(yaml.safe_dump([{"hosts": "localhost", "gather_facts": False, "tasks": tasks}], sort_keys=False))
    inventory = write_inventory(tmp_path / "inv.yml", {"all": {"hosts": {"localhost": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}})
    proc, recap = run_playbook(inventory, playbook=play, env={"ANSIBLE_ROLES_PATH": str(ANSIBLE_DIR / "roles")})
    assert recap["localhost"]["failed"] == 0 and recap["localhost"]["changed"] == 0, proc.stdout[-3000:]
    parts = re.split(r"msg: rescued (\w+)", proc.stdout)  # [before 1st, role 1, between 1st and 2nd, role 2, ...]
    sections = {parts[i]: parts[i - 1] for i in range(1, len(parts), 2)}
    assert sorted(sections) == sorted(BAD_ROLE_ARGS), proc.stdout[-3000:]
    for role, (var, _value, expected) in BAD_ROLE_ARGS.items():
        section = sections[role]
        role_tasks = re.findall(rf"^TASK \[{role} : (.*?)\] \*", section, re.M)
        assert len(role_tasks) == 1 and role_tasks[0].startswith("Validating arguments against arg spec 'main'"), \
            (role, role_tasks)
        assert "Validation of arguments failed" in section and var in section and expected in section, section[-1500:]
        assert f"name: {role}" in section, section[-1500:]  # validate_args_context names the role


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
        self.vault_password = root / "vault-password"
        # What the playbook and the inventory check read the munge key's vault file with.
        self.env = {"ANSIBLE_VAULT_PASSWORD_FILE": str(self.vault_password)}
        self.runs: dict[str, tuple[subprocess.CompletedProcess[str], dict, float]] = {}

    def run(self, label: str, *args: str) -> tuple[subprocess.CompletedProcess[str], dict, float]:
        start = time.monotonic()
        proc, recap = run_playbook(self.inventory, *args, env=self.env)
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
    # Scratch on storage of its own (a tmpfs), not on the file system of the container's rootfs.
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "launch-test-scratch", str(ct.scratch)], check=True)
    dev, proc_devices = make_standin_gpus(ct.root, gpus=3)
    ct.dev = dev
    ct.inventory = write_inventory(ct.root / "inventory.yml", lxc_inventory(
        ct.root, name=ct.name, lxc_path=ct.lxc_path, dev=dev, proc_devices=proc_devices,
        scratch=ct.scratch, template=cached_rootfs_tarball(), gpus=[0, 1], expected_gpus=3,
    ))
    ct.vault_password.write_text(base64.b64encode(os.urandom(24)).decode() + "\n")
    ct.vault_password.chmod(0o600)
    write_vaulted_vars(ct.root / "group_vars" / "gpu_containers" / "vault.yml", {"slurm_munge_key_b64": ct.munge_key},
                       ct.vault_password)
    try:
        ct.run("first")
        yield ct
    finally:
        destroy_container(ct.lxc_path, ct.name)
        subprocess.run(["umount", str(ct.scratch)], check=False)


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
    allow = re.findall(r"^lxc\.cgroup2?\.devices\.allow = (.*)$", block, re.M)
    # Each of the container's own nodes by major:minor (ct_gpus [0, 1]: not nvidia2), for the
    # cgroup v1 and v2 keys of this hybrid host; never a whole major.
    minors = [0, 1, 1, 254, 255]  # nvidia0, nvidia1, nvidia-caps/nvidia-cap1, nvidia-uvm, nvidiactl
    assert allow == [f"c {STANDIN_MAJOR}:{m} rwm" for m in minors for _ in range(2)]
    assert ":* rwm" not in block and "optional" not in block
    dev = provisioned.dev
    assert re.findall(r"^lxc\.mount\.entry = (.*)$", block, re.M) == [
        f"{dev}/{name} dev/{name} none bind,create=file 0 0"
        for name in ("nvidia0", "nvidia1", "nvidia-caps/nvidia-cap1", "nvidia-uvm", "nvidiactl")]
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
    # Least privilege: a node made for another GPU's minor (nvidia2, not in ct_gpus) cannot be opened.
    other = provisioned.attach(f"mknod /tmp/gpu2 c {STANDIN_MAJOR} 2 && python3 -c 'open(\"/tmp/gpu2\", \"rb\")'",
                               check=False)
    assert other.returncode != 0 and "Operation not permitted" in other.stderr, other.stderr


@pytest.mark.lxc
@pytest.mark.slow
def test_nvidia_smi_and_driver_version_checks_inside(provisioned: Provisioned, tmp_path: Path) -> None:
    """nvidia_userspace's checks against a stand-in nvidia-smi (tests/ansible_fixtures.py): the
    container's GPUs are listed, and a userspace version unlike the host module's fails naming both."""
    rootfs = provisioned.lxc_path / provisioned.name / "rootfs"
    install_nvidia_smi_standin(rootfs, "550.54.15")
    assert provisioned.attach("nvidia-smi -L").stdout.count("GPU-standin-") == 2  # nvidia0, nvidia1
    play = tmp_path / "userspace.yml"
    play.write_text(f"- hosts: {provisioned.name}\n  gather_facts: false\n  roles: [nvidia_userspace]\n")
    host_version = '{"nvidia_userspace_driver_version": "550.54.15", "nvidia_userspace_expected_gpus": 2}'
    proc, recap = run_playbook(provisioned.inventory, "-e", host_version, playbook=play, env=provisioned.env)
    assert proc.returncode == 0 and recap[provisioned.name]["changed"] == 0, proc.stdout[-3000:]
    # Versions equal: the installer is skipped.
    assert re.search(r"TASK \[nvidia_userspace : Run the installer[^\n]*\n\s*skipping", proc.stdout), proc.stdout[-3000:]
    proc, _ = run_playbook(provisioned.inventory, "-e", host_version.replace(": 2}", ": 3}"), playbook=play,
                         env=provisioned.env)
    assert proc.returncode != 0 and "nvidia-smi -L lists 2 GPUs, expected 3" in proc.stdout + proc.stderr
    (rootfs / "etc" / "nvidia-standin-version").write_text("550.90.07\n")
    check_only = host_version.replace("}", ', "nvidia_userspace_install": false}')  # no installer offline
    proc, _ = run_playbook(provisioned.inventory, "-e", check_only, playbook=play, env=provisioned.env)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0
    assert "the userspace driver is 550.90.07 but the host's kernel module is 550.54.15" in out, out[-2000:]


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
    # A privileged container can load slurmd's cgroup-device program: confinement stays on.
    assert "ConstrainDevices=yes" in provisioned.attach("cat /etc/slurm/cgroup.conf").stdout.splitlines()
    # The job user the inventory names, with its uid (the same on every node).
    assert provisioned.attach("id -u alice").stdout.strip() == "1000"
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
                               playbook=play, env=provisioned.env)
    assert proc.returncode != 0 and recap[provisioned.name]["failed"] == 1
    assert f"node_caches_root=/scratch/cache is on {fstype}, a network file system" in proc.stdout


@pytest.mark.lxc
@pytest.mark.slow
def test_python_env_refuses_an_unpinned_install_on_a_node_with_a_wheelhouse(provisioned: Provisioned,
                                                                          tmp_path: Path) -> None:
    """A node provisioned offline (a wheelhouse on it) given only the unpinned package lists is
    refused before pip runs; nothing is installed."""
    rootfs = provisioned.lxc_path / provisioned.name / "rootfs"
    wheelhouse = rootfs / "var" / "cache" / "launch" / "wheelhouse"
    wheelhouse.mkdir(parents=True, exist_ok=True)
    (wheelhouse / "SHA256SUMS").write_text("")
    play = tmp_path / "python_env.yml"
    play.write_text(f"- hosts: {provisioned.name}\n  gather_facts: false\n  roles: [python_env]\n")
    try:
        proc, recap = run_playbook(provisioned.inventory, "-e", '{"python_env_packages": ["torch"]}', playbook=play,
                                   env=provisioned.env)
    finally:
        shutil.rmtree(rootfs / "var" / "cache" / "launch" / "wheelhouse")
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0 and recap[provisioned.name]["failed"] == 1
    assert (f"{provisioned.name}: a wheelhouse is at /var/cache/launch/wheelhouse but python_env_wheelhouse is not set; "
            "refusing to install torch unpinned from the network") in out, proc.stdout[-3000:]
    assert "TASK [python_env : Install the packages of flavour" not in proc.stdout


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


@pytest.mark.lxc
@pytest.mark.slow
def test_zz_munge_key_never_in_output_or_the_process_table(provisioned: Provisioned, tmp_path: Path) -> None:
    """The slurm role at -vvv installs a new munge key: the key appears neither in the output
    nor in any process's command line or environment while the run lasts (sampled from /proc)."""
    import threading

    key = base64.b64encode(os.urandom(1024)).decode()
    secrets = tmp_path / "secret.yml"
    secrets.write_text(f"slurm_munge_key_b64: {key}\n")
    secrets.chmod(0o600)
    play = tmp_path / "slurm.yml"
    play.write_text(f"- hosts: {provisioned.name}\n  gather_facts: false\n  roles: [slurm]\n")
    seen: list[str] = []
    done = threading.Event()

    def sample() -> None:
        needle = key[:40].encode()
        while not done.is_set():
            for proc_dir in Path("/proc").glob("[0-9]*"):
                for name in ("cmdline", "environ"):
                    try:
                        if needle in (proc_dir / name).read_bytes():
                            seen.append(f"{proc_dir.name}/{name}")
                    except OSError:
                        pass
            time.sleep(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        proc, recap = run_playbook(provisioned.inventory, "-vvv", "-e", f"@{secrets}", playbook=play,
                                   env=provisioned.env)
    finally:
        done.set()
        sampler.join()
    assert proc.returncode == 0 and recap[provisioned.name]["changed"] > 0, proc.stdout[-3000:]
    assert "Copy the munge key (base64) to the node" in proc.stdout and "Using module file" in proc.stdout  # at -vvv
    assert key[:40] not in proc.stdout + proc.stderr
    assert seen == [], f"the munge key was visible in /proc: {seen}"
    assert provisioned.attach("base64 -w0 /etc/munge/munge.key").stdout == key


def test_the_inventory_checks_ct_keys_are_exactly_the_ones_the_roles_read() -> None:
    """The unknown-`ct_*` refusal (a `ct_gpu:` typo) must know every key a role reads: a new one
    missing from the check's list would refuse every inventory that sets it."""
    sys.path.insert(0, str(ANSIBLE_DIR / "tools"))
    try:
        import check_inventory
    finally:
        sys.path.pop(0)
    read = set()
    for path in [*(ANSIBLE_DIR / "roles").rglob("*.yml"), *(ANSIBLE_DIR / "roles").rglob("*.j2")]:
        read |= set(re.findall(r"\bct_[a-z0-9_]+", path.read_text()))
    assert read == set(check_inventory.CT_KEYS), sorted(read ^ set(check_inventory.CT_KEYS))


def test_slurm_packages_the_apt_sources_lack_are_refused_before_apt(tmp_path: Path) -> None:
    """Ubuntu ships Slurm in `universe`: a template without it has no candidate for slurmd, and apt
    would fail mid-play. The role's check asks this machine's real apt (`apt-cache policy`): the
    installed Slurm packages pass, a package no source offers is refused, named, before any apt."""
    playbook = tmp_path / "check.yml"
    tasks = ANSIBLE_DIR / "roles" / "slurm" / "tasks" / "apt_sources.yml"
    os_release = tmp_path / "os-release"  # an Ubuntu CT's; the play gathers no facts, as provision.yml
    os_release.write_text('PRETTY_NAME="Ubuntu 24.04.2 LTS"\nNAME="Ubuntu"\nID=ubuntu\nID_LIKE=debian\n')
    playbook.write_text(
        "- hosts: localhost\n  connection: local\n  gather_facts: false\n  tasks:\n"
        f"    - ansible.builtin.include_tasks: {tasks}\n"
        f"      vars:\n        slurm_apt_check_packages: \"{{{{ pkgs }}}}\"\n        slurm_os_release_path: {os_release}\n")
    inventory = write_inventory(tmp_path / "inv.yml", {"all": {"hosts": {"localhost": {
        "ansible_connection": "local", "ansible_python_interpreter": sys.executable}}}})
    proc, recap = run_playbook(inventory, "-e", '{"pkgs": ["slurmd", "munge"]}', playbook=playbook, timeout=180)
    assert proc.returncode == 0 and recap["localhost"]["failed"] == 0, proc.stdout[-2000:]
    proc, _ = run_playbook(inventory, "-e", '{"pkgs": ["slurmd", "slurmd-not-in-any-source"]}', playbook=playbook,
                           timeout=180)
    out = " ".join(proc.stdout.split())
    assert proc.returncode != 0
    assert "the apt sources of localhost offer no slurmd-not-in-any-source;" in out, out[-2000:]
    assert "offer no slurmd," not in out  # the one that is there is not named
    assert "Ubuntu ships Slurm in its universe component: add-apt-repository universe" in out, out[-2000:]
