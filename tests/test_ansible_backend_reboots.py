"""The Proxmox backend against the state-only `pct` stand-in (tests/pve_backend.py): changes
that need a CT reboot (new GPUs on PVE 8, a new hostname) wait until the node is drained; the
route and DNS wait before the first apt; scratch and driver-checksum refusals.

Split from test_ansible_provision.py so the containers tier's workers run these plays beside
the real containers (tests/README.md: the tiers).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from tests.ansible_fixtures import (
    PVE_IDMAP_BASE,
    run_playbook,
    write_inventory,
)
from tests.pve_backend import USERSPACE_SHA, PveHost, needs_root, play_ok


@needs_root
def test_new_gpus_on_pve_8_stay_pending_and_reboot_only_once_drained(tmp_path: Path) -> None:
    """PVE 8.x does not hot-plug a new devN (pve-container < 6.0.4): adding two GPUs while Slurm
    runs a job sets them (memory hot-plugged), the reboot they need is refused naming them, and
    the run after draining reboots exactly once; then changed=0."""
    pve = PveHost(tmp_path, pve_version="8.4.1", ct_gpus=[0, 1, 2, 3, 4, 5])
    play_ok(pve.run())
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
    play_ok(pve.run())
    assert pve.commands() == ["pct reboot 200"]
    conf = pve.conf.read_text()
    assert "[pve:pending]" not in conf and "/dev/nvidia7," in conf
    assert play_ok(pve.run())["changed"] == 0 and pve.commands() == []

@needs_root
def test_a_new_hostname_is_set_and_a_reboot_waits_until_the_jobs_can_be_counted(tmp_path: Path) -> None:
    """A changed ct_hostname (slurm.conf's NodeName follows it) is set on the CT (`pct set
    --hostname`, written at once on PVE 8) and owes a reboot. With the controller unreachable
    (squeue fails) and a slurmstepd in the CT the jobs cannot be counted: the reboot is refused,
    not done under running steps; once no slurmstepd runs, the CT reboots exactly once."""
    pve = PveHost(tmp_path, pve_version="8.2.4")
    play_ok(pve.run())
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
    play_ok(pve.run())
    assert pve.commands() == ["pct reboot 200"]
    assert play_ok(pve.run())["changed"] == 0 and pve.commands() == []

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
    play_ok(pve.run())
    pve.jobs.write_text("4242\n")  # Slurm runs job 4242 on the node

    pve.container(ct_gpus=[0, 1, 2, 3, 4, 5, 6, 7], ct_memory_mb=262144)
    play_ok(pve.run())
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
    play_ok(pve.run())
    assert pve.commands() == ["pct reboot 200"], "exactly one reboot, nothing set again"
    conf = pve.conf.read_text()
    assert "[pve:pending]" not in conf and "/dev/nvidia6" not in conf and "/dev/nvidia7" not in conf
    assert play_ok(pve.run())["changed"] == 0 and pve.commands() == []
    assert play_ok(pve.run("--check", "--diff"))["changed"] == 0 and pve.commands() == []

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
    play_ok(pve.run())
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
    play_ok(pve.run())
    assert (pve.scratch / "ct200").stat().st_uid == PVE_IDMAP_BASE and pve.scratch.stat().st_uid == 0

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
    play_ok(pve.run())

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
