"""Cache directories: node-local (by filesystem type), writable, with free space.

Each path is resolved the way its library resolves it when the variable is unset, so the
doctor judges the directory the job will really use.
"""

from __future__ import annotations

import os
import pwd
import re
import tempfile
from collections.abc import Mapping
from pathlib import Path

from launch.doctor.context import DoctorContext
from launch.doctor.mounts import Mount, mount_of, read_mounts
from launch.doctor.results import CheckResult, Status

DEFAULT_MIN_FREE_GIB = 2.0


def _home(env: Mapping[str, str]) -> Path:
    return Path(env.get("HOME") or pwd.getpwuid(os.getuid()).pw_dir)


def _user(env: Mapping[str, str]) -> str:
    for var in ("LOGNAME", "USER", "LNAME", "USERNAME"):
        if env.get(var):
            return env[var]
    return pwd.getpwuid(os.getuid()).pw_name


def _tempdir(env: Mapping[str, str]) -> Path:
    for var in ("TMPDIR", "TEMP", "TMP"):
        if env.get(var):
            return Path(env[var])
    return Path("/tmp")  # what tempfile.gettempdir() settles on when none is set


def resolve_cache_dirs(env: Mapping[str, str]) -> dict[str, tuple[str, Path]]:
    """check name -> (variable, directory) with each library's default for an unset variable."""
    triton = env.get("TRITON_CACHE_DIR", "").strip()
    triton_dir = Path(triton) if triton else Path(env.get("TRITON_HOME") or _home(env)) / ".triton" / "cache"
    hf = env.get("HF_HOME")
    hf_dir = Path(hf) if hf else Path(env.get("XDG_CACHE_HOME") or _home(env) / ".cache") / "huggingface"
    inductor = env.get("TORCHINDUCTOR_CACHE_DIR")
    user = re.sub(r'[\\/:*?"<>|]', "_", _user(env))
    inductor_dir = Path(inductor) if inductor else _tempdir(env) / f"torchinductor_{user}"
    return {
        "cache.triton": ("TRITON_CACHE_DIR", triton_dir.expanduser()),
        "cache.hf": ("HF_HOME", hf_dir.expanduser()),
        "cache.inductor": ("TORCHINDUCTOR_CACHE_DIR", inductor_dir.expanduser()),
    }


def _probe_writable(directory: Path) -> str | None:
    """Create the directory as the library would, then a file in it. None, or the error."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".launch-doctor-")
        try:
            os.write(fd, b"ok")
        finally:
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        return f"{exc.strerror or exc} ({exc.filename or directory})"
    return None


def _describe(mount: Mount | None) -> str:
    return f"{mount.fstype} ({mount.source} on {mount.mount_point})" if mount else "unknown filesystem"


def check_caches(ctx: DoctorContext) -> list[CheckResult]:
    try:
        min_free = float(ctx.env.get("LAUNCH_DOCTOR_MIN_FREE_GIB", DEFAULT_MIN_FREE_GIB))
    except ValueError:
        min_free = DEFAULT_MIN_FREE_GIB
    try:
        mounts = read_mounts(ctx.env)
        mount_error = None
    except OSError as exc:
        mounts, mount_error = [], f"cannot read mount table: {exc.strerror}"
    results = []
    for check, (var, directory) in resolve_cache_dirs(ctx.env).items():
        set_by = "set" if ctx.env.get(var) else "default"
        mount = mount_of(directory, mounts)
        found = [f"{directory} ({var} {set_by}) on {_describe(mount)}"]
        status, fixes = Status.PASS, []
        local_fix = f"export {var}=<node-local NVMe dir> (launch submit puts it under per-job local scratch)"
        if mount is not None and mount.is_network:
            status = Status.FAIL
            found.append(f"network filesystem {mount.fstype}: ranks contend on it and hang")
            fixes.append(local_fix)
        elif mount is not None and mount.is_unknown_fuse:
            status = Status.WARN
            found.append(f"FUSE filesystem {mount.fstype}: cannot tell if node-local")
            fixes.append(local_fix)
        elif mount_error:
            status = Status.WARN
            found.append(mount_error)
        write_error = _probe_writable(directory)
        if write_error:
            status = Status.FAIL
            found.append(f"not writable: {write_error}")
            fixes.append(f"point {var} at a directory this user can write")
        else:
            st = os.statvfs(directory)
            free_gib = st.f_bavail * st.f_frsize / 2**30
            found.append(f"{free_gib:.1f} GiB free")
            if free_gib < min_free:
                status = Status.FAIL
                found[-1] += f" < {min_free:g} GiB"
                fixes.append(f"free space there or move {var} (threshold: LAUNCH_DOCTOR_MIN_FREE_GIB)")
        results.append(CheckResult(check, status, "; ".join(found), "; ".join(fixes)))
    return results
