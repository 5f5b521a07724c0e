"""Versions: recorded, and checked against the job's lock.

The lock is the job spec's `lock:` mapping, distribution -> PEP 440 specifier, optionally
followed by a PEP 508 marker (a bare version means ==):

    lock:
      torch: ">=2.5"
      transformers: ">=5.9,<6"
      flash-linear-attention: "==0.6.0 ; extra == 'gpu'"
      cuda: ">=12.4 ; extra == 'gpu'"
      nvidia-driver: ">=550 ; extra == 'gpu'"

or a constraints file given with `launch doctor --lock FILE`: one requirement per line
(`torch>=2.5`), `#` comments. Names are PyPI distributions, plus two pseudo-names: `cuda`
(the CUDA version torch was built with) and `nvidia-driver` (from nvidia-smi). The marker
`extra == 'gpu'` makes an entry apply only where the job needs GPUs; other markers
(python_version, platform_machine) work as usual. An entry that applies and is not satisfied,
or names something not installed, FAILs.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version

from launch.doctor.context import DoctorContext
from launch.doctor.results import CheckResult, Status
from launch.errors import LaunchError

RECORDED = ("torch", "transformers", "flash-linear-attention", "fla-core", "causal-conv1d", "triton",
            "tilelang", "deepspeed")


def dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def recorded_versions(ctx: DoctorContext) -> dict[str, str | None]:
    versions: dict[str, str | None] = {name: dist_version(name) for name in RECORDED}
    # Imported here: `python -m launch.doctor.driver_cuda` (the python_env role) must not find its
    # module imported already by the package.
    from launch.doctor.driver_cuda import torch_cuda_version

    versions["cuda"] = torch_cuda_version() if versions["torch"] else None
    versions["nvidia-driver"] = ctx.gpus[0].driver if ctx.gpus else None
    return versions


@dataclass(frozen=True)
class LockLine:
    requirement: Requirement
    line_no: int


def _first_line(exc: Exception) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


def parse_lock_mapping(lock: dict[str, str], source: str) -> list[LockLine]:
    lines = []
    for n, (name, value) in enumerate(lock.items(), 1):
        value = value.strip()
        text = f"{name}=={value}" if value[:1].isdigit() else f"{name}{value}"
        try:
            lines.append(LockLine(Requirement(text), n))
        except InvalidRequirement as exc:
            raise LaunchError(f"{source}: lock.{name}: {value!r} is not a version specifier ({_first_line(exc)}); "
                              "write e.g. '>=2.5'") from None
    return lines


def parse_lock_file(path: Path) -> list[LockLine]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise LaunchError(f"cannot read lock file {path}: {exc.strerror}; give an existing file with --lock") from None
    except UnicodeDecodeError as exc:
        raise LaunchError(f"lock file {path} is not UTF-8 text (byte offset {exc.start}); a lock is requirement "
                          "lines such as 'torch>=2.5'") from None
    lines = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            lines.append(LockLine(Requirement(line), n))
        except InvalidRequirement as exc:
            raise LaunchError(f"{path}:{n}: not a requirement line ({_first_line(exc)}); write e.g. 'torch>=2.5'") from None
    return lines


def check_driver_cuda(versions: dict[str, str | None]) -> CheckResult:
    """The host driver's branch against the CUDA runtime torch brings (launch/doctor/driver_cuda.py)."""
    from launch.doctor.driver_cuda import driver_cuda_problem


    name, driver, cuda = "versions.driver_cuda", versions.get("nvidia-driver"), versions.get("cuda")
    if not driver or not cuda:
        return CheckResult(name, Status.SKIP, "no NVIDIA driver (nvidia-smi)" if not driver else "torch has no CUDA build")
    try:
        problem = driver_cuda_problem(driver, cuda)
    except ValueError as exc:
        return CheckResult(name, Status.WARN, str(exc))
    if problem:
        return CheckResult(name, Status.FAIL, problem,
                           "upgrade the host's NVIDIA driver (and the containers' userspace: make provision), "
                           "or install a torch built for an older CUDA")
    return CheckResult(name, Status.PASS, f"driver {driver} runs CUDA {cuda}")


def check_versions(ctx: DoctorContext) -> list[CheckResult]:
    versions = recorded_versions(ctx)
    shown = ", ".join(f"{k} {v}" for k, v in versions.items() if v) or "none of torch/transformers/fla/deepspeed installed"
    results = [CheckResult("versions.recorded", Status.PASS, shown), check_driver_cuda(versions)]

    if ctx.lock_path is not None:
        entries, lock_name = parse_lock_file(ctx.lock_path), ctx.lock_path.name
    elif ctx.job is not None and ctx.job.lock:
        lock_name = f"{ctx.job.name} lock"
        entries = parse_lock_mapping(ctx.job.lock, str(ctx.job.source))
    else:
        why = f"job {ctx.job.name} has no lock: mapping" if ctx.job else "no --job or --lock given"
        results.append(CheckResult("versions.lock", Status.SKIP, why))
        return results
    marker_env = {"extra": "gpu" if ctx.needs_gpus else ""}
    problems, checked = [], 0
    for entry in entries:
        req = entry.requirement
        if req.marker is not None and not req.marker.evaluate(marker_env):
            continue
        checked += 1
        key = req.name.lower().replace("_", "-")
        installed = versions.get(key) if key in versions else dist_version(req.name)
        if installed is None:
            missing = {"cuda": "torch has no CUDA build", "nvidia-driver": "no NVIDIA driver (nvidia-smi)"}
            what = missing.get(key, f"{req.name} not installed")
            problems.append((f"{what} (lock: {req.specifier or 'any'})", str(req)))
            continue
        try:
            ok = req.specifier.contains(Version(installed), prereleases=True)
        except InvalidVersion:
            ok = False
        if not ok:
            problems.append((f"{req.name} {installed} (lock: {req.specifier})", str(req)))
    if problems:
        fixes = [spec for _, spec in problems if not spec.split(";")[0].strip().startswith(("cuda", "nvidia-driver"))]
        fix = f"pip install {' '.join(repr(f.split(';')[0].strip()) for f in fixes)}" if fixes else ""
        if len(fixes) < len(problems):
            fix = (fix + "; " if fix else "") + "use a torch build / NVIDIA driver that matches the lock"
        return results + [CheckResult(
            "versions.lock", Status.FAIL, f"{lock_name}: " + "; ".join(p for p, _ in problems), fix,
        )]
    return results + [CheckResult("versions.lock", Status.PASS, f"{lock_name}: {checked} pins satisfied")]
