"""CT 200's production path, run for real in a KVM guest (tests/kvm_guest.py).

This machine's controllers are on cgroup v1, where slurmd cannot run its cgroup plugins in an
unprivileged CT (tests/test_slurm_unprivileged_ct.py runs the v1 path). The guest boots Debian's
own kernel with the unified cgroup v2 hierarchy, systemd and D-Bus, as a Proxmox 8/9 host has
them. Not modelled (tests/README.md): Proxmox itself (`pct`: the roles' `lxc` backend makes the
CT), AppArmor, real GPUs (stand-in device nodes), more than one node.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from images.rootfs import cache_dir
from tests.kvm_guest import Guest, booted_guest, kvm_unavailable

REASON = kvm_unavailable()
pytestmark = [pytest.mark.vm, pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=REASON or "")]


@pytest.fixture(scope="module")
def guest(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Guest]:
    work = tmp_path_factory.mktemp("kvm-guest")
    try:
        # The CT's rootfs tarball is read from the tests' cache, shared read-only at its own path.
        with booted_guest(work, extra_shares=(cache_dir(),)) as g:
            yield g
    finally:
        shutil.rmtree(work, ignore_errors=True)


def test_the_guest_boots_systemd_on_cgroup_v2_with_dbus(guest: Guest) -> None:
    out = guest.check("systemctl is-system-running --wait || true; stat -fc %T /sys/fs/cgroup; "
                      "cat /proc/1/comm; systemctl is-active dbus; busctl --system list --no-pager | "
                      "grep -c org.freedesktop.systemd1; uname -r; test -f /proc/self/cgroup && cat /proc/self/cgroup",
                      timeout=120)
    lines = out.splitlines()
    print(f"\n[kvm guest] {' | '.join(lines)}")
    assert lines[0] in ("running", "degraded"), out
    assert lines[1] == "cgroup2fs", out  # the unified hierarchy, not this host's v1
    assert lines[2] == "systemd", out
    assert lines[3] == "active", out
    assert int(lines[4]) >= 1, out  # systemd answers on the system bus
    assert Path(guest.ctl / "mounts").exists()

