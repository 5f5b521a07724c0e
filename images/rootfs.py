"""Root file systems for images and tests: the cached debootstrap base, the host-root guard,
and the /proc, /sys, /dev mounts a chroot needs while Ansible works in it.

The base rootfs is built once with debootstrap and cached as a .tar.zst under $LAUNCH_CACHE
(default ~/.cache/launch-tests); `tests/ansible_fixtures.py` and `make image` share this cache,
so the test container and the test image start from the same tarball.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from launch.errors import LaunchError
from toolkit.fsutil import atomic_write_text, sha256_file

CHROOT_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
              "DEBIAN_FRONTEND": "noninteractive", "LC_ALL": "C"}


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


@dataclass(frozen=True)
class BaseSpec:
    """What debootstrap builds: suite (release), variant, packages included at bootstrap time,
    and packages only downloaded into apt's cache (so apt can install them later offline)."""

    suite: str = "bookworm"
    variant: str = "minbase"
    include: tuple[str, ...] = ("python3", "python3-apt")
    download: tuple[str, ...] = ()
    mirror: str = ""  # "" = the mirror the host's apt uses
    components: tuple[str, ...] = field(default=())

    def key(self) -> str:
        # The key string is the one tests/ansible_fixtures.py always used, so existing caches
        # stay valid. The mirror is not part of it: any mirror serves the same suite.
        text = f"{self.suite} {self.variant} {' '.join(self.include)} {' '.join(self.download)}"
        if self.components:
            text += " components=" + ",".join(self.components)
        return hashlib.sha256(text.encode()).hexdigest()[:12]

    def tarball(self, cache: Path) -> Path:
        return cache / f"rootfs-{self.suite}-{self.variant}-{self.key()}.tar.zst"


def cached_base_rootfs(spec: BaseSpec, cache: Path | None = None,
                       run: Callable[..., None] | None = None) -> Path:
    """Path of the cached base rootfs tarball, building it (about a minute) when absent.

    `run(argv, env=...)` runs one build command; by default quietly with subprocess.run.
    """
    cache = cache or cache_dir()
    tarball = spec.tarball(cache)
    if tarball.exists():
        return tarball
    # Several builds at once (parallel test workers, two `make image`s) build it once: the first
    # holds the lock, the others wait for it and then find the tarball.
    with open(tarball.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if tarball.exists():
            return tarball
        return _build_base_rootfs(spec, tarball, cache, run)


def _build_base_rootfs(spec: BaseSpec, tarball: Path, cache: Path, run: Callable[..., None] | None) -> Path:
    def quiet(argv: list[str], env: dict[str, str] | None = None) -> None:
        subprocess.run(argv, check=True, env=env, stdout=subprocess.DEVNULL)

    run = run or quiet
    work = Path(tempfile.mkdtemp(prefix="rootfs-", dir=cache))
    rootfs = work / "rootfs"
    try:
        argv = ["debootstrap", f"--variant={spec.variant}"]
        if spec.include:
            argv.append("--include=" + ",".join(spec.include))
        if spec.components:
            argv.append("--components=" + ",".join(spec.components))
        run([*argv, spec.suite, str(rootfs), spec.mirror or debian_mirror()])
        if spec.download:
            run(["chroot", str(rootfs), "apt-get", "update", "-q"], env=CHROOT_ENV)
            run(["chroot", str(rootfs), "apt-get", "install", "-y", "-q", "--download-only",
                 "--no-install-recommends", *spec.download], env=CHROOT_ENV)
        partial = tarball.with_suffix(".partial")
        subprocess.run(["tar", "--zstd", "--numeric-owner", "-cpf", str(partial), "-C", str(rootfs), "."],
                       check=True)
        partial.rename(tarball)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return tarball


def file_sha256(path: Path, cache_sidecar: bool = False) -> str:
    """sha256 of a file. With cache_sidecar, the digest is kept in <path>.sha256 keyed on size
    and mtime, so re-hashing a 200 MB base tarball on every no-op check costs nothing."""
    st = path.stat()
    stamp = f"{st.st_size} {st.st_mtime_ns}"
    sidecar = path.with_name(path.name + ".sha256")
    if cache_sidecar and sidecar.exists():
        saved_stamp, _, digest = sidecar.read_text().strip().rpartition(" ")
        if saved_stamp == stamp and len(digest) == 64:
            return digest
    digest = sha256_file(path)
    if cache_sidecar:
        atomic_write_text(sidecar, f"{stamp} {digest}\n")
    return digest


# --- the host-root guard ------------------------------------------------------------------------

def refuse_host_root(path: Path, what: str = "rootfs") -> Path:
    """Return `path` resolved, or raise when it is the host's / (by name, symlink or bind mount).

    A chroot at / is no chroot: Ansible would then write into the host's /etc.
    """
    resolved = Path(path).resolve()
    if resolved == Path("/"):
        raise LaunchError(f"{what} {path} is the host's root file system; refusing to build into it")
    if resolved.exists() and os.path.samestat(os.stat(resolved), os.stat("/")):
        raise LaunchError(f"{what} {path} is the host's root file system (same inode as /); refusing")
    return resolved


def _unescape_mount_point(text: str) -> str:
    # /proc/self/mountinfo escapes space, tab, newline and backslash as \ooo.
    return text.encode().decode("unicode_escape")


def mounts_under(path: Path) -> list[Path]:
    """Mount points at or below `path` (deepest first)."""
    root = Path(path).resolve()
    found = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            mount_point = Path(_unescape_mount_point(line.split()[4]))
            if mount_point == root or root in mount_point.parents:
                found.append(mount_point)
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def remove_tree(path: Path) -> None:
    """rm -rf a work tree, but never through a mount (a bound /dev would take the host's nodes)."""
    path = refuse_host_root(path, "work tree")
    if not path.exists():
        return
    mounted = mounts_under(path)
    if mounted:
        raise LaunchError(f"{mounted[0]} is still mounted; unmount it before removing {path}")
    shutil.rmtree(path)


POLICY_RC_D = "#!/bin/sh\n# launch image build: no service starts inside the build chroot\nexit 101\n"


@contextlib.contextmanager
def chroot_mounts(rootfs: Path, read_only_binds: list[tuple[Path, str]] | None = None) -> Iterator[None]:
    """The rootfs as a mount point, /proc, /sys and /dev for the chroot (findmnt, apt and pip need them), the host's DNS,
    and a policy-rc.d that keeps package scripts from starting services in the build chroot.

    read_only_binds: (host directory, path inside the rootfs) pairs bound read-only (the
    wheelhouse); their mount points are removed again when they were made here.

    Everything is undone on the way out, also when the body fails. Mounts are private and not
    recursive, so unmounting them can never take a host submount (such as /dev/pts) with it.
    """
    rootfs = refuse_host_root(rootfs)
    done: list[Path] = []
    policy = rootfs / "usr/sbin/policy-rc.d"
    policy_added = False
    made_dirs: list[Path] = []
    try:
        for target, argv in (
            # The rootfs bound onto itself is a mount point, so findmnt inside the chroot finds
            # the file system of / (node_caches checks the fs type of the cache directory).
            (rootfs, ["mount", "--bind", str(rootfs)]),
            (rootfs / "proc", ["mount", "-t", "proc", "proc"]),
            (rootfs / "sys", ["mount", "-t", "sysfs", "sysfs"]),
            (rootfs / "dev", ["mount", "--bind", "/dev"]),
        ):
            target.mkdir(exist_ok=True)
            subprocess.run([*argv, str(target)], check=True, capture_output=True)
            done.append(target)
            subprocess.run(["mount", "--make-private", str(target)], check=True, capture_output=True)
        resolv = rootfs / "etc/resolv.conf"
        # Only over a regular file: mounting onto a symlink (Ubuntu's stub-resolv.conf) would
        # follow it on the host side.
        if resolv.is_file() and not resolv.is_symlink() and Path("/etc/resolv.conf").is_file():
            subprocess.run(["mount", "--bind", "-o", "ro", "/etc/resolv.conf", str(resolv)],
                           check=True, capture_output=True)
            done.append(resolv)
        for source, inside in read_only_binds or ():
            target = rootfs / inside
            if not target.exists():
                target.mkdir(parents=True)
                made_dirs.append(target)
            subprocess.run(["mount", "--bind", str(source), str(target)], check=True, capture_output=True)
            done.append(target)
            subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], check=True, capture_output=True)
            subprocess.run(["mount", "--make-private", str(target)], check=True, capture_output=True)
        if not policy.exists() and policy.parent.is_dir():
            policy.write_text(POLICY_RC_D)
            policy.chmod(0o755)
            policy_added = True
        yield
    finally:
        errors = []
        for target in reversed(done):
            proc = subprocess.run(["umount", str(target)], capture_output=True, text=True)
            if proc.returncode != 0:
                lazy = subprocess.run(["umount", "-l", str(target)], capture_output=True, text=True)
                if lazy.returncode != 0:
                    errors.append(f"{target}: {proc.stderr.strip()}")
        if policy_added:
            policy.unlink(missing_ok=True)
        for made in reversed(made_dirs):
            if not errors and not made.is_mount():
                made.rmdir()
        if errors:
            raise LaunchError("could not unmount " + "; ".join(errors) + "; unmount by hand before removing the tree")
