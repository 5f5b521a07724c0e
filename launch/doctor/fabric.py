"""NVSwitch hosts: Fabric Manager must run, at the driver's exact version, before CUDA works.

On an HGX/NVSwitch board (8x H100/H200 SXM) the GPUs join the NVLink fabric only once
`nv-fabricmanager` (package nvidia-fabricmanager, the same version as the kernel driver) has
configured the switches. Until then every CUDA initialisation fails with error 802,
cudaErrorSystemNotReady ("system not yet initialized"), whatever the job does.

The switches show as /dev/nvidia-nvswitchN (and nvidia-nvswitchctl). A container does not see
the host's processes: there the check cannot tell, and says where to look.

Test seam: LAUNCH_DOCTOR_DEV_DIR names a directory read instead of /dev (stand-in nodes).
"""

from __future__ import annotations

import os
from pathlib import Path

from launch.doctor.context import DoctorContext
from launch.doctor.results import CheckResult, Status

FABRIC_MANAGER = "nv-fabricmanager"
DRIVER_VERSION_FILE = Path("/sys/module/nvidia/version")


def nvswitch_nodes(env: dict[str, str] | os._Environ[str]) -> list[str]:
    dev = Path(env.get("LAUNCH_DOCTOR_DEV_DIR") or "/dev")
    names = [p.name for p in dev.glob("nvidia-nvswitch*") if p.name.removeprefix("nvidia-nvswitch").isdigit()]
    return sorted(names, key=lambda n: int(n.removeprefix("nvidia-nvswitch")))


def fabric_manager_pids() -> list[int]:
    """Processes whose argv[0] is nv-fabricmanager (comm is cut at 15 characters, so not comm)."""
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            argv0 = (proc / "cmdline").read_bytes().split(b"\0", 1)[0].decode(errors="replace")
        except OSError:
            continue
        if os.path.basename(argv0) == FABRIC_MANAGER:
            pids.append(int(proc.name))
    return pids


def in_container() -> bool:
    """An LXC (or nspawn/podman) container: init's `container=` variable, or systemd's marker of it.
    Docker sets neither; this project's nodes are LXC containers."""
    if Path("/run/systemd/container").exists():
        return True
    try:
        return b"container=" in Path("/proc/1/environ").read_bytes()
    except OSError:  # unreadable: systemd's marker was the answer
        return False


def driver_version(ctx: DoctorContext) -> str:
    try:
        return DRIVER_VERSION_FILE.read_text().strip()
    except OSError:
        return ctx.gpus[0].driver if ctx.gpus else ""


def check_fabric_manager(ctx: DoctorContext) -> CheckResult:
    name = "gpus.fabricmanager"
    switches = nvswitch_nodes(ctx.env)
    if not switches:
        return CheckResult(name, Status.SKIP, "no /dev/nvidia-nvswitch* nodes: not an NVSwitch host")
    shown = f"{len(switches)} NVSwitch nodes ({switches[0]}..{switches[-1]})"
    version = driver_version(ctx)
    package = f"nvidia-fabricmanager of the driver's exact version ({version})" if version else \
        "nvidia-fabricmanager of the driver's exact version"
    pids = fabric_manager_pids()
    if pids:
        return CheckResult(name, Status.PASS, f"{shown}; {FABRIC_MANAGER} runs (pid {pids[0]})")
    if in_container():
        return CheckResult(name, Status.WARN, f"{shown} in a container, which cannot see the host's {FABRIC_MANAGER}",
                           "on the host: systemctl status nvidia-fabricmanager (CUDA error 802 until it runs)")
    return CheckResult(
        name, Status.FAIL,
        f"{shown} but no {FABRIC_MANAGER} process: CUDA initialisation fails with error 802 "
        "(cudaErrorSystemNotReady, 'system not yet initialized')",
        f"install {package} and run systemctl enable --now nvidia-fabricmanager (make provision does both)")


def check_fabric(ctx: DoctorContext) -> list[CheckResult]:
    return [check_fabric_manager(ctx)]
