"""A Debian KVM guest for the tests: its own kernel, cgroup v2 unified, systemd and D-Bus.

What a Proxmox host gives a CT and this machine cannot (its controllers are on cgroup v1): the
guest boots bookworm's own kernel (`-kernel`/`-initrd` taken from Debian's linux-image package,
installed into the guest's root by debootstrap, never on this host) with
`systemd.unified_cgroup_hierarchy=1`, systemd as init and D-Bus, and Debian's LXC inside.

The guest's root is built once with debootstrap, made an ext4 image (`mke2fs -d`) and cached under
$LAUNCH_CACHE (or ~/.cache/launch-tests) beside the test rootfs tarballs, keyed on its package
list and on this file's build script and agent; parallel workers build it once (flock). A run
boots it with `snapshot=on`: the cached image is never written.

Driving it: no network, no ssh. Three 9p shares: a control folder (read-write) and, read-only at
their own absolute paths, the repository and the Python prefixes of the interpreter running the
tests (its venv and base install), so the guest runs this checkout's Ansible with this venv and
nothing is installed for it. A small agent (a systemd service in the guest) runs each
`cmd.<n>.sh` the host drops into the control folder and writes `cmd.<n>.out` and `cmd.<n>.rc`.
The guest's serial console goes to a log file that a failure quotes.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import inspect
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from images.rootfs import cache_dir, debian_mirror

REPO = Path(__file__).resolve().parents[1]
QEMU = "qemu-system-x86_64"
SUITE = "bookworm"
# The guest: its kernel (the initramfs is made by initramfs-tools in the guest's own root), systemd
# and D-Bus, LXC for the CT (zstd and tar unpack the CT's template), the libraries the host's
# Python needs (python3 brings them), and the tools the roles' lxc backend calls.
GUEST_PACKAGES = ("linux-image-amd64", "initramfs-tools", "systemd-sysv", "udev", "kmod", "dbus", "lxc",
                  "zstd", "python3", "python3-apt", "iproute2", "procps", "e2fsprogs")
GUEST_IMAGE_MB = 8192
# The guest agent: mounts the shares named in the control folder's `mounts` file, then runs each
# command file in order. Polling (9p has no inotify); a command's rc file appears last (renamed).
AGENT = r"""#!/bin/sh
modprobe -a 9p 9pnet_virtio
opts=trans=virtio,version=9p2000.L,msize=1048576
mkdir -p /ctl && mount -t 9p -o "$opts" ctl /ctl || exit 1
while read -r tag path; do
    mkdir -p "$path" && mount -t 9p -o "$opts,ro,cache=loose" "$tag" "$path"
done < /ctl/mounts
touch /ctl/ready
n=0
while :; do
    if [ -f "/ctl/cmd.$n.sh" ]; then
        /bin/bash "/ctl/cmd.$n.sh" > "/ctl/cmd.$n.out" 2>&1 < /dev/null
        echo $? > "/ctl/cmd.$n.rc.tmp" && mv "/ctl/cmd.$n.rc.tmp" "/ctl/cmd.$n.rc"
        n=$((n + 1))
    else
        sleep 0.2
    fi
done
"""
AGENT_UNIT = """[Unit]
Description=test agent: runs the host's command files from the ctl share
After=local-fs.target
[Service]
Type=simple
ExecStart=/usr/local/sbin/launch-test-agent
[Install]
WantedBy=multi-user.target
"""
# The kernel command line: the unified cgroup v2 hierarchy (bookworm's default, said explicitly),
# no AppArmor (the guest has no apparmor userspace to load LXC's profiles; tests/README.md says so),
# no speculation mitigations (a throwaway test guest; retpolines cost most under TCG).
KERNEL_CMDLINE = ("console=ttyS0 root=/dev/vda rw systemd.unified_cgroup_hierarchy=1 apparmor=0 "
                  "mitigations=off panic=-1 systemd.show_status=0")


def accelerator() -> tuple[list[str], str]:
    """qemu's accelerator and CPU arguments, and a word for the report.

    KVM with the host's CPU where /dev/kvm is hardware KVM. Where it is kvm-pvm (a PVM
    hypervisor, as on a nested cloud VM: /sys/module/kvm_pvm), only a kernel built as a PVM guest
    boots, and Debian's stops after "Probing EDD": the guest runs under qemu's TCG instead, the same
    kernel and root, several times slower.
    """
    if Path("/sys/module/kvm_pvm").exists():
        return ["-accel", "tcg,thread=multi", "-cpu", "max"], "tcg (this /dev/kvm is kvm-pvm)"
    # arch-capabilities off: a nested KVM may refuse MSR 0x10a that -cpu host asks for.
    return ["-accel", "kvm", "-cpu", "host,-arch-capabilities"], "kvm"


def kvm_unavailable() -> str | None:
    """Why a guest cannot be booted here, or None."""
    if os.geteuid() != 0:
        return "needs root (debootstrap, mke2fs -d of a root file system)"
    try:
        os.close(os.open("/dev/kvm", os.O_RDWR))
    except OSError as err:
        return f"/dev/kvm does not open ({err.strerror})"
    for tool in (QEMU, "debootstrap", "mke2fs"):
        if not shutil.which(tool):
            return f"{tool} not installed (make deps)"
    return None


def guest_key() -> str:
    text = f"{SUITE} {' '.join(GUEST_PACKAGES)} {GUEST_IMAGE_MB}\n{AGENT}\n{AGENT_UNIT}\n{_build_script_source()}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _build_script_source() -> str:
    return inspect.getsource(_build_guest)


@dataclass(frozen=True)
class GuestImage:
    kernel: Path
    initrd: Path
    root: Path


def cached_guest_image(cache: Path | None = None) -> GuestImage:
    """The cached guest (kernel, initrd, ext4 root image), built when absent (about 3 min)."""
    cache = cache or cache_dir()
    folder = cache / f"kvm-guest-{SUITE}-{guest_key()}"
    image = GuestImage(folder / "vmlinuz", folder / "initrd.img", folder / "root.img")
    if folder.is_dir():
        return image
    with open(cache / f"kvm-guest-{SUITE}-{guest_key()}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not folder.is_dir():
            _build_guest(folder, cache)
    return image


def _build_guest(folder: Path, cache: Path) -> None:
    work = Path(tempfile.mkdtemp(prefix="kvm-guest-", dir=cache))
    root = work / "root"
    try:
        subprocess.run(["debootstrap", "--variant=minbase", "--include=" + ",".join(GUEST_PACKAGES),
                        SUITE, str(root), debian_mirror()], check=True, stdout=subprocess.DEVNULL)
        (root / "etc/fstab").write_text("/dev/vda / ext4 rw,errors=remount-ro 0 1\n")
        (root / "etc/hostname").write_text("launch-guest\n")
        (root / "etc/hosts").write_text("127.0.0.1 localhost\n127.0.1.1 launch-guest\n")
        agent = root / "usr/local/sbin/launch-test-agent"
        agent.write_text(AGENT)
        agent.chmod(0o755)
        (root / "etc/systemd/system/launch-test-agent.service").write_text(AGENT_UNIT)
        wants = root / "etc/systemd/system/multi-user.target.wants"
        wants.mkdir(parents=True, exist_ok=True)
        (wants / "launch-test-agent.service").symlink_to("/etc/systemd/system/launch-test-agent.service")
        # No login prompt on the console: the log then holds the boot and the agent's work only.
        for unit in ("getty@tty1.service", "serial-getty@ttyS0.service"):
            (root / "etc/systemd/system" / unit).symlink_to("/dev/null")
        (root / "etc/machine-id").write_text("")  # a fresh one at each boot
        boot = sorted((root / "boot").glob("vmlinuz-*"))
        initrds = sorted((root / "boot").glob("initrd.img-*"))
        if not boot or not initrds:
            raise RuntimeError(f"the guest root has no kernel/initrd in /boot: {os.listdir(root / 'boot')}")
        staging = work / "image"
        staging.mkdir()
        shutil.copy2(boot[-1], staging / "vmlinuz")
        shutil.copy2(initrds[-1], staging / "initrd.img")
        subprocess.run(["mke2fs", "-q", "-t", "ext4", "-d", str(root), "-L", "launch-guest",
                        str(staging / "root.img"), f"{GUEST_IMAGE_MB}M"], check=True)
        staging.rename(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)


class GuestError(AssertionError):
    pass


class Guest:
    """A booted guest: `run(script)` runs a bash script in it as root and returns (rc, output)."""

    def __init__(self, proc: subprocess.Popen[bytes], ctl: Path, console: Path):
        self.proc, self.ctl, self.console = proc, ctl, console
        self._n = 0

    def console_tail(self, chars: int = 3000) -> str:
        try:
            return self.console.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def run(self, script: str, timeout: float) -> tuple[int, str]:
        n, self._n = self._n, self._n + 1
        path = self.ctl / f"cmd.{n}.sh"
        tmp = self.ctl / f".cmd.{n}.sh"
        tmp.write_text("set -o pipefail\nexport PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "
                       "LC_ALL=C.UTF-8 HOME=/root\n" + script)
        tmp.rename(path)
        rc_file = self.ctl / f"cmd.{n}.rc"
        deadline = time.monotonic() + timeout
        while not rc_file.exists():
            if self.proc.poll() is not None:
                raise GuestError(f"the guest stopped (qemu exit {self.proc.returncode}) during command {n}:\n"
                                 f"{script[:500]}\n--- console:\n{self.console_tail()}")
            if time.monotonic() > deadline:
                out = (self.ctl / f"cmd.{n}.out").read_text(errors="replace") if (self.ctl / f"cmd.{n}.out").exists() else ""
                raise GuestError(f"command {n} still running after {timeout:.0f} s:\n{script[:500]}\n--- its output:\n"
                                 f"{out[-4000:]}\n--- console:\n{self.console_tail()}")
            time.sleep(0.2)
        return int(rc_file.read_text()), (self.ctl / f"cmd.{n}.out").read_text(errors="replace")

    def check(self, script: str, timeout: float) -> str:
        rc, out = self.run(script, timeout)
        if rc != 0:
            raise GuestError(f"exit {rc} in the guest:\n{script[:800]}\n--- output:\n{out[-6000:]}")
        return out


def host_shares() -> list[Path]:
    """Host folders the guest sees at the same paths: the repository and the test interpreter's
    prefixes (its venv, its base install unless that is /usr, which the guest has itself)."""
    paths = [REPO]
    for prefix in (sys.prefix, sys.base_prefix):
        p = Path(prefix).resolve()
        if p != Path("/usr") and not any(p == q or q in p.parents for q in paths):
            paths.append(p)
    return paths


# Measured on a 2-core machine under TCG: the boot to the agent's start takes 30 s idle, 60-115 s loaded.
BOOT_TIMEOUT_S = 600


@contextlib.contextmanager
def booted_guest(work: Path, *, memory_mb: int = 5120, cpus: int = 2,
                 extra_shares: tuple[Path, ...] = ()) -> Iterator[Guest]:
    """Boot the cached guest; the VM is killed on the way out whatever happened."""
    image = cached_guest_image()
    ctl = work / "ctl"
    ctl.mkdir(parents=True)
    console = work / "console.log"
    shares = [*host_shares(), *extra_shares]
    (ctl / "mounts").write_text("".join(f"share{i} {p}\n" for i, p in enumerate(shares)))
    accel, _ = accelerator()
    argv = [QEMU, *accel, "-smp", str(cpus), "-m", str(memory_mb),
            "-nodefaults", "-display", "none", "-no-reboot", "-serial", f"file:{console}",
            "-kernel", str(image.kernel), "-initrd", str(image.initrd), "-append", KERNEL_CMDLINE,
            "-drive", f"file={image.root},if=virtio,format=raw,snapshot=on,cache=unsafe",
            "-virtfs", f"local,path={ctl},mount_tag=ctl,security_model=none,id=ctl"]
    for i, path in enumerate(shares):
        argv += ["-virtfs", f"local,path={path},mount_tag=share{i},security_model=none,readonly=on,id=share{i}"]
    env = {**os.environ, "TMPDIR": str(work)}  # snapshot=on's overlay: removed with the work folder
    qemu_log = work / "qemu.log"  # a file, not a pipe: nobody reads qemu's output while it runs
    with open(qemu_log, "wb") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
    guest = Guest(proc, ctl, console)
    try:
        deadline = time.monotonic() + BOOT_TIMEOUT_S
        while not (ctl / "ready").exists():
            if proc.poll() is not None:
                out = qemu_log.read_text(errors="replace")
                raise GuestError(f"qemu exited {proc.returncode} before the guest was ready: {out[-2000:]}\n"
                                 f"--- console:\n{guest.console_tail()}\n--- argv: {shlex.join(argv)}")
            if time.monotonic() > deadline:
                raise GuestError(f"the guest was not ready after {BOOT_TIMEOUT_S} s\n--- console:\n{guest.console_tail()}")
            time.sleep(0.2)
        yield guest
    finally:
        proc.kill()
        proc.wait()
