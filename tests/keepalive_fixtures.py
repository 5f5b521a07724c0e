"""Helpers for the keepalive tests: stand-in GPUs, a holder process, hook runs, lock probes.

Stand-in GPUs: this machine has no NVIDIA GPU, so the devices are char nodes with the NVIDIA
major 195 (as the embedded cluster makes them) and the holder holds them by lock. Everything
else (the holder process, its socket, the hooks, flock, setuid to nobody) is real.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
NOBODY_UID = 65534
# nobody cannot run the venv's python (it lives under /root); the client side is stdlib-only.
SYSTEM_PYTHON = "/usr/bin/python3"


def make_standin_gpus(devices_dir: Path, count: int) -> list[Path]:
    devices_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for index in range(count):
        path = devices_dir / f"nvidia{index}"
        if not path.exists():
            os.mknod(path, 0o666 | 0o020000, os.makedev(195, index))
        paths.append(path)
    return paths


def can_lock(lock_path: Path) -> bool:
    """Could an ordinary process take this stand-in GPU right now?"""
    fd = os.open(lock_path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    finally:
        os.close(fd)
    return True


def base_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO)
    for key in [k for k in env if k.startswith("SLURM_")]:
        del env[key]
    return env


@dataclass
class Holder:
    """A `launch keepalive run` process on stand-in GPUs, in a world-traversable temp dir."""

    root: Path
    gpus: int = 4
    extra_args: list[str] = field(default_factory=list)
    env_extra: dict[str, str] = field(default_factory=dict)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def devices_dir(self) -> Path:
        return self.root / "dev"

    @property
    def socket(self) -> Path:
        return self.root / "run" / "ctl" / "control.sock"

    @property
    def state_path(self) -> Path:
        return self.root / "run" / "state.json"

    @property
    def hook_log(self) -> Path:
        return self.root / "hooks.log"

    @property
    def log_path(self) -> Path:
        return self.root / "holder.log"

    def lock(self, index: int) -> Path:
        return self.devices_dir / f"nvidia{index}.lock"

    def env(self, **extra: str) -> dict[str, str]:
        return {
            **base_env(),
            "LAUNCH_KEEPALIVE_SOCKET": str(self.socket),
            "LAUNCH_KEEPALIVE_STATE": str(self.state_path),
            "LAUNCH_KEEPALIVE_HOOK_LOG": str(self.hook_log),
            **self.env_extra,
            **extra,
        }

    def start(self, wait: bool = True) -> None:
        make_standin_gpus(self.devices_dir, self.gpus)
        args = [sys.executable, "-m", "launch", "keepalive", "run", "--devices-dir", str(self.devices_dir),
                *self.extra_args]
        log = open(self.log_path, "ab")  # noqa: SIM115 (kept open by the child)
        self.proc = subprocess.Popen(args, env=self.env(), stdout=log, stderr=log, cwd=self.root)
        log.close()
        if wait:
            self.wait_ready()

    def wait_ready(self, timeout: float = 30.0) -> dict:
        assert self.proc is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"holder exited {self.proc.returncode}:\n{self.log_path.read_text()}")
            state = self.state()
            if state and state["pid"] == self.proc.pid and self.socket.exists():
                return state
            time.sleep(0.05)
        raise AssertionError(f"holder not ready in {timeout} s:\n{self.log_path.read_text()}")

    def state(self) -> dict | None:
        try:
            return json.loads(self.state_path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        code = self.proc.returncode
        self.proc = None
        return code

    def hook(self, hook: str, job: str | None, gpus: str | None, timeout: float | None = None,
             user: int | None = None, env: Mapping[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        run_env = self.env(**(env or {}))
        if job is not None:
            run_env["SLURM_JOB_ID"] = job
        if gpus is not None:
            run_env["SLURM_JOB_GPUS"] = gpus
        args = [SYSTEM_PYTHON if user is not None else sys.executable, "-m", "launch.keepalive.cli", hook]
        if timeout is not None:
            args += ["--timeout", str(timeout)]
        return subprocess.run(args, env=run_env, capture_output=True, text=True, timeout=60,
                              user=user, cwd=self.root)


@contextmanager
def world_readable_dir() -> Iterator[Path]:
    """A temp dir nobody can traverse into (pytest's tmp_path is 0700 under root)."""
    path = Path(tempfile.mkdtemp(prefix="keepalive-"))
    path.chmod(0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@contextmanager
def running_holder(root: Path, **kwargs: object) -> Iterator[Holder]:
    h = Holder(root, **kwargs)  # type: ignore[arg-type]
    h.start()
    try:
        yield h
    finally:
        h.stop()
