"""The GPU locks carry the whole fast path, and their kernel pins resolve for their Python."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from images import check_locks
from images.wheelhouse import GPU_LOCKS, KERNEL_PACKAGES, REPO, kernel_pins
from launch.errors import LaunchError


@pytest.mark.parametrize("python", sorted(GPU_LOCKS))
def test_every_gpu_lock_pins_the_kernel_set(python: str) -> None:
    pins = kernel_pins(REPO / GPU_LOCKS[python])
    assert [p.name for p in pins] == list(KERNEL_PACKAGES)
    assert all(p.hashes for p in pins), "every kernel pin carries its file's sha256"


def test_a_lock_without_a_kernel_pin_is_named(tmp_path: Path) -> None:
    lock = tmp_path / "gpu.lock"
    lines = (REPO / GPU_LOCKS["3.12"]).read_text().splitlines()
    lock.write_text("\n".join(line for line in lines if not line.startswith("cut-cross-entropy==")) + "\n")
    with pytest.raises(LaunchError, match="no pin for cut-cross-entropy"):
        kernel_pins(lock)


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("pip") is None and shutil.which("pip3") is None, reason="no pip")
def test_kernel_pins_resolve_for_cp311_and_cp312(tmp_path: Path) -> None:
    # The real index, through this machine's pip configuration: a pin with no wheel for its
    # target Python, or a hash the index does not serve, fails here.
    for python in sorted(GPU_LOCKS):
        ok, line = check_locks.dry_run(python, REPO / GPU_LOCKS[python])
        assert ok, f"cp{python}: {line}"
        assert "flash_qla-0.1.3" in line and "tilelang-0.1.15" in line
    bad = tmp_path / "bad.lock"
    text = (REPO / GPU_LOCKS["3.11"]).read_text()
    pin = next(p for p in kernel_pins(REPO / GPU_LOCKS["3.11"]) if p.name == "flash-qla")
    bad.write_text(text.replace(pin.hashes[0], "0" * 64))
    ok, line = check_locks.dry_run("3.11", bad)
    assert not ok and "HASHES" in line
