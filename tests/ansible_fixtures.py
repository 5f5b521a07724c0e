"""Fixtures for the Ansible tests: a cached Debian rootfs, stand-in GPU nodes, a `pct` stand-in.

The rootfs (minbase plus python3 and python3-apt, which Ansible's apt module needs) is built once with debootstrap and cached as a .tar.zst under $LAUNCH_CACHE (or
~/.cache/launch-tests). The test container has no network (`lxc.net.0.type = empty`), so the
cache build also runs `apt-get update` and `apt-get install --download-only` for the small
package set the roles install in tests, inside the rootfs through chroot: apt inside the
container then installs them for real, from its own local archive, with no mirror access.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

SUITE = "bookworm"
# The packages the roles install in the tests (toolchain's and python_env's small test set).
TEST_APT_PACKAGES = ("gcc", "libc6-dev", "python3-dev", "python3-venv")


def cache_dir() -> Path:
    root = Path(os.environ.get("LAUNCH_CACHE") or Path.home() / ".cache" / "launch-tests")
    root.mkdir(parents=True, exist_ok=True)
    return root


def debian_mirror() -> str:
    """The Debian mirror apt on this machine already uses (deb822 or one-line sources)."""
    sources = sorted(Path("/etc/apt/sources.list.d").glob("*.sources")) + [Path("/etc/apt/sources.list")]
    for path in sources:
        if not path.is_file():
            continue
        for line in path.read_text().splitlines():
            words = line.split()
            if line.startswith("URIs:") and len(words) > 1 and "security" not in words[1]:
                return words[1]
            if line.startswith("deb ") and len(words) > 1 and "security" not in words[1]:
                return words[1]
    return "http://deb.debian.org/debian"


def cached_rootfs_tarball() -> Path:
    """Path of the cached rootfs tarball, building it (about a minute) when absent."""
    key = hashlib.sha256(f"{SUITE} minbase python3 python3-apt {' '.join(TEST_APT_PACKAGES)}".encode()).hexdigest()[:12]
    tarball = cache_dir() / f"rootfs-{SUITE}-minbase-{key}.tar.zst"
    if tarball.exists():
        return tarball
    work = Path(tempfile.mkdtemp(prefix="rootfs-", dir=cache_dir()))
    rootfs = work / "rootfs"
    try:
        subprocess.run(
            ["debootstrap", "--variant=minbase", "--include=python3,python3-apt", SUITE, str(rootfs), debian_mirror()],
            check=True, stdout=subprocess.DEVNULL,
        )
        env = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C"}
        subprocess.run(["chroot", str(rootfs), "apt-get", "update", "-q"], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        subprocess.run(
            ["chroot", str(rootfs), "apt-get", "install", "-y", "-q", "--download-only",
             "--no-install-recommends", *TEST_APT_PACKAGES],
            check=True, env=env, stdout=subprocess.DEVNULL,
        )
        partial = tarball.with_suffix(".partial")
        subprocess.run(["tar", "--zstd", "--numeric-owner", "-cpf", str(partial), "-C", str(rootfs), "."],
                       check=True)
        partial.rename(tarball)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return tarball
