"""GPU checks: the visible count equals the allocation, no foreign process is on the job's
GPUs, and the node's keepalive holder has released them.

Keepalive state file (written by `launch keepalive run`): `$LAUNCH_KEEPALIVE_STATE`, default
/run/launch-keepalive/state.json, `{"held": [gpu indices], "released": {"<jobid>": [indices]}}`
with physical indices, the numbering of SLURM_JOB_GPUS and nvidia-smi.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from launch.doctor import nvidia
from launch.doctor.context import DoctorContext
from launch.doctor.results import CheckResult, Status

KEEPALIVE_STATE_DEFAULT = "/run/launch-keepalive/state.json"


def allocated_gpu_count(ctx: DoctorContext) -> tuple[int | None, str]:
    """How many GPUs this node's allocation holds, and from which variable."""
    on_node = ctx.env.get("SLURM_GPUS_ON_NODE")
    if on_node and on_node.strip().isdigit():
        return int(on_node), "SLURM_GPUS_ON_NODE"
    try:
        job_gpus = ctx.slurm_job_gpus()
    except ValueError:
        job_gpus = None
    if job_gpus is not None:
        return len(job_gpus), "SLURM_JOB_GPUS"
    if ctx.cuda_visible_devices is not None and ctx.has_cuda_gpus:
        # Outside Slurm, CUDA_VISIBLE_DEVICES is the allocation; check it names real devices.
        entries = [e for e in ctx.cuda_visible_devices.split(",") if e.strip()]
        return len(entries), "CUDA_VISIBLE_DEVICES"
    return None, ""


def visible_gpu_count(ctx: DoctorContext) -> tuple[int | None, str]:
    """How many GPUs a CUDA program here will enumerate."""
    if ctx.gpus is not None:
        return len(nvidia.visible_gpus(ctx.gpus, ctx.cuda_visible_devices)), "nvidia-smi under CUDA_VISIBLE_DEVICES"
    cvd = ctx.cuda_visible_devices
    if cvd is None:
        return None, "no nvidia-smi, CUDA_VISIBLE_DEVICES unset"
    return len([e for e in cvd.split(",") if e.strip()]), "CUDA_VISIBLE_DEVICES entries (no NVIDIA driver)"


def check_gpu_count(ctx: DoctorContext) -> CheckResult:
    name = "gpus.count"
    allocated, source = allocated_gpu_count(ctx)
    visible, how = visible_gpu_count(ctx)
    wanted = ctx.job.gpus_per_node if ctx.job else None
    if allocated is None:
        if ctx.expect_allocation and wanted:
            return CheckResult(name, Status.FAIL, f"job {ctx.job.name} wants {wanted} GPUs per node; the allocation has none",
                               f"submit with --gres=gpu:{wanted} (launch submit does)")
        return CheckResult(name, Status.SKIP, f"no GPU allocation here; {visible if visible is not None else 0} visible ({how})")
    problems = []
    per_task = ctx.tasks_per_node > 1 and visible is not None and visible * ctx.tasks_per_node == allocated
    if visible != allocated and not per_task:
        problems.append(f"{visible} visible ({how}) but {allocated} allocated ({source})")
    if wanted and ctx.in_allocation and allocated != wanted:
        problems.append(f"job {ctx.job.name} wants {wanted} GPUs per node, allocation has {allocated}")
    if problems:
        return CheckResult(name, Status.FAIL, "; ".join(problems),
                           "do not set CUDA_VISIBLE_DEVICES yourself inside a job; let Slurm's GRES set it, "
                           "and request the job's GPUs (--gres=gpu:N)")
    if per_task:
        return CheckResult(name, Status.PASS, f"{visible} visible per task x {ctx.tasks_per_node} tasks = "
                                              f"{allocated} allocated ({source})")
    return CheckResult(name, Status.PASS, f"{visible} visible = {allocated} allocated ({source})")


def _same_job(pid: int, job_id: str | None) -> bool:
    if pid == os.getpid():
        return True
    if job_id is None:
        return False
    try:
        cgroup = Path(f"/proc/{pid}/cgroup").read_text()
    except OSError:
        return False
    return f"/job_{job_id}/" in cgroup or cgroup.rstrip().endswith(f"/job_{job_id}")


def _process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "?"


def check_foreign_processes(ctx: DoctorContext) -> CheckResult:
    name = "gpus.foreign_procs"
    if not ctx.gpus:
        return CheckResult(name, Status.SKIP, "no nvidia-smi / NVIDIA GPUs here")
    job_gpus = set(ctx.job_gpu_indices() or [])
    by_uuid = {g.uuid: g.index for g in ctx.gpus}
    try:
        apps = nvidia.list_compute_apps(ctx.env)
    except nvidia.NvidiaSmiError as exc:
        return CheckResult(name, Status.WARN, str(exc), "check the NVIDIA driver")
    foreign = [
        (by_uuid.get(a.gpu_uuid, -1), a) for a in apps
        if by_uuid.get(a.gpu_uuid) in job_gpus and not _same_job(a.pid, ctx.slurm_job_id)
    ]
    if foreign:
        listed = ", ".join(f"GPU {i}: pid {a.pid} ({_process_name(a.pid)}, {a.used_mib} MiB)" for i, a in sorted(foreign, key=lambda x: x[0]))
        return CheckResult(name, Status.FAIL, f"foreign processes on this job's GPUs: {listed}",
                           "start jobs only through Slurm (launch submit), whose prolog makes the keepalive "
                           "yield; stop stray processes (ask the admin if they are not yours)")
    return CheckResult(name, Status.PASS, f"no foreign compute process on GPUs {sorted(job_gpus)}")


def check_keepalive(ctx: DoctorContext) -> CheckResult:
    name = "gpus.keepalive"
    path = Path(ctx.env.get("LAUNCH_KEEPALIVE_STATE") or KEEPALIVE_STATE_DEFAULT)
    job_gpus = ctx.job_gpu_indices() if (ctx.in_allocation or ctx.cuda_visible_devices is not None) else None
    if not path.exists():
        status = Status.WARN if ctx.in_allocation and job_gpus else Status.SKIP
        return CheckResult(name, status, f"no keepalive state at {path} (no holder on this node?)",
                           "" if status is Status.SKIP else "if this node runs a keepalive, check `launch keepalive status`")
    try:
        state = json.loads(path.read_text())
        held = {int(i) for i in state.get("held", [])}
        released = {str(k): {int(i) for i in v} for k, v in (state.get("released") or {}).items()}
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        return CheckResult(name, Status.WARN, f"cannot read keepalive state {path}: {exc}", "check `launch keepalive status`")
    holder_pid = state.get("pid")
    if isinstance(holder_pid, int) and not Path(f"/proc/{holder_pid}").exists():
        return CheckResult(name, Status.WARN, f"keepalive state {path} is stale: holder pid {holder_pid} is not running "
                                              f"(it listed GPUs {sorted(held)} as held)",
                           "restart the holder (systemctl restart launch-keepalive) or remove the stale state file")
    if not job_gpus:
        return CheckResult(name, Status.SKIP, f"not in a GPU allocation; keepalive holds GPUs {sorted(held)}")
    still_held = sorted(held & set(job_gpus))
    if still_held:
        return CheckResult(
            name, Status.FAIL, f"keepalive still holds GPUs {still_held} of this job (job GPUs {sorted(job_gpus)})",
            "start through Slurm (launch submit), not ssh/bash; if in Slurm, check the Prolog= hook and `launch keepalive status`",
        )
    mine = released.get(ctx.slurm_job_id or "", set())
    how = f"released to job {ctx.slurm_job_id}" if mine >= set(job_gpus) and mine else "not held"
    return CheckResult(name, Status.PASS, f"GPUs {sorted(job_gpus)} {how}")


def check_gpus(ctx: DoctorContext) -> list[CheckResult]:
    return [check_gpu_count(ctx), check_foreign_processes(ctx), check_keepalive(ctx)]
