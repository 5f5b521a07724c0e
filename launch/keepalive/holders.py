"""How the holder keeps one GPU occupied, and how it lets go.

Two kinds, one interface (`hold`, `release`):
- `CudaHolder`: a real GPU. A child process (`launch.keepalive.cuda_worker`) takes a share of
  the GPU's memory and runs a small matmul periodically. A child per GPU, not a thread in the
  holder, because only process exit frees the CUDA context (~0.5 GB) along with the memory.
- `LockHolder`: a stand-in GPU (a char device with the NVIDIA major 195 but no driver behind it,
  as in the embedded cluster). Such a node cannot be opened, so the holder takes an exclusive
  flock on a lock file beside it. Whoever "uses" a stand-in GPU takes the same lock, so a held
  GPU is exactly one whose lock nobody else can get. This makes the protocol testable on a CPU.
"""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import stat
import subprocess
import time
from pathlib import Path
from typing import Protocol

from launch.errors import LaunchError
from toolkit import pyexec

NVIDIA_MAJOR = 195
_DEVICE_NAME = re.compile(r"^nvidia(\d+)$")


class GpuHolder(Protocol):
    index: int

    def hold(self, timeout: float) -> bool:
        """Try to occupy the GPU for up to `timeout` s; True once it is held."""

    def release(self) -> None:
        """Let go, returning only once the GPU is actually free."""

    @property
    def held(self) -> bool: ...


def lock_path_for(device: Path) -> Path:
    """The lock file that stands for using stand-in GPU `device` (e.g. dev/nvidia0.lock)."""
    return device.with_name(device.name + ".lock")


class LockHolder:
    def __init__(self, index: int, device: Path) -> None:
        self.index = index
        self.device = device
        self.lock_path = lock_path_for(device)
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def hold(self, timeout: float) -> bool:
        if self._fd is not None:
            return True
        # 0644: anyone may open it and try the lock, as anyone may open a free GPU.
        fd = os.open(self.lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        deadline = time.monotonic() + timeout
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    return False
                time.sleep(0.02)
                continue
            self._fd = fd
            return True

    def release(self) -> None:
        if self._fd is None:
            return
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None


class CudaHolder:
    """A real GPU held by a worker process; starting one (torch import, CUDA init) takes seconds,
    so `hold` may return False while the worker is still starting and pick it up on a later call."""

    def __init__(self, index: int, mem_fraction: float, period_s: float = 1.0) -> None:
        self.index = index
        self.mem_fraction = mem_fraction
        self.period_s = period_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = False

    @property
    def held(self) -> bool:
        return self._proc is not None and self._ready and self._proc.poll() is None

    def hold(self, timeout: float) -> bool:
        if self.held:
            return True
        if self._proc is not None and self._proc.poll() is not None:
            self.release()  # a worker that died (crash, OOM): start over
        if self._proc is None:
            env = {
                **os.environ,
                # Slurm's GRES index follows the device minor / PCI order; make CUDA agree.
                "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
                "CUDA_VISIBLE_DEVICES": str(self.index),
            }
            self._proc = subprocess.Popen(
                pyexec.python("-m", "launch.keepalive.cuda_worker",
                              "--mem-fraction", str(self.mem_fraction), "--period", str(self.period_s)),
                stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env,
            )
            self._ready = False
        assert self._proc.stdout is not None
        readable, _, _ = select.select([self._proc.stdout], [], [], max(0.0, timeout))
        if not readable:
            return False  # still starting; keep it
        if self._proc.stdout.readline().startswith(b"ready"):
            self._ready = True
            return True
        self.release()  # it exited before taking the GPU
        return False

    def release(self) -> None:
        if self._proc is None:
            return
        _stop(self._proc)
        self._proc = None
        self._ready = False


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM, then SIGKILL; returns after the process has exited (its memory is freed)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


def discover_standin_gpus(devices_dir: Path) -> dict[int, Path]:
    """nvidiaN char devices with major 195 under `devices_dir`, by index N.

    An nvidiaN entry that is not such a device is skipped; when nothing is left, the error says
    what each skipped one was, so a wrong --devices-dir is told apart from wrong nodes in it."""
    if not devices_dir.exists():
        raise LaunchError(f"devices dir {devices_dir} does not exist; pass the dir holding nvidiaN nodes")
    if not devices_dir.is_dir():
        raise LaunchError(f"devices dir {devices_dir} is not a directory; pass the dir holding nvidiaN nodes")
    found: dict[int, Path] = {}
    skipped: list[str] = []
    for entry in sorted(devices_dir.iterdir()):
        match = _DEVICE_NAME.match(entry.name)
        if not match:
            continue
        try:
            st = entry.stat()
        except OSError as exc:  # e.g. a dangling symlink
            skipped.append(f"{entry.name}: {exc.strerror}")
            continue
        if not stat.S_ISCHR(st.st_mode):
            skipped.append(f"{entry.name} is not a character device")
        elif os.major(st.st_rdev) != NVIDIA_MAJOR:
            skipped.append(f"{entry.name} has major {os.major(st.st_rdev)}, not NVIDIA's {NVIDIA_MAJOR}")
        else:
            found[int(match.group(1))] = entry
    if not found:
        why = f" ({'; '.join(skipped)})" if skipped else ""
        raise LaunchError(f"no stand-in GPUs in {devices_dir}: no nvidiaN character devices with major "
                          f"{NVIDIA_MAJOR}{why}; nothing to hold")
    return dict(sorted(found.items()))


def count_cuda_gpus() -> int:
    try:
        import torch  # lazily: the CLI must stay fast and torch is an optional extra
    except ImportError:
        raise LaunchError(
            "torch is not installed, so real GPUs cannot be held; install the 'train' extra "
            "or pass --devices-dir for stand-in GPUs"
        ) from None
    return int(torch.cuda.device_count())


def node_gpus(devices_dir: Path | None) -> tuple[dict[int, Path], set[int]]:
    """The GPUs this node has: stand-in device nodes in `devices_dir` (with their paths), else
    CUDA's count."""
    if devices_dir is not None:
        devices = discover_standin_gpus(devices_dir)
        return devices, set(devices)
    return {}, set(range(count_cuda_gpus()))


def build_holders(
    gpus: str, devices_dir: Path | None, mem_fraction: float
) -> dict[int, GpuHolder]:
    """Holders for the GPUs to manage: `gpus` is 'auto' (all found) or a list like '0,1'."""
    from launch.keepalive.protocol import parse_gpu_list

    if not 0.0 < mem_fraction <= 0.95:  # also refuses nan
        raise LaunchError(f"--mem-fraction {mem_fraction:g} is out of range; use a value in (0, 0.95]")
    wanted = None if gpus == "auto" else parse_gpu_list(gpus, "--gpus", unique=True)
    if wanted == []:
        raise LaunchError(f"--gpus {gpus!r} names no GPU; give indices like 0,1, or 'auto' for all found")
    devices, available = node_gpus(devices_dir)
    wanted = sorted(available) if wanted is None else wanted
    missing = [i for i in wanted if i not in available]
    if missing:
        raise LaunchError(f"GPU(s) {missing} not found (found {sorted(available)}); fix --gpus")
    if not wanted:
        raise LaunchError("no GPUs found by CUDA; nothing to hold (--devices-dir holds stand-in GPUs)")
    if devices_dir is not None:
        return {i: LockHolder(i, devices[i]) for i in wanted}
    return {i: CudaHolder(i, mem_fraction) for i in wanted}
