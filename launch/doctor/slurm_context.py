"""The Slurm context: inside an allocation, SLURM_JOB_ID is there and the GRES binding
(SLURM_JOB_GPUS, SLURM_GPUS_ON_NODE) agrees with CUDA_VISIBLE_DEVICES.

Slurm sets CUDA_VISIBLE_DEVICES either to the physical indices of SLURM_JOB_GPUS or, when
cgroups constrain devices (ConstrainDevices=yes), to 0..n-1; some sites use GPU UUIDs. Each of
these is consistent; a different list or count means something overrode it after Slurm.
"""

from __future__ import annotations

from launch.doctor import nvidia
from launch.doctor.context import DoctorContext
from launch.doctor.results import CheckResult, Status

GUARD_FIX = "run the job through Slurm (launch submit / sbatch): the node's keepalive yields GPUs only to Slurm jobs"


def check_slurm(ctx: DoctorContext) -> list[CheckResult]:
    name = "slurm.context"
    env = ctx.env
    if not ctx.in_allocation:
        if ctx.expect_allocation:
            return [CheckResult(name, Status.FAIL, "not inside a Slurm allocation (no SLURM_JOB_ID)", GUARD_FIX)]
        return [CheckResult(name, Status.SKIP, "outside a Slurm allocation (use --on-cluster to check a node)")]
    job_id = ctx.slurm_job_id
    if not env.get("SLURM_JOB_ID"):
        return [CheckResult(name, Status.FAIL, f"SLURM_JOBID={job_id} but no SLURM_JOB_ID: a partial copy of a job's environment",
                            GUARD_FIX)]
    found = f"job {job_id}"
    raw_gpus = env.get("SLURM_JOB_GPUS")
    cvd = ctx.cuda_visible_devices
    wanted = ctx.job.gpus_per_node if ctx.job else None
    if raw_gpus is None:
        if wanted:
            return [CheckResult(name, Status.FAIL, f"{found} has no GPUs (no SLURM_JOB_GPUS); job {ctx.job.name} wants {wanted}",
                                f"submit with --gres=gpu:{wanted} (launch submit does)")]
        if cvd not in (None, "", "NoDevFiles"):
            return [CheckResult(name, Status.WARN, f"{found} without GPUs, yet CUDA_VISIBLE_DEVICES={cvd} (inherited?)",
                                "unset CUDA_VISIBLE_DEVICES in the submitting shell")]
        return [CheckResult(name, Status.PASS, f"{found}, no GPUs allocated")]
    try:
        job_gpus = nvidia.parse_index_list(raw_gpus)
    except ValueError:
        return [CheckResult(name, Status.FAIL, f"SLURM_JOB_GPUS={raw_gpus!r} is not an index list", "check gres.conf")]
    problems = []
    if cvd is None:
        problems.append(f"SLURM_JOB_GPUS={raw_gpus} but CUDA_VISIBLE_DEVICES is unset")
    else:
        entries = [e.strip() for e in cvd.split(",") if e.strip()]
        as_physical = entries == [str(i) for i in job_gpus]
        as_renumbered = entries == [str(i) for i in range(len(job_gpus))]
        as_uuids = len(entries) == len(job_gpus) and all(e.startswith(("GPU-", "MIG-")) for e in entries)
        # Per-task binding (--gpu-bind / --gpus-per-task): each task sees its share of the job's GPUs.
        share = len(job_gpus) // ctx.tasks_per_node if ctx.tasks_per_node > 1 else 0
        per_task = share > 0 and len(entries) == share and (
            set(entries) <= {str(i) for i in job_gpus} or set(entries) <= {str(i) for i in range(len(job_gpus))}
            or all(e.startswith(("GPU-", "MIG-")) for e in entries))
        if not (as_physical or as_renumbered or as_uuids or per_task):
            problems.append(f"SLURM_JOB_GPUS={raw_gpus} but CUDA_VISIBLE_DEVICES={cvd}")
    on_node = env.get("SLURM_GPUS_ON_NODE")
    if on_node and on_node.isdigit() and int(on_node) != len(job_gpus):
        problems.append(f"SLURM_GPUS_ON_NODE={on_node} but SLURM_JOB_GPUS lists {len(job_gpus)}")
    if problems:
        return [CheckResult(name, Status.FAIL, f"{found}: " + "; ".join(problems),
                            "do not set CUDA_VISIBLE_DEVICES in the job script; Slurm's GRES sets it")]
    return [CheckResult(name, Status.PASS, f"{found}, GPUs {raw_gpus} = CUDA_VISIBLE_DEVICES {cvd}")]
