"""Everything the checks share: the environment they judge, the job, and facts read once."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from launch.doctor import nvidia
from launch.doctor.job import JobRequirements


@dataclass
class DoctorContext:
    env: Mapping[str, str]
    job: JobRequirements | None = None
    lock_path: Path | None = None  # overrides the job's lock file
    expect_allocation: bool = False  # running inside the job: no SLURM_JOB_ID is a FAIL
    run_gdn: bool = True  # the tiny GDN fwd+bwd on the GPU (costly on a cold Triton cache)
    needs_gpus_override: bool | None = None
    preflight: bool = False  # the in-job preflight of `launch submit` (fast_subset)
    notes: dict[str, str] = field(default_factory=dict)

    @functools.cached_property
    def gpus(self) -> list[nvidia.Gpu] | None:
        """Physical GPUs from nvidia-smi; None without nvidia-smi (CPU machine, stand-in GPUs)."""
        try:
            return nvidia.list_gpus(self.env)
        except nvidia.NvidiaSmiError as exc:
            self.notes["nvidia-smi"] = str(exc)
            return None

    @property
    def has_cuda_gpus(self) -> bool:
        return bool(self.gpus)

    @property
    def needs_gpus(self) -> bool:
        """Whether the GPU fast path is required: then missing kernels are FAILs, not WARNs."""
        if self.needs_gpus_override is not None:
            return self.needs_gpus_override
        return self.has_cuda_gpus or (self.job is not None and self.job.needs_gpus)

    @property
    def slurm_job_id(self) -> str | None:
        return self.env.get("SLURM_JOB_ID") or self.env.get("SLURM_JOBID") or None

    @property
    def in_allocation(self) -> bool:
        return self.slurm_job_id is not None

    @property
    def tasks_per_node(self) -> int:
        """Tasks sharing this node's GPUs; with per-task GPU binding each sees its share."""
        text = self.env.get("SLURM_NTASKS_PER_NODE", "")
        return int(text) if text.isdigit() and int(text) > 0 else 1

    @property
    def cuda_visible_devices(self) -> str | None:
        return self.env.get("CUDA_VISIBLE_DEVICES")

    def slurm_job_gpus(self) -> list[int] | None:
        """Physical GPU indices Slurm gave this job (SLURM_JOB_GPUS); None when unset."""
        text = self.env.get("SLURM_JOB_GPUS") or self.env.get("SLURM_STEP_GPUS")
        if text is None:
            return None
        return nvidia.parse_index_list(text)

    def job_gpu_indices(self) -> list[int] | None:
        """The physical indices this job may use: Slurm's list, else CUDA_VISIBLE_DEVICES."""
        try:
            from_slurm = self.slurm_job_gpus()
        except ValueError:
            from_slurm = None
        if from_slurm is not None:
            return from_slurm
        cvd = self.cuda_visible_devices
        if cvd is None:
            return [g.index for g in self.gpus] if self.gpus else None
        if self.gpus:
            return [g.index for g in nvidia.visible_gpus(self.gpus, cvd)]
        try:
            return nvidia.parse_index_list(cvd)
        except ValueError:
            return None
