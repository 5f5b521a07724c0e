"""The Slurm Prolog/Epilog commands, and the wrapper scripts slurmd runs.

slurmd runs Prolog and Epilog as root, with a minimal environment that includes
SLURM_JOB_ID and (with PrologFlags=Alloc and GRES) SLURM_JOB_GPUS.

Choices, and why:
- Prolog, holder not running: the job proceeds and the hook logs it. No holder means no GPU
  is held, so the job can use its GPUs; blocking every job on a holder outage would turn a
  keepalive problem into a cluster outage.
- Prolog, holder running but no acknowledgement within the bound (default 10 s), or a
  refusal: the prolog exits 1. Slurm then never starts the job on a GPU that may still be
  held; it requeues the job and drains the node, which is the right signal for an admin
  (`scontrol update nodename=... state=resume` once the holder is fixed).
- Epilog: always exits 0 and logs failures. A failing epilog drains the node too, and a GPU
  that is not taken back costs only idle time; the holder's periodic reconcile with Slurm
  takes it back later.
"""

from __future__ import annotations

import logging
import os
import shlex
import sys
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path

from launch.errors import LaunchError
from launch.keepalive.protocol import HolderNotRunning, parse_gpu_list, request

DEFAULT_PROLOG_TIMEOUT_S = 10.0
DEFAULT_EPILOG_TIMEOUT_S = 60.0
DEFAULT_HOOK_LOG = Path("/var/log/launch-keepalive/hooks.log")


def hook_logger(log_path: Path | None) -> logging.Logger:
    logger = logging.getLogger("launch.keepalive.hooks")
    logger.handlers.clear()
    logger.setLevel(logging.INFO)
    logger.propagate = False
    fmt = logging.Formatter("%(asctime)s %(message)s")
    fmt.converter = time.gmtime
    stderr = logging.StreamHandler(sys.stderr)
    stderr.setFormatter(fmt)
    logger.addHandler(stderr)
    if log_path is not None:
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
            handler = logging.FileHandler(log_path)
        except OSError as exc:
            logger.warning("cannot write hook log %s: %s", log_path, exc)
        else:
            handler.setFormatter(fmt)
            logger.addHandler(handler)
    return logger


def _since_hook_start_ms(env: Mapping[str, str]) -> str:
    """Milliseconds since the wrapper script started (it exports its start time), if known."""
    raw = env.get("LAUNCH_KEEPALIVE_HOOK_T0_NS", "")
    if not raw.isdigit():
        return ""
    return f"; {(time.time_ns() - int(raw)) / 1e6:.1f} ms after hook start"


def _job_and_gpus(env: Mapping[str, str], hook: str) -> tuple[str, list[int]]:
    job = env.get("SLURM_JOB_ID", "")
    if not job:
        raise LaunchError(f"SLURM_JOB_ID is not set; the {hook} is meant to be run by slurmd")
    if not job.isascii() or not job.isdigit():  # Slurm's job ids are numbers (array tasks' too)
        raise LaunchError(f"SLURM_JOB_ID={job!r} is not a Slurm job id; the {hook} is meant to be run by slurmd")
    return job, parse_gpu_list(env.get("SLURM_JOB_GPUS", ""), "SLURM_JOB_GPUS")


def run_prolog(socket: Path, timeout: float, log_path: Path | None,
               env: Mapping[str, str] = os.environ) -> int:
    logger = hook_logger(log_path)
    job, gpus = _job_and_gpus(env, "prolog")
    if not gpus:
        logger.info("prolog job=%s: no GPUs allocated; nothing to release", job)
        return 0
    t0 = time.monotonic()
    try:
        answer = request(socket, {"op": "release", "job": job, "gpus": gpus}, timeout)
    except HolderNotRunning as exc:
        logger.warning("prolog job=%s gpus=%s: %s; the job proceeds", job, gpus, exc)
        return 0
    except LaunchError as exc:
        logger.error("prolog job=%s gpus=%s: %s; failing the prolog so the job does not start "
                     "on a held GPU", job, gpus, exc)
        return 1
    logger.info("prolog job=%s gpus=%s: released %s (unmanaged %s) in %.1f ms%s", job, gpus,
                answer.get("released"), answer.get("unmanaged"), 1e3 * (time.monotonic() - t0),
                _since_hook_start_ms(env))
    return 0


def run_epilog(socket: Path, timeout: float, log_path: Path | None,
               env: Mapping[str, str] = os.environ) -> int:
    logger = hook_logger(log_path)
    try:
        job, gpus = _job_and_gpus(env, "epilog")
    except LaunchError as exc:
        logger.error("epilog: %s", exc)
        return 0
    t0 = time.monotonic()
    message: dict[str, object] = {"op": "reclaim", "job": job}
    if gpus:
        message["gpus"] = gpus
    try:
        answer = request(socket, message, timeout)
    except HolderNotRunning as exc:
        logger.warning("epilog job=%s: %s; nothing to reclaim", job, exc)
        return 0
    except LaunchError as exc:
        logger.error("epilog job=%s: %s; the holder's reconcile will take the GPUs back", job, exc)
        return 0
    logger.info("epilog job=%s: reclaimed %s (still busy %s) in %.1f ms%s", job,
                answer.get("reclaimed"), answer.get("pending"), 1e3 * (time.monotonic() - t0),
                _since_hook_start_ms(env))
    return 0


def render_hook_wrapper(hook: str, python: str, socket: Path, timeout: float,
                        log_path: Path | None, pythonpath: str | None) -> str:
    exports = {
        "LAUNCH_KEEPALIVE_SOCKET": str(socket),
        "LAUNCH_KEEPALIVE_TIMEOUT": f"{timeout:g}",
        "LAUNCH_KEEPALIVE_HOOK_LOG": str(log_path) if log_path else "",
    }
    if pythonpath:
        exports["PYTHONPATH"] = pythonpath
    lines = [
        "#!/bin/sh",
        f"# Slurm {hook.capitalize()} for the launch keepalive holder; generated on "
        f"{datetime.now(timezone.utc):%Y-%m-%d}.",
        "# slurmd runs it as root with a minimal environment, so every path here is absolute.",
        *(f"export {k}={shlex.quote(v)}" for k, v in exports.items()),
        "# start time, so the hook can log its latency from slurmd's exec to the holder's ack",
        "LAUNCH_KEEPALIVE_HOOK_T0_NS=$(date +%s%N) && export LAUNCH_KEEPALIVE_HOOK_T0_NS",
        "# a fixed working directory: `python -m` puts the current one first on sys.path",
        "cd /",
        f"exec {shlex.quote(python)} -m launch.keepalive.cli {hook}",
        "",
    ]
    return "\n".join(lines)


def write_hook_wrappers(directory: Path, python: str, socket: Path, prolog_timeout: float,
                        epilog_timeout: float, log_path: Path | None,
                        pythonpath: str | None) -> dict[str, Path]:
    """Write executable `prolog` and `epilog` scripts into `directory`; return their paths."""
    from toolkit.fsutil import atomic_write_text

    if not Path(python).is_absolute():
        raise LaunchError(f"--python {python!r} must be an absolute path; slurmd has no PATH to search")
    if directory.exists() and not directory.is_dir():
        raise LaunchError(f"cannot write the hook wrappers in {directory}: not a directory")
    paths = {}
    for hook, timeout in (("prolog", prolog_timeout), ("epilog", epilog_timeout)):
        path = directory / hook
        try:
            atomic_write_text(path, render_hook_wrapper(hook, python, socket, timeout, log_path, pythonpath),
                              mode=0o755)
        except OSError as exc:
            raise LaunchError(f"cannot write the hook wrappers in {directory}: {exc.strerror}") from None
        paths[hook] = path
    return paths
