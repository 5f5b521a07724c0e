"""A Slurm job inside a real unprivileged LXC container, provisioned by the project's roles.

Real: Debian's LXC running an unprivileged container mapped as Proxmox maps a CT (container ids
0..65535 = host 100000..165535, `lxc.idmap`), its bookworm rootfs unpacked inside that mapping by
the `lxc` backend, Ansible and every role of provision.yml through the `lxc_attach` connection,
Debian's Slurm (slurmctld + slurmd, 22.05 on bookworm) and munge installed by the slurm role from
the rootfs's offline apt archive, `srun` as an ordinary job user.
Stand-ins: the GPU device nodes (major 195, no driver: opening one the cgroup allows gives ENXIO).
Not modelled (tests/README.md): the container's init is `sleep` (the test starts munged,
slurmctld and slurmd itself, not systemd); this host's cgroups are v1, where the cgroup plugins
cannot run in an unprivileged CT (proctrack/linuxproc and task/affinity here); no slurmdbd.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import time

import pytest

from tests.ansible_fixtures import (
    GPU_PROBE_JOB,
    HAS_USERNSEXEC,
    NO_GPU_JOB,
    PVE_IDMAP_BASE,
    TEST_SLURM_BASE,
    cached_rootfs_tarball,
    destroy_container,
    lxc_attach,
    lxc_inventory,
    make_standin_gpus,
    run_playbook,
    traversable_tmp_dir,
    write_inventory,
    write_vaulted_vars,
)

NEEDS = pytest.mark.skipif(
    not (os.geteuid() == 0 and HAS_USERNSEXEC and all(shutil.which(t) for t in ("lxc-start", "lxc-attach", "debootstrap"))),
    reason="needs root, Debian's lxc (lxc-usernsexec) and debootstrap")
JOB_UID = 1000


@pytest.mark.lxc
@pytest.mark.slow
@NEEDS
def test_a_slurm_job_runs_in_a_real_unprivileged_container() -> None:
    root = traversable_tmp_dir("launch-uct-")  # the mapped root must traverse every path LXC hands it
    name = f"launch-uct-{os.getpid()}"
    lxc_path = root / "lxc"
    lxc_path.mkdir()
    scratch = root / "scratch"
    dev, proc_devices = make_standin_gpus(root, gpus=2)
    data = lxc_inventory(root, name=name, lxc_path=lxc_path, dev=dev, proc_devices=proc_devices, scratch=scratch,
                         template=cached_rootfs_tarball(TEST_SLURM_BASE), gpus=[0, 1], expected_gpus=2)
    group = data["all"]["children"]["gpu_containers"]["children"]["localhost_containers"]
    group["hosts"][name].update({"ct_unprivileged": True, "ct_scratch_allow_rootfs_storage": True})
    for key in ("slurm_user", "slurm_munge_user"):  # the packages' own users
        group["vars"].pop(key)
    group["vars"].update({
        "slurm_install_packages": True,
        # Accounting (slurmdbd + MariaDB) is test_provision_local's; here slurm.conf's
        # AccountingStorage lines are dropped before slurmctld starts (see below).
        "slurm_accounting": False,
        # This host's cgroups are v1: container root (host uid 100000) may not move a job
        # user's task into a v1 cgroup (the kernel wants global root or the task's own uid:
        # EACCES), so the cgroup plugins cannot work in this CT here; tests/README.md says so.
        "slurm_proctrack_type": "proctrack/linuxproc",
        "slurm_task_plugin": "task/affinity",
        "slurm_jobacct_gather_type": "jobacct_gather/linux",
    })
    # A network of its own (a veth with no bridge): getaddrinfo's AI_ADDRCONFIG, which Slurm
    # uses, finds no address for the node's own name when the CT has loopback only.
    data["all"]["children"]["container_hosts"]["children"]["lxc_hosts"]["hosts"]["localhost"]["lxc_container_lxc_net"] = {
        "type": "veth", "flags": "up", "ipv4.address": "10.213.7.2/24"}
    inventory = write_inventory(root / "inventory.yml", data)
    password = root / "vault-password"
    password.write_text(base64.b64encode(os.urandom(24)).decode() + "\n")
    password.chmod(0o600)
    write_vaulted_vars(root / "group_vars" / "gpu_containers" / "vault.yml",
                       {"slurm_munge_key_b64": base64.b64encode(os.urandom(64)).decode()}, password)

    def inside(script: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return lxc_attach(lxc_path, name, script, check=check)

    def logs() -> str:
        return inside("tail -n 25 /var/log/slurm/*.log; sinfo; squeue", check=False).stdout[-4000:]

    try:
        proc, recap = run_playbook(inventory, env={"ANSIBLE_VAULT_PASSWORD_FILE": str(password)}, timeout=1200)
        assert proc.returncode == 0 and recap[name]["failed"] == 0, proc.stdout[-5000:] + proc.stderr[-2000:]
        # Unprivileged as PVE makes it: container root is host uid 100000, the rootfs is shifted.
        assert inside("cat /proc/self/uid_map").stdout.split() == ["0", str(PVE_IDMAP_BASE), "65536"]
        rootfs = lxc_path / name / "rootfs"
        assert (rootfs / "etc" / "passwd").stat().st_uid == PVE_IDMAP_BASE
        assert scratch.stat().st_uid == PVE_IDMAP_BASE

        # The init here is `sleep`: mount the cgroup v1 hierarchies as the CT's systemd would at
        # boot (slurmd reads them at start even with the cgroup plugins off).
        inside("mount -t tmpfs -o mode=755 cgroup /sys/fs/cgroup && "
               "for c in $(cut -d: -f2 /proc/self/cgroup); do d=${c#name=}; mkdir -p /sys/fs/cgroup/$d; "
               "case $c in name=*) o=none,$c ;; *) o=$c ;; esac; mount -t cgroup -o $o cgroup /sys/fs/cgroup/$d; done")
        assert inside("id -u alice").stdout.strip() == str(JOB_UID)  # the slurm role's job user
        # No slurmdbd in this CT: a first slurmctld start with an unreachable database stops
        # ("no TRES from it"); everything else is the config the roles rendered.
        inside("sed -i '/^AccountingStorage/d' /etc/slurm/slurm.conf")
        inside("install -d -o munge -g munge -m 0755 /run/munge && runuser -u munge -- /usr/sbin/munged")
        for daemon in ("slurmctld", "slurmd"):
            started = inside(f"/usr/sbin/{daemon}", check=False)
            assert started.returncode == 0, f"{daemon}: {started.stdout}{started.stderr}" + logs()
        state = ""
        for _ in range(60):
            state = inside(f"sinfo -h -n {name} -o %t", check=False).stdout.strip()
            if state in ("idle", "mix"):
                break
            time.sleep(1)
        assert state == "idle", logs()

        # The job scripts, written into the rootfs from the host (no quoting through three shells).
        jobs = {"gpu-job": "#!/bin/sh\nid -u > /scratch/gpu-job\necho CVD=$CUDA_VISIBLE_DEVICES\n"
                           "exec python3 /usr/local/bin/gpu-probe.py\n",
                "gpu-probe.py": GPU_PROBE_JOB,
                "no-gpu-job": NO_GPU_JOB}
        for script, text in jobs.items():
            (rootfs / "usr" / "local" / "bin" / script).write_text(text)
            (rootfs / "usr" / "local" / "bin" / script).chmod(0o755)

        def srun(args: str, script: str) -> subprocess.CompletedProcess[str]:
            return inside(f"cd /tmp && runuser -u alice -- timeout 120 srun -N1 -n1 {args} /usr/local/bin/{script}",
                          check=False)

        gpu = srun("--gres=gpu:1", "gpu-job")
        assert gpu.returncode == 0, gpu.stdout + gpu.stderr + logs()
        lines = gpu.stdout.splitlines()
        assert "CVD=0" in lines, lines
        # The step's own GPU node opens as far as the (absent) driver: ENXIO, the cgroup let it through.
        assert any(line.startswith("open ") and line.endswith(" ENXIO") for line in lines), lines
        # /scratch as the job user: the host side shows the job user's file owned by its mapped uid.
        assert (scratch / "gpu-job").read_text().strip() == str(JOB_UID)
        assert (scratch / "gpu-job").stat().st_uid == PVE_IDMAP_BASE + JOB_UID

        none = srun("", "no-gpu-job")
        assert none.returncode == 0, none.stdout + none.stderr + logs()
        # A step without --gres sees no GPU: the TaskProlog set both empty (Slurm alone leaves them unset).
        assert none.stdout.splitlines() == ["CUDA_VISIBLE_DEVICES=", "NVIDIA_VISIBLE_DEVICES="], none.stdout
    finally:
        destroy_container(lxc_path, name)  # lxc-stop -k: the daemons go with the container
        shutil.rmtree(root, ignore_errors=True)
