"""Two rows about this node's slurmd in a container.

`slurm.cgroup`: on cgroup v2, Slurm's cgroup/v2 plugin creates slurmd's scope through systemd over
D-Bus (unless cgroup.conf says IgnoreSystemd=yes); with no system bus slurmd exits at start.

`slurm.gpu_isolation`: with ConstrainDevices off (an unprivileged container cannot load the
cgroup-device program), Slurm leaves CUDA_VISIBLE_DEVICES unset for a step without GPUs, which
CUDA reads as "every GPU". The provisioned TaskProlog sets it (and NVIDIA_VISIBLE_DEVICES) empty
there; this row runs the TaskProlog as slurmstepd would for such a step and reads what it exports.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
from pathlib import Path

from launch.doctor.context import DoctorContext
from launch.doctor.device_policy import read_setting
from launch.doctor.results import CheckResult, Status

CGROUP = "slurm.cgroup"
ISOLATION = "slurm.gpu_isolation"
SYSTEM_BUS = Path("/run/dbus/system_bus_socket")
CGROUP_ROOT = Path("/sys/fs/cgroup")


def _slurm_conf(ctx: DoctorContext) -> Path:
    return Path(ctx.env.get("SLURM_CONF") or "/etc/slurm/slurm.conf")


def _yes(value: str | None) -> bool:
    return (value or "").lower() in ("yes", "true", "1")


def bus_answers(path: Path) -> bool:
    """Whether something accepts connections on the D-Bus system socket."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(2)
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


def check_cgroup_plugin(ctx: DoctorContext, cgroup_root: Path = CGROUP_ROOT, bus: Path = SYSTEM_BUS) -> CheckResult:
    slurm_conf = _slurm_conf(ctx)
    if not slurm_conf.is_file():
        return CheckResult(CGROUP, Status.SKIP, f"no {slurm_conf}: not a Slurm node")
    cgroup_conf = slurm_conf.parent / "cgroup.conf"
    settings = {key: read_setting(cgroup_conf, key) if cgroup_conf.is_file() else None
                for key in ("CgroupPlugin", "IgnoreSystemd")}
    plugin = (settings["CgroupPlugin"] or "autodetect").lower()
    v2 = (cgroup_root / "cgroup.controllers").is_file()  # the unified hierarchy's root file
    if plugin in ("cgroup/v1", "disabled") or (plugin == "autodetect" and not v2):
        return CheckResult(CGROUP, Status.PASS, f"CgroupPlugin={plugin} on cgroup {'v2' if v2 else 'v1'}: no D-Bus needed")
    if _yes(settings["IgnoreSystemd"]):
        return CheckResult(CGROUP, Status.PASS, f"CgroupPlugin={plugin} with IgnoreSystemd=yes: slurmd builds its "
                                                "cgroup tree itself, no D-Bus needed")
    if bus_answers(bus):
        return CheckResult(CGROUP, Status.PASS, f"CgroupPlugin={plugin} on cgroup v2: the D-Bus system bus answers "
                                                f"({bus}); systemd manages slurmd's scope")
    return CheckResult(CGROUP, Status.FAIL, f"CgroupPlugin={plugin} on cgroup v2 and no D-Bus system bus at {bus}: "
                                            "Slurm's cgroup/v2 plugin asks systemd over D-Bus for slurmd's scope, so "
                                            "slurmd exits at start",
                       "install and start dbus (the slurm role's slurm_packages_node has it) in a CT whose init is systemd")


def _steps_without_gpus_envs(env: dict[str, str]) -> list[dict[str, str]]:
    """The environments slurmstepd gives a TaskProlog of a step that has no GPU: a job without
    GPUs, and a `srun --gres=none` step inside a GPU job (Slurm unsets the step's own variables,
    SLURM_JOB_GPUS stays inherited)."""
    drop = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "GPU_DEVICE_ORDINAL",
            "SLURM_GPUS_ON_NODE")
    no_gpu_job = {k: v for k, v in env.items() if k not in drop}
    return [no_gpu_job, {**no_gpu_job, "SLURM_JOB_GPUS": "0"}]


def check_gpu_isolation(ctx: DoctorContext) -> CheckResult:
    slurm_conf = _slurm_conf(ctx)
    if not slurm_conf.is_file():
        return CheckResult(ISOLATION, Status.SKIP, f"no {slurm_conf}: not a Slurm node")
    cgroup_conf = slurm_conf.parent / "cgroup.conf"
    task_plugin = read_setting(slurm_conf, "TaskPlugin") or ""
    constrain = read_setting(cgroup_conf, "ConstrainDevices") if cgroup_conf.is_file() else None
    if "task/cgroup" in task_plugin and _yes(constrain):
        return CheckResult(ISOLATION, Status.PASS, "ConstrainDevices=yes: Slurm confines each job to its GPUs")
    prolog = read_setting(slurm_conf, "TaskProlog")
    fix = ("a TaskProlog that prints `export CUDA_VISIBLE_DEVICES=` and `export NVIDIA_VISIBLE_DEVICES=` when the "
           "step's own SLURM_STEP_GPUS and SLURM_GPUS_ON_NODE are empty (the slurm role installs one)")
    if not prolog or not os.access(prolog, os.X_OK):
        return CheckResult(ISOLATION, Status.WARN, f"no executable TaskProlog ({prolog or 'none set'}) and devices not "
                                                   "confined: a job without --gres gets CUDA_VISIBLE_DEVICES unset and "
                                                   "sees every GPU of the node", fix)
    names = ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES")
    for step, step_env in zip(("a job without GPUs", "a --gres=none step inside a GPU job"),
                              _steps_without_gpus_envs(ctx.env), strict=True):
        try:
            out = subprocess.run([prolog], env=step_env, capture_output=True, text=True, timeout=20, check=False).stdout
        except (OSError, subprocess.TimeoutExpired) as err:
            return CheckResult(ISOLATION, Status.WARN, f"TaskProlog {prolog} could not run ({err})", fix)
        exports = dict(re.findall(r"^export ([A-Za-z_][A-Za-z0-9_]*)=(.*)$", out, re.M))
        shown = [name for name in names if exports.get(name, None) != ""]
        if shown:
            return CheckResult(ISOLATION, Status.WARN, f"TaskProlog {prolog} leaves {' and '.join(shown)} set for "
                                                       f"{step}: such a step sees every GPU of the node", fix)
    return CheckResult(ISOLATION, Status.PASS, f"TaskProlog {prolog} empties CUDA_VISIBLE_DEVICES and "
                                               "NVIDIA_VISIBLE_DEVICES for a step without GPUs (a --gres=none step "
                                               "inside a GPU job included): it sees none (the nodes stay openable: "
                                               "not a security boundary)")


def check_slurm_node(ctx: DoctorContext) -> list[CheckResult]:
    # In a job on a node without CUDA GPUs (a CPU node, stand-in GPUs) there is nothing a
    # GPU-less step could see: the row belongs to `launch doctor` on the node, not every job's log.
    if ctx.preflight and not ctx.has_cuda_gpus:
        return [check_cgroup_plugin(ctx)]
    return [check_cgroup_plugin(ctx), check_gpu_isolation(ctx)]
