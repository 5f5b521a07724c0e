"""The KVM guest's side of tests/test_kvm_guest_ct.py: run inside the guest as root with the
test's own interpreter (`python -m tests.kvm_ct_scenario STEP WORK [TEMPLATE]`).

setup:     the stand-in GPUs, the inventory (CT 200's shape: unprivileged, mapped as PVE maps it,
           systemd as init, Slurm with accounting and the cgroup plugins) and the vaulted munge key
provision: provision.yml through the lxc backend (`... provision WORK LOG`); prints the recap as one JSON line

Everything is under WORK, a folder on the guest's own disk.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.ansible_fixtures import (
    ANSIBLE_DIR,
    PLAYBOOK,
    RECAP,
    REPO,
    ansible_bin,
    lxc_inventory,
    make_standin_gpus,
    write_inventory,
    write_vaulted_vars,
)

NAME = "ct200"
# The CT's own address on a veth with no bridge (Slurm resolves the node's name with
# AI_ADDRCONFIG, which needs a non-loopback address).
CT_ADDRESS = "10.213.7.2/24"


def setup(work: Path, template: Path) -> None:
    work.mkdir(parents=True, exist_ok=True)
    work.chmod(0o755)  # the mapped root (guest uid 100000) traverses it to its rootfs
    lxc_path = work / "lxc"
    lxc_path.mkdir(exist_ok=True)
    dev, proc_devices = make_standin_gpus(work, gpus=2)
    data = lxc_inventory(work, name=NAME, lxc_path=lxc_path, dev=dev, proc_devices=proc_devices,
                         scratch=work / "scratch", template=template, gpus=[0, 1], expected_gpus=2)
    host = data["all"]["children"]["container_hosts"]["children"]["lxc_hosts"]["hosts"]["localhost"]
    # systemd is the CT's init (LXC's default /sbin/init), as in a PVE CT.
    host.pop("lxc_container_init_cmd")
    host["lxc_container_lxc_net"] = {"type": "veth", "flags": "up", "ipv4.address": CT_ADDRESS}
    group = data["all"]["children"]["gpu_containers"]["children"]["localhost_containers"]
    group["hosts"][NAME].update({"ct_unprivileged": True, "ct_scratch_allow_rootfs_storage": True})
    # The roles' own defaults for what the fixture's shared inventory turns off: the packages'
    # users, Slurm installed and its services (munge, MariaDB, slurmdbd, slurmctld, slurmd)
    # started by the role, accounting on, proctrack/cgroup and task/cgroup, JobAcctGatherType
    # auto (the cgroup gatherer on this cgroup v2 CT).
    for key in ("slurm_user", "slurm_munge_user", "slurm_install_packages", "slurm_manage_services"):
        group["vars"].pop(key)
    write_inventory(work / "inventory.yml", data)
    password = work / "vault-password"
    password.write_text(base64.b64encode(os.urandom(24)).decode() + "\n")
    password.chmod(0o600)
    write_vaulted_vars(work / "group_vars" / "gpu_containers" / "vault.yml",
                       {"slurm_munge_key_b64": base64.b64encode(os.urandom(64)).decode()}, password)


def provision(work: Path, log: Path) -> int:
    """provision.yml as `make provision` runs it, its output streamed to `log` (the host reads it
    while the play runs); the recap as one JSON line."""
    env = {**os.environ, "ANSIBLE_CONFIG": str(ANSIBLE_DIR / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_FORCE_COLOR": "0", "PYTHONUNBUFFERED": "1",
           "ANSIBLE_VAULT_PASSWORD_FILE": str(work / "vault-password")}
    with open(log, "w") as out:
        rc = subprocess.run([ansible_bin("ansible-playbook"), "-i", str(work / "inventory.yml"), str(PLAYBOOK)],
                            stdout=out, stderr=subprocess.STDOUT, env=env, cwd=REPO, timeout=3000).returncode
    text = log.read_text()
    recap = {m[0]: {"ok": int(m[1]), "changed": int(m[2]), "unreachable": int(m[3]), "failed": int(m[4])}
             for m in RECAP.findall(text)}
    print(json.dumps({"rc": rc, "recap": recap}))
    if rc != 0:
        print(text[-10000:])
    return rc


def main(argv: list[str]) -> int:
    step, work = argv[0], Path(argv[1])
    if step == "setup":
        setup(work, Path(argv[2]))
        return 0
    if step == "provision":
        return provision(work, Path(argv[2]))
    print(f"unknown step {step}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
