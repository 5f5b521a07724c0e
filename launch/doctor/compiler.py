"""Can Triton build its launcher? A real compile of a tiny CPython extension.

Triton JIT-compiles a small C launcher per kernel with the compiler named by CC, else gcc,
else clang on PATH, against the Python headers of the running interpreter; without one it
fails at the first kernel with "Failed to find C compiler". The doctor makes the same choice
and builds (and loads) the same kind of artefact, so a PASS means Triton's step works.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Mapping
from pathlib import Path

from launch.doctor.context import DoctorContext
from launch.doctor.results import CheckResult, Status

PROBE_C = r"""
#include <Python.h>
static struct PyModuleDef doctor_cc_probe_def = {PyModuleDef_HEAD_INIT, "doctor_cc_probe", NULL, -1, NULL};
PyMODINIT_FUNC PyInit_doctor_cc_probe(void) { return PyModule_Create(&doctor_cc_probe_def); }
"""

INSTALL_FIX = "apt-get install gcc python3-dev (the `toolchain` role does), or export CC=/path/to/cc"


def find_compiler(env: Mapping[str, str]) -> tuple[str | None, str]:
    """(path, how it was chosen), in Triton's order: $CC, then gcc, then clang on PATH."""
    path = env.get("PATH", "")
    cc = env.get("CC")
    if cc:
        found = shutil.which(cc, path=path) or (cc if Path(cc).is_file() else None)
        return found, f"CC={cc}" if found else f"CC={cc} names no executable"
    for name in ("gcc", "clang"):
        found = shutil.which(name, path=path)
        if found:
            return found, f"{name} on PATH"
    return None, "CC unset, no gcc or clang on PATH"


def python_include_dir() -> Path:
    scheme = sysconfig.get_default_scheme()
    # Debian's 'posix_local' scheme has no headers of its own; they live under posix_prefix.
    if scheme == "posix_local":
        scheme = "posix_prefix"
    return Path(sysconfig.get_paths(scheme=scheme)["include"])


def libcuda_dirs(env: Mapping[str, str]) -> list[str]:
    """Where libcuda.so lives, for the -lcuda Triton's CUDA launcher links against."""
    if env.get("TRITON_LIBCUDA_PATH"):
        return [env["TRITON_LIBCUDA_PATH"]]
    try:
        out = subprocess.run(["/sbin/ldconfig", "-p"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    dirs = {str(Path(line.split("=>")[-1].strip()).parent) for line in out.splitlines() if "libcuda.so" in line}
    if not dirs:  # not in the linker cache: the library path, as Triton also looks there
        dirs = {d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d and (Path(d) / "libcuda.so.1").exists()}
    return sorted(dirs)


def check_compiler(ctx: DoctorContext) -> list[CheckResult]:
    name = "triton.cc"
    cc, how = find_compiler(ctx.env)
    if cc is None:
        return [CheckResult(name, Status.FAIL, f"no C compiler: {how}", INSTALL_FIX)]
    include = python_include_dir()
    if not (include / "Python.h").is_file():
        return [CheckResult(name, Status.FAIL, f"{cc} found, but no Python.h in {include}", INSTALL_FIX)]
    link_cuda = ctx.has_cuda_gpus
    lib_dirs = libcuda_dirs(ctx.env) if link_cuda else []
    with tempfile.TemporaryDirectory(prefix="launch-doctor-cc-") as tmp:
        src, so = Path(tmp) / "probe.c", Path(tmp) / f"doctor_cc_probe{sysconfig.get_config_var('EXT_SUFFIX')}"
        src.write_text(PROBE_C)
        cmd = [cc, str(src), "-O1", "-shared", "-fPIC", "-o", str(so), f"-I{include}"]
        if link_cuda:
            cmd += [f"-L{d}" for d in lib_dirs] + ["-lcuda"]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=dict(ctx.env))
        except (OSError, subprocess.TimeoutExpired) as exc:
            return [CheckResult(name, Status.FAIL, f"{cc} ({how}) did not run: {exc}", INSTALL_FIX)]
        if proc.returncode != 0:
            err = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()] or proc.stderr.splitlines() or [""]
            fix = INSTALL_FIX
            if link_cuda and "lcuda" in proc.stderr:
                fix = "libcuda.so not found: install the NVIDIA userspace driver, or set TRITON_LIBCUDA_PATH"
            return [CheckResult(name, Status.FAIL, f"{cc} ({how}) failed: {err[0].strip()}", fix)]
        try:
            loader = importlib.machinery.ExtensionFileLoader("doctor_cc_probe", str(so))
            spec = importlib.util.spec_from_file_location("doctor_cc_probe", so, loader=loader)
            assert spec is not None
            loader.exec_module(importlib.util.module_from_spec(spec))
        except ImportError as exc:
            return [CheckResult(name, Status.FAIL, f"built, but the module does not load: {exc}", INSTALL_FIX)]
    extra = " and -lcuda" if link_cuda else ""
    return [CheckResult(name, Status.PASS, f"{cc} ({how}) built and loaded a Python extension{extra} against {include}")]
