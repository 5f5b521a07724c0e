"""Time `provision.yml` against a fresh real LXC container: first run, re-run, and --check.

Same setup as tests/test_ansible_provision.py (cached debootstrap rootfs, stand-in GPU nodes with
major 195, the `lxc` backend, the tests' small package set). Run as root:

    PYTHONPATH=. .venv/bin/python bench/ansible_provision.py
"""

from __future__ import annotations

import base64
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.ansible_fixtures import (  # noqa: E402
    cached_rootfs_tarball,
    destroy_container,
    lxc_inventory,
    make_standin_gpus,
    run_playbook,
    write_inventory,
)


def main() -> int:
    if os.geteuid() != 0:
        print("bench/ansible_provision.py: needs root (LXC, mknod); run it as root", file=sys.stderr)
        return 2
    start = time.monotonic()
    template = cached_rootfs_tarball()
    rootfs_s = time.monotonic() - start
    root = Path(tempfile.mkdtemp(prefix="bench-provision-"))
    name, lxc_path, scratch = f"bench-provision-{os.getpid()}", root / "lxc", root / "scratch"
    lxc_path.mkdir()
    scratch.mkdir()
    dev, proc_devices = make_standin_gpus(root, gpus=3)
    inventory = write_inventory(root / "inventory.yml", lxc_inventory(
        root, name=name, lxc_path=lxc_path, dev=dev, proc_devices=proc_devices, scratch=scratch,
        template=template, gpus=[0, 1], expected_gpus=3, munge_key_b64=base64.b64encode(os.urandom(64)).decode()))
    rows = []
    try:
        for label, args in [("first run", ()), ("re-run", ()), ("--check --diff", ("--check", "--diff"))]:
            cpu0 = os.times()
            t0 = time.monotonic()
            proc, recap = run_playbook(inventory, *args)
            wall = time.monotonic() - t0
            cpu1 = os.times()
            cpu = (cpu1.children_user - cpu0.children_user) + (cpu1.children_system - cpu0.children_system)
            if proc.returncode != 0:
                print(proc.stdout[-3000:], proc.stderr[-2000:], file=sys.stderr)
                return 1
            changed = sum(host["changed"] for host in recap.values())
            rows.append((label, wall, cpu, changed))
    finally:
        destroy_container(lxc_path, name)
    load = os.getloadavg()[0]
    print(f"machine: {platform.node()} {os.cpu_count()} cores, load avg {load:.1f}; rootfs cache {rootfs_s:.1f} s")
    print(f"{'run':<16} {'wall s':>8} {'cpu s':>8} {'changed':>8}")
    for label, wall, cpu, changed in rows:
        print(f"{label:<16} {wall:8.1f} {cpu:8.1f} {changed:8d}")
    print(f"re-run / first run: {rows[1][1] / rows[0][1]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
