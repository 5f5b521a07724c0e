"""A Proxmox VE host on this machine for the provisioning plays: inventory/kpro6.yml run against
the state-only `pct` stand-in (tests/pct_lxc_standin.py) with stand-in GPU nodes, /proc/devices,
storage.cfg and PVE version. Used by test_ansible_backend_*.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.ansible_fixtures import (
    ANSIBLE_DIR,
    install_pct_standin,
    make_standin_gpus,
    run_playbook,
    write_inventory,
)
from tests.test_cpu_topology import epyc_lscpu

GOLDEN = Path(__file__).parent / "golden"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="mknod of stand-in device nodes and LXC need root")
# A well-formed checksum for the userspace installer of the stand-in driver version (tests only:
# no installer is downloaded here).
USERSPACE_SHA = {"550.54.15": "ab" * 32}


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


def play_ok(run: tuple[subprocess.CompletedProcess[str], dict], host: str = "kpro6") -> dict:
    proc, recap = run
    assert proc.returncode == 0 and recap[host]["failed"] == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    return recap[host]


def golden(name: str, pve: PveHost) -> str:
    return (GOLDEN / name).read_text().replace("<DEV>", str(pve.dev)).replace("<SCRATCH>", str(pve.scratch))


