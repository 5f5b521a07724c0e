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
    lxc_attach,
    lxc_inventory,
    make_standin_gpus,
    run_playbook,
    traversable_tmp_dir,
    write_inventory,
    write_vaulted_vars,
)
from tests.pve_backend import USERSPACE_SHA, needs_root

GOLDEN = Path(__file__).parent / "golden"
IS_ROOT = os.geteuid() == 0
HAS_LXC = all(shutil.which(tool) for tool in ("lxc-create", "lxc-start", "lxc-attach", "debootstrap"))
needs_userns = pytest.mark.skipif(not (IS_ROOT and HAS_USERNSEXEC),
                                  reason="needs root and lxc-usernsexec (LXC) + setpriv for a mapped user namespace")
needs_lxc = pytest.mark.skipif(not (IS_ROOT and HAS_LXC), reason="needs root and Debian's lxc + debootstrap")


def check_inventory(path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECK_INVENTORY), str(path), *args],
                          capture_output=True, text=True, timeout=120)


# --- inventories ------------------------------------------------------------------------------



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
