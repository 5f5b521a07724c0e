"""The node's NVIDIA GPUs and their compute processes, read through `nvidia-smi`.

nvidia-smi lists every GPU the driver (or the container's device nodes) exposes, whatever
CUDA_VISIBLE_DEVICES says, and reports physical indices: the same numbering as Slurm's
SLURM_JOB_GPUS and the keepalive state file. No torch import: the CLI stays fast.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    index: int
    uuid: str
    name: str
    compute_cap: tuple[int, int] | None
    driver: str


@dataclass(frozen=True)
class ComputeApp:
    pid: int
    gpu_uuid: str
    used_mib: str


class NvidiaSmiError(Exception):
    pass


def _smi(env: Mapping[str, str], *args: str) -> list[list[str]] | None:
    exe = shutil.which("nvidia-smi", path=env.get("PATH", ""))
    if exe is None:
        return None
    try:
        proc = subprocess.run(
            [exe, *args, "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=30, env=dict(env),
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise NvidiaSmiError(f"nvidia-smi did not run: {exc}") from None
    if proc.returncode != 0:
        msg = (proc.stderr or proc.stdout).strip().splitlines()
        raise NvidiaSmiError(f"nvidia-smi exited {proc.returncode}: {msg[-1] if msg else ''}")
    return [[c.strip() for c in line.split(",")] for line in proc.stdout.splitlines() if line.strip()]


def _cap(text: str) -> tuple[int, int] | None:
    try:
        major, minor = text.split(".")
        return int(major), int(minor)
    except ValueError:
        return None


def list_gpus(env: Mapping[str, str]) -> list[Gpu] | None:
    """The GPUs nvidia-smi sees; None when there is no nvidia-smi on PATH."""
    try:
        rows = _smi(env, "--query-gpu=index,uuid,name,compute_cap,driver_version")
    except NvidiaSmiError:
        # Drivers before 510 do not know the compute_cap field; torch reports it in the probe.
        rows = _smi(env, "--query-gpu=index,uuid,name,driver_version")
        rows = [[*r[:3], "", *r[3:]] for r in rows or []]
    if rows is None:
        return None
    gpus = []
    for row in rows:
        if len(row) < 5 or not row[0].isdigit():
            raise NvidiaSmiError(f"unexpected nvidia-smi line: {','.join(row)}")
        gpus.append(Gpu(int(row[0]), row[1], row[2], _cap(row[3]), row[4]))
    return gpus


def list_compute_apps(env: Mapping[str, str]) -> list[ComputeApp]:
    rows = _smi(env, "--query-compute-apps=pid,gpu_uuid,used_memory") or []
    return [ComputeApp(int(r[0]), r[1], r[2]) for r in rows if len(r) >= 3 and r[0].isdigit()]


def visible_gpus(gpus: list[Gpu], cuda_visible_devices: str | None) -> list[Gpu]:
    """The GPUs CUDA would enumerate under CUDA_VISIBLE_DEVICES.

    Entries are indices or (prefixes of) UUIDs; like CUDA, stop at the first entry that
    names no device.
    """
    if cuda_visible_devices is None:
        return list(gpus)
    chosen: list[Gpu] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        match = None
        if entry.isdigit():
            match = next((g for g in gpus if g.index == int(entry)), None)
        elif entry:
            match = next((g for g in gpus if g.uuid.startswith(entry)), None)
        if match is None or match in chosen:
            break
        chosen.append(match)
    return chosen


def parse_index_list(text: str) -> list[int]:
    """'0,1,4-5' -> [0, 1, 4, 5] (Slurm's GPU index lists). Raises ValueError on junk."""
    out: list[int] = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "-" in part:
            lo, hi = part.split("-", 1)
            out.extend(range(int(lo), int(hi) + 1))
        else:
            out.append(int(part))
    return out
