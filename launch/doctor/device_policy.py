"""`slurm.devices`: which GPU device policy this node's Slurm has, and whether it can work here.

ConstrainDevices=yes makes slurmd (root) load a cgroup-device eBPF program per job on cgroup v2,
so a job opens only its own GPUs. That load needs root of the initial user namespace: in an
unprivileged container (root mapped to, e.g., host uid 100000) it fails with EPERM and GPU steps
fail. There ConstrainDevices=no is the only policy that works: every job on the node can open
every GPU the container has, and CUDA_VISIBLE_DEVICES alone keeps jobs apart. (On cgroup v1
slurmd writes devices.deny instead, which needs the same initial-namespace root: the probe
answers for both.)
"""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

from launch.doctor.bpf_probe import load_cgroup_device_program
from launch.doctor.context import DoctorContext
from launch.doctor.results import CheckResult, Status

NAME = "slurm.devices"
FIX_FORCED = ("set ConstrainDevices=no in cgroup.conf (the slurm role's slurm_constrain_devices: auto does for an "
              "unprivileged container), or run slurmd where it can load it: a privileged container or the host")


def root_mapping(uid_map: Path = Path("/proc/self/uid_map")) -> int | None:
    """The host uid this namespace's uid 0 is; None when uid 0 is not mapped or the map is unreadable."""
    try:
        for line in uid_map.read_text().splitlines():
            inner, outer, count = (int(x) for x in line.split())
            if inner <= 0 < inner + count:
                return outer - inner
    except (OSError, ValueError):
        return None
    return None


def read_setting(path: Path, key: str) -> str | None:
    """The last `key=value` of a Slurm config file (keys are case-insensitive; `#` starts a comment)."""
    value = None
    for line in path.read_text(errors="replace").splitlines():
        match = re.match(rf"^\s*{key}\s*=\s*(\S+)", line.split("#", 1)[0], re.I)
        if match:
            value = match[1]
    return value


def can_load_device_program(mapped_root: int | None) -> tuple[bool, str]:
    """Whether slurmd (root here) can load the program: probed when we are root, else judged by
    the namespace (an ordinary user may not load BPF programs anywhere, which says nothing)."""
    where = ("the initial user namespace" if mapped_root == 0 else
             f"a user namespace (uid 0 is host uid {mapped_root})" if mapped_root else "a user namespace")
    if os.geteuid() == 0:
        result = load_cgroup_device_program()
        if result == 0:
            return True, f"a cgroup device program loads here ({where})"
        if result is not None:
            return False, f"loading a cgroup device program fails with {errno.errorcode.get(result, result)} ({where})"
    return mapped_root == 0, f"not probed (not root); this node is in {where}"


def check_device_policy(ctx: DoctorContext) -> list[CheckResult]:
    slurm_conf = Path(ctx.env.get("SLURM_CONF") or "/etc/slurm/slurm.conf")
    cgroup_conf = slurm_conf.parent / "cgroup.conf"
    if not slurm_conf.is_file():
        return [CheckResult(NAME, Status.SKIP, f"no {slurm_conf}: not a Slurm node")]
    task_plugin = read_setting(slurm_conf, "TaskPlugin") or "task/none"
    constrain = (read_setting(cgroup_conf, "ConstrainDevices") if cgroup_conf.is_file() else None) or "no"
    if "task/cgroup" not in task_plugin:
        return [CheckResult(NAME, Status.PASS, f"devices not confined by Slurm (TaskPlugin={task_plugin}): a job "
                                               "can open every GPU of the node; CUDA_VISIBLE_DEVICES keeps jobs apart")]
    loads, how = can_load_device_program(root_mapping())
    if constrain.lower() == "yes":
        if loads:
            return [CheckResult(NAME, Status.PASS, f"ConstrainDevices=yes: a job opens only its own GPUs; {how}")]
        return [CheckResult(NAME, Status.FAIL, f"ConstrainDevices=yes but {how}: slurmd cannot confine GPU steps, "
                                               "they fail", FIX_FORCED)]
    if loads:
        return [CheckResult(NAME, Status.WARN, f"ConstrainDevices={constrain}: a job can open every GPU of the node, "
                                               f"though confinement would work ({how})",
                            "set ConstrainDevices=yes (slurm_constrain_devices: auto does on a privileged container "
                            "or bare metal)")]
    return [CheckResult(NAME, Status.PASS, f"ConstrainDevices={constrain}: a job can open every GPU of the container "
                                           f"(the only policy that works: {how}); CUDA_VISIBLE_DEVICES keeps jobs apart")]
