"""What the doctor needs to know about a job: its GPU resources and its version lock.

Both come from the validated job spec (`launch/jobs/<job>.yaml`, or a path to one): the
resources of the chosen preset, and the spec's `lock:` mapping (format in versions.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from launch.jobspec import ResolvedJob, find_spec


@dataclass(frozen=True)
class JobRequirements:
    name: str
    source: Path | None = None
    preset: str | None = None
    gpus_per_node: int | None = None  # None: judge by the allocation alone (inside the job)
    lock: dict[str, str] = field(default_factory=dict)
    resolved: ResolvedJob | None = None  # for --on-cluster: the same executor as `launch submit`

    @property
    def needs_gpus(self) -> bool:
        return bool(self.gpus_per_node)


def load_job(job: str, preset: str | None = None, *, trust_allocation: bool = False) -> JobRequirements:
    """`job` is a name (stage1) or a spec path; raises LaunchError for unknown jobs/presets.

    trust_allocation: inside the job, the preset that was submitted is not known here, so the
    allocation Slurm made is taken as the truth and only the lock is used from the spec.
    """
    spec = find_spec(job)
    resolved = spec.resolve(preset)
    return JobRequirements(
        name=spec.name, source=spec.source, preset=resolved.preset,
        gpus_per_node=None if trust_allocation else resolved.resources.gpus_per_node,
        lock=dict(spec.lock), resolved=resolved,
    )
