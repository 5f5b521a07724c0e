"""`make image [name=trainer] [flavour=cpu] [force=1]`: build a versioned LXC/Proxmox template.

Stages: hash the inputs (stop here when they equal the last build's) -> unpack the cached
debootstrap base -> apply the image's roles through Ansible's chroot connection (with /proc,
/sys, /dev mounted, always unmounted after) -> pack a .tar.zst -> record versions -> write
manifest.json atomically. See images/README.md.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from images import wheelhouse as wheelhouse_mod
from images.rootfs import (
    CHROOT_ENV,
    BaseSpec,
    cache_dir,
    cached_base_rootfs,
    chroot_mounts,
    file_sha256,
    refuse_host_root,
    remove_tree,
)
from images.wheelhouse import Target, WheelhouseSpec
from launch.errors import LaunchError
from toolkit.fsutil import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
IMAGES_DIR = REPO / "images"
ANSIBLE_DIR = REPO / "ansible"
# The builder's own code shapes the output, so it is an input too.
BUILDER_FILES = (Path(__file__).resolve(), Path(__file__).resolve().parent / "rootfs.py")
MANIFEST_VERSION = 1
VENV_VERSIONS = ("import importlib.metadata as m, json, sys; "
                 "print(json.dumps({'python': sys.version.split()[0], "
                 "'packages': {d.metadata['Name']: d.version for d in m.distributions()}}))")


# --- the image definition -----------------------------------------------------------------------

@dataclass(frozen=True)
class ImageDef:
    name: str
    flavour: str
    directory: Path
    base: BaseSpec
    distribution: str
    packages: tuple[str, ...]
    apt_update_cache: bool
    roles: tuple[str, ...]
    role_vars: dict[str, Any]
    lock_file: Path | None
    wheelhouse: WheelhouseSpec | None = None  # None: pip installs as the roles say (the test flavour)
    ansible_dir: Path = ANSIBLE_DIR

    @property
    def tag(self) -> str:
        return f"{self.name}-{self.flavour}"


def _merge(base: dict, over: dict) -> dict:
    merged = dict(base)
    for key, value in over.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def load_image(name: str, flavour: str, images_dir: Path = IMAGES_DIR, ansible_dir: Path = ANSIBLE_DIR) -> ImageDef:
    """Read images/<name>/image.yml and apply the flavour's overrides; one-line errors."""
    path = images_dir / name / "image.yml"
    if not path.is_file():
        known = sorted(p.parent.name for p in images_dir.glob("*/image.yml"))
        raise LaunchError(f"no image named {name!r} ({path} missing); known images: {', '.join(known) or 'none'}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise LaunchError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    flavours = raw.pop("flavours", {}) or {}
    if flavour not in flavours:
        raise LaunchError(f"{path}: no flavour {flavour!r}; flavours: {', '.join(flavours) or 'none'}")
    spec = _merge(raw, flavours[flavour] or {})
    base = spec.get("base") or {}
    roles = tuple(spec.get("roles") or ())
    for role in roles:
        if not (ansible_dir / "roles" / role / "tasks" / "main.yml").is_file():
            raise LaunchError(f"{path}: role {role!r} is not in ansible/roles")
    lock = spec.get("lock_file") or ""
    lock_path = (path.parent / lock) if lock else None
    if lock_path is not None and not lock_path.is_file():
        raise LaunchError(f"{path}: lock_file {lock} not found next to image.yml")
    if not base.get("release"):
        raise LaunchError(f"{path}: base.release is missing (e.g. bookworm)")
    wheelhouse = None
    if spec.get("wheelhouse") is not None:
        if lock_path is None:
            raise LaunchError(f"{path}: flavour {flavour!r} has a wheelhouse but no lock_file")
        target, wh = spec.get("target") or {}, spec["wheelhouse"] or {}
        try:
            wheelhouse = WheelhouseSpec(target=Target(**{k: str(v) for k, v in target.items()}),
                                        build=tuple(wh.get("build") or ()), optional=tuple(wh.get("optional") or ()))
        except TypeError:
            raise LaunchError(f"{path}: target takes python, glibc and arch; got {', '.join(target)}") from None
    return ImageDef(
        name=spec.get("name", name), flavour=flavour, directory=path.parent,
        base=BaseSpec(suite=base["release"], variant=base.get("variant", "minbase"),
                      include=tuple(base.get("include") or ()), download=tuple(base.get("download") or ()),
                      mirror=base.get("mirror") or ""),
        distribution=base.get("distribution", "debian"),
        packages=tuple(spec.get("packages") or ()), apt_update_cache=bool(spec.get("apt_update_cache", True)), roles=roles,
        role_vars=dict(spec.get("vars") or {}), lock_file=lock_path, wheelhouse=wheelhouse,
        ansible_dir=ansible_dir,
    )


# --- inputs and their hash ----------------------------------------------------------------------

def input_files(image: ImageDef) -> list[Path]:
    """Every file whose bytes shape the image, in a stable order."""
    ansible = image.ansible_dir
    files = [image.directory / "image.yml", ansible / "playbooks" / "image.yml", ansible / "ansible.cfg", *BUILDER_FILES]
    if image.lock_file:
        files.append(image.lock_file)
    if installs_project(image):
        files.append(ansible / "tools" / "project_wheel.py")  # builds the project's wheel the image keeps
    for role in image.roles:
        files += sorted(p for p in (ansible / "roles" / role).rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    return files


def ansible_versions() -> dict[str, str]:
    """ansible-core, the `ansible` bundle and the collections the build uses (the chroot
    connection is community.general's): a new Ansible can change what the roles do."""
    from importlib.metadata import PackageNotFoundError, version
    from importlib.util import find_spec

    found = {}
    for dist in ("ansible-core", "ansible"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = "absent"
    spec = find_spec("ansible_collections.community.general") if find_spec("ansible_collections") else None
    manifest = Path(next(iter(spec.submodule_search_locations))) / "MANIFEST.json" if spec and spec.submodule_search_locations else None
    found["community.general"] = (json.loads(manifest.read_text())["collection_info"]["version"]
                                  if manifest and manifest.is_file() else "absent")
    return found


def project_hash() -> str:
    """The sha256 of the project's sources (launch, train, toolkit), as python_env's wheel tool computes it."""
    import importlib.util

    tool = ANSIBLE_DIR / "tools" / "project_wheel.py"
    spec = importlib.util.spec_from_file_location("project_wheel", tool)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.source_hash(REPO)


def installs_project(image: ImageDef) -> bool:
    return "python_env" in image.roles and bool(image.role_vars.get("python_env_install_project", True))


def inputs_digest(image: ImageDef, base_tarball: Path, wheelhouse: Path | None = None) -> tuple[str, dict[str, Any]]:
    """The hash of all inputs known before the build, and the inputs themselves (in the manifest).

    The apt package set is only known after the build; the template's content hash adds it."""
    def name(path: Path) -> str:
        # Repo files by their repo path; a tree outside the repo (tests) by its path under images/ or ansible/
        for root, label in ((REPO, ""), (image.directory.parent, "images"), (image.ansible_dir, "ansible")):
            try:
                return str(Path(label) / path.relative_to(root))
            except ValueError:
                continue
        return str(path)

    files = {name(p): file_sha256(p) for p in input_files(image)}
    base = {"suite": image.base.suite, "variant": image.base.variant, "include": list(image.base.include),
            "download": list(image.base.download), "tarball": base_tarball.name,
            "sha256": file_sha256(base_tarball, cache_sidecar=True)}
    inputs: dict[str, Any] = {"image": image.tag, "files": files, "base": base, "ansible": ansible_versions()}
    if installs_project(image):
        inputs["project_sources"] = project_hash()
    if image.wheelhouse is not None:
        if wheelhouse is None:
            raise LaunchError(f"{image.tag} installs from a wheelhouse; none given")
        inputs["wheelhouse"] = {"sha256sums": wheelhouse_mod.sums_digest(wheelhouse),
                                "wheels": len(wheelhouse_mod.read_sums(wheelhouse)) - 1}
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    return digest, inputs


def content_digest(inputs_hash: str, apt_packages: dict[str, str]) -> str:
    """The template's hash: the inputs plus the Debian packages the build actually installed
    (a mirror can move between two builds of the same inputs)."""
    apt = "".join(f"{name}={version}\n" for name, version in sorted(apt_packages.items()))
    return hashlib.sha256(f"{inputs_hash}\n{apt}".encode()).hexdigest()


# --- progress -----------------------------------------------------------------------------------

class Progress:
    """Stage lines with the elapsed time: `[  12.3s] stage: detail`."""

    def __init__(self, stream=sys.stdout) -> None:
        self.start = time.monotonic()
        self.stream = stream

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def __call__(self, stage: str, detail: str = "") -> None:
        print(f"[{self.elapsed():7.1f}s] {stage}{': ' + detail if detail else ''}", file=self.stream, flush=True)


def run_logged(argv: list[str], log: Path, summarise: Callable[[str], str | None],
               env: dict[str, str] | None = None, cwd: Path | None = None) -> int:
    """Run a command with all output appended to `log`; print only what `summarise` returns."""
    with log.open("a") as out:
        out.write(f"$ {' '.join(argv)}\n")
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env, cwd=cwd, bufsize=1)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            shown = summarise(line.rstrip("\n"))
            if shown:
                print(shown, flush=True)
        return proc.wait()


def debootstrap_summary(progress: Progress) -> Callable[[str], str | None]:
    """One line per debootstrap phase (Retrieving, Validating, Extracting, Installing, ...)."""
    last = {"phase": ""}

    def summarise(line: str) -> str | None:
        match = re.match(r"I: (\w+)", line)
        if not match or match[1] == last["phase"]:
            return None
        last["phase"] = match[1]
        return f"[{progress.elapsed():7.1f}s]   debootstrap: {line[3:]}"

    return summarise


def ansible_summary(progress: Progress) -> Callable[[str], str | None]:
    """One line per task, plus failures and the recap."""
    def summarise(line: str) -> str | None:
        if line.startswith("TASK ["):
            return f"[{progress.elapsed():7.1f}s]   task: {line[6:].split(']')[0]}"
        if line.startswith(("fatal:", "failed:", "ERROR!", "[ERROR]")) or re.match(r"^\S+\s*: ok=\d+", line):
            return f"            {line}"
        return None

    return summarise


# --- stages -------------------------------------------------------------------------------------

WHEELHOUSE_MOUNT = "run/launch-wheelhouse"  # inside the rootfs, only while the roles run


def write_inventory(path: Path, image: ImageDef, rootfs: Path, wheelhouse: Path | None = None) -> None:
    host_vars = {
        **image.role_vars,
        "image_rootfs": str(rootfs),
        "ansible_host": str(rootfs),
        "ansible_connection": "community.general.chroot",
        "ansible_python_interpreter": "/usr/bin/python3",
        "image_roles": list(image.roles),
        "image_packages": list(image.packages),
        "image_apt_update_cache": image.apt_update_cache,
        "python_env_lock_file": str(image.lock_file) if image.lock_file else "",
        # Services are not started in a build chroot (and the slurm role would try).
        "slurm_manage_services": False,
    }
    if wheelhouse is not None:
        # Bind-mounted read-only at this path inside the chroot: nothing is copied, nothing left.
        host_vars |= {"python_env_wheelhouse": "/" + WHEELHOUSE_MOUNT, "python_env_wheelhouse_copy": False}
    atomic_write_text(path, yaml.safe_dump({"all": {"hosts": {"image": host_vars}}}, sort_keys=False))


def apply_roles(image: ImageDef, rootfs: Path, work: Path, log: Path, progress: Progress,
                extra_args: tuple[str, ...] = (), wheelhouse: Path | None = None,
                source_date_epoch: int | None = None) -> None:
    rootfs = refuse_host_root(rootfs)
    inventory = work / "inventory.yml"
    write_inventory(inventory, image, rootfs, wheelhouse)
    # The chroot connection passes this environment into the chroot: the build host's pip
    # settings (PIP_FIND_LINKS, PIP_CERT, ...) name host paths and must not shape the image.
    # SOURCE_DATE_EPOCH makes pip and py_compile write hash-based .pyc files and lets dpkg
    # tools clamp their dates, so the rootfs's bytes do not depend on when it was built.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PIP_")}, "ANSIBLE_CONFIG": str(ANSIBLE_DIR / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_FORCE_COLOR": "0", "PYTHONUNBUFFERED": "1", "ANSIBLE_RETRY_FILES_ENABLED": "0",
           "PIP_NO_CACHE_DIR": "1", "PYTHONHASHSEED": "0"}
    if source_date_epoch is not None:
        env["SOURCE_DATE_EPOCH"] = str(source_date_epoch)
    playbook = Path(sys.executable).parent / "ansible-playbook"
    argv = [str(playbook) if playbook.exists() else "ansible-playbook", "-i", str(inventory),
            *extra_args, str(image.ansible_dir / "playbooks" / "image.yml")]
    binds = [(wheelhouse, WHEELHOUSE_MOUNT)] if wheelhouse is not None else []
    with chroot_mounts(rootfs, read_only_binds=binds):
        rc = run_logged(argv, log, ansible_summary(progress), env=env, cwd=REPO)
    if rc != 0:
        raise LaunchError(f"ansible-playbook failed (exit {rc}); the full output is in {log}")


def chroot_output(rootfs: Path, *argv: str) -> str:
    return subprocess.run(["chroot", str(rootfs), *argv], check=True, capture_output=True, text=True,
                          env=CHROOT_ENV).stdout


def versions_inside(rootfs: Path, image: ImageDef) -> dict[str, Any]:
    """Debian packages, the system Python and the venv's packages, read from the built rootfs."""
    dpkg = chroot_output(rootfs, "dpkg-query", "-W", "-f=${Package}\t${Version}\t${db:Status-Abbrev}\n")
    packages = {name: version for name, version, status in (line.split("\t") for line in dpkg.splitlines())
                if status.startswith("ii")}
    system_python = chroot_output(rootfs, "/usr/bin/python3", "-c", "import sys; print(sys.version.split()[0])").strip()
    venv_path = image.role_vars.get("python_env_path", "/opt/launch/venv")
    venv: dict[str, Any] = {}
    if "python_env" in image.roles:
        venv = {"path": venv_path, **json.loads(chroot_output(rootfs, f"{venv_path}/bin/python", "-c", VENV_VERSIONS))}
    os_release = dict(re.findall(r'^(\w+)="?([^"\n]*)"?$', (rootfs / "etc/os-release").read_text(), re.M))
    if image.wheelhouse is not None:
        target = image.wheelhouse.target
        libc = packages.get("libc6", "")
        if not system_python.startswith(target.python + ".") or not libc.startswith(target.glibc):
            raise LaunchError(f"the rootfs has Python {system_python} and glibc {libc}, but image.yml's target says "
                              f"Python {target.python}, glibc {target.glibc}: fix `target:` and rebuild the wheelhouse")
    return {"os": os_release.get("PRETTY_NAME", ""), "apt_packages": packages,
            "python": system_python, "venv": venv}


def newest_mtime(rootfs: Path) -> int:
    """The newest mtime in the freshly unpacked base rootfs: the build's SOURCE_DATE_EPOCH.

    A function of the base tarball's bytes (an input), so equal inputs give equal dates; every
    file the build writes later is clamped to it when packed."""
    newest = 0
    for root, dirs, files in os.walk(rootfs):
        for entry in (*dirs, *files):
            newest = max(newest, int(os.lstat(os.path.join(root, entry)).st_mtime))
    return newest


# Written or left by the build itself, not part of the image: logs with dates, caches keyed on
# inodes and times, the builder's identity (hostname, DNS, machine-id).
SCRUB_TREES = ("root/.cache", "root/.ansible", "var/cache/ldconfig/aux-cache", "var/lib/dbus/machine-id",
               "var/cache/debconf/config.dat-old", "var/cache/debconf/templates.dat-old")
SCRUB_EMPTY_DIRS = ("tmp", "var/tmp", "var/lib/apt/lists")


def scrub(rootfs: Path) -> None:
    rootfs = refuse_host_root(rootfs)
    for rel in SCRUB_TREES:
        path = rootfs / rel
        if path.is_symlink() or path.is_file():
            path.unlink()
        elif path.is_dir():
            shutil.rmtree(path)
    for rel in SCRUB_EMPTY_DIRS:
        for child in (rootfs / rel).iterdir() if (rootfs / rel).is_dir() else ():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    for path in sorted((rootfs / "var/log").rglob("*")):
        if path.is_file() and not path.is_symlink():
            path.unlink()
    # systemd makes a machine-id at first boot when the file is empty; each container its own.
    # An empty hostname keeps the name LXC or Proxmox gives the container; pct writes its own
    # hostname, hosts and resolv.conf.
    for rel, text in (("etc/machine-id", ""), ("etc/hostname", ""), ("etc/resolv.conf", ""),
                      ("etc/hosts", "127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\n")):
        path = rootfs / rel
        if path.is_symlink():
            continue
        path.write_text(text)


ZSTD = ["zstd", "-6", "-T0", "-q"]  # one level for every build; zstd's output does not depend on -T
XZ = ["xz", "-1", "-T0", "-q"]      # what lxc-create -t local unpacks (tar -J); -1: xz is the slow one


def tar_argv(rootfs: Path, source_date_epoch: int) -> list[str]:
    """A tar stream whose bytes are a function of the tree's contents: sorted names, numeric
    owners, mtimes clamped to SOURCE_DATE_EPOCH, no atime/ctime and no PID in PAX headers."""
    return ["tar", "--sort=name", "--format=posix",
            "--pax-option=exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime",
            f"--mtime=@{source_date_epoch}", "--clamp-mtime", "--numeric-owner", "--xattrs", "--acls",
            "-C", str(rootfs), "-cf", "-", "."]


def pack(rootfs: Path, outputs: dict[Path, list[str]], source_date_epoch: int) -> None:
    """One tar stream of the rootfs, compressed by each command in `outputs` (zstd for the
    template; xz too when asked), each written to .partial and renamed."""
    partials = {out: out.with_name(out.name + ".partial") for out in outputs}
    tar = subprocess.Popen(tar_argv(rootfs, source_date_epoch), stdout=subprocess.PIPE)
    assert tar.stdout is not None
    compressors = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=partials[out].open("wb"))
                   for out, cmd in outputs.items()]
    try:
        while chunk := tar.stdout.read(1 << 20):
            for proc in compressors:
                assert proc.stdin is not None
                proc.stdin.write(chunk)
    finally:
        for proc in compressors:
            assert proc.stdin is not None
            proc.stdin.close()
        codes = [tar.wait(), *(proc.wait() for proc in compressors)]
    if any(codes):
        raise LaunchError(f"packing {rootfs} failed (tar and compressor exit codes {codes})")
    for out, partial in partials.items():
        os.replace(partial, out)


LXC_CONFIG = "lxc.include = LXC_TEMPLATE_CONFIG/common.conf\nlxc.arch = {arch}\n"
LXC_CONFIG_USER = "lxc.include = LXC_TEMPLATE_CONFIG/common.conf\nlxc.include = LXC_TEMPLATE_CONFIG/userns.conf\nlxc.arch = {arch}\n"


def write_lxc_metadata(path: Path, image: ImageDef, arch: str, source_date_epoch: int) -> None:
    """The metadata tarball `lxc-create -t local -- --metadata M --fstree ROOTFS.tar.xz` takes:
    the distribution's config (privileged and user-namespace variants), the files to leave out
    of /dev, a message. Deterministic: fixed owners and dates, xz of a sorted stream."""
    import io
    import lzma
    import tarfile

    lxc_arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(arch, arch)
    members = {
        "config": LXC_CONFIG.format(arch=lxc_arch),
        "config-user": LXC_CONFIG_USER.format(arch=lxc_arch),
        "excludes": "dev/*\n",
        "create-message": f"{image.tag} ({image.distribution} {image.base.suite}): systemd boots it; "
                          "the training venv is /opt/launch/venv.\n",
    }
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for name in sorted(members):
            data = members[name].encode()
            info = tarfile.TarInfo(name)
            info.size, info.mtime, info.mode, info.uid, info.gid = len(data), source_date_epoch, 0o644, 0, 0
            tar.addfile(info, io.BytesIO(data))
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(lzma.compress(buffer.getvalue(), preset=6))
    os.replace(partial, path)


# --- the build ----------------------------------------------------------------------------------

@dataclass
class BuildResult:
    manifest: dict[str, Any]
    manifest_path: Path
    rebuilt: bool


def build(name: str, flavour: str, out_dir: Path, force: bool = False, images_dir: Path = IMAGES_DIR,
          cache: Path | None = None, progress: Progress | None = None, wheelhouse: Path | None = None,
          lxc_xz: bool = False) -> BuildResult:
    progress = progress or Progress()
    image = load_image(name, flavour, images_dir)
    image_out = out_dir / image.tag
    image_out.mkdir(parents=True, exist_ok=True)
    manifest_path = image_out / "manifest.json"
    with (image_out / ".lock").open("w") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LaunchError(f"another build of {image.tag} is running (lock {image_out / '.lock'})") from None

        if image.wheelhouse is not None:
            assert image.lock_file is not None
            wheelhouse = wheelhouse or wheelhouse_mod.default_dir(image.flavour)
            # A no-op (no pip run, no re-hash) when the wheelhouse already matches the lock.
            wheelhouse_mod.build_wheelhouse(image.lock_file, image.wheelhouse, wheelhouse,
                                            log=lambda line: progress("wheelhouse", line))
        else:
            wheelhouse = None
        cache = cache or cache_dir()
        base_tarball = image.base.tarball(cache)
        if base_tarball.exists():
            digest, inputs = inputs_digest(image, base_tarball, wheelhouse)
            last = _read_manifest(manifest_path)
            if (not force and last and last.get("inputs_hash") == digest and _template_intact(image_out, last)
                    and (not lxc_xz or "lxc_rootfs" in last)):
                progress("up to date", f"{image.tag} inputs {digest[:12]} match the last build; "
                         f"template {image_out / last['template']['file']} (force=1 rebuilds)")
                return BuildResult(last, manifest_path, rebuilt=False)
        return _build(image, image_out, manifest_path, cache, progress, wheelhouse, lxc_xz)


def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _template_intact(image_out: Path, manifest: dict[str, Any]) -> bool:
    template = image_out / manifest.get("template", {}).get("file", "")
    return template.is_file() and template.stat().st_size == manifest["template"].get("size")


def _artifact(path: Path) -> dict[str, Any]:
    return {"file": path.name, "size": path.stat().st_size, "sha256": file_sha256(path)}


def _build(image: ImageDef, image_out: Path, manifest_path: Path, cache: Path, progress: Progress,
           wheelhouse: Path | None, lxc_xz: bool) -> BuildResult:
    work = image_out / "work"
    remove_tree(work)
    work.mkdir()
    log = work / "build.log"
    started = time.monotonic()

    base_tarball = image.base.tarball(cache)
    if base_tarball.exists():
        progress("base rootfs", f"cached {base_tarball}")
    else:
        progress("base rootfs", f"debootstrap {image.base.variant} {image.base.suite} (cached after this run)")
        summary = debootstrap_summary(progress)

        def run(argv: list[str], env: dict[str, str] | None = None) -> None:
            if run_logged(argv, log, summary, env=env) != 0:
                raise LaunchError(f"{argv[0]} failed; the full output is in {log}")

        cached_base_rootfs(image.base, cache, run=run)
    if wheelhouse is not None:
        progress("wheelhouse", f"checking {wheelhouse} against its {wheelhouse_mod.SUMS}")
        wheelhouse_mod.verify(wheelhouse)
    digest, inputs = inputs_digest(image, base_tarball, wheelhouse)
    progress("inputs", f"{len(inputs['files'])} files + base rootfs, hash {digest[:12]}")

    rootfs = work / "rootfs"
    rootfs.mkdir()
    progress("unpack", f"{base_tarball.name} -> {rootfs}")
    subprocess.run(["tar", "--zstd", "--numeric-owner", "-xpf", str(base_tarball), "-C", str(rootfs)], check=True)
    epoch = newest_mtime(rootfs)

    progress("roles", f"{', '.join(image.roles)} through the chroot connection (log: {log})")
    apply_roles(image, rootfs, work, log, progress, wheelhouse=wheelhouse, source_date_epoch=epoch)

    progress("versions", "reading dpkg and the venv inside the rootfs")
    versions = versions_inside(rootfs, image)
    scrub(rootfs)

    content = content_digest(digest, versions["apt_packages"])
    arch = platform.machine().replace("x86_64", "amd64").replace("aarch64", "arm64")
    stem = f"{image.tag}_{content[:12]}_{arch}"
    template = image_out / f"{stem}.tar.zst"
    outputs = {template: ZSTD}
    lxc_rootfs = image_out / f"{stem}.rootfs.tar.xz"
    if lxc_xz:
        outputs[lxc_rootfs] = XZ
    progress("pack", ", ".join(p.name for p in outputs) + f" (mtimes clamped to {epoch})")
    pack(rootfs, outputs, epoch)
    metadata = image_out / f"{stem}.lxc-meta.tar.xz"
    write_lxc_metadata(metadata, image, arch, epoch)

    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "image": image.name, "flavour": image.flavour, "distribution": image.distribution,
        "release": image.base.suite, "arch": arch,
        "inputs_hash": digest, "content_hash": content, "inputs": inputs,
        "source_date_epoch": epoch,
        "roles": list(image.roles),
        "template": _artifact(template),
        "lxc_metadata": _artifact(metadata),
        **({"lxc_rootfs": _artifact(lxc_rootfs)} if lxc_xz else {}),
        **versions,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_seconds": round(time.monotonic() - started, 1),
    }
    atomic_write_text(manifest_path, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    keep = {template.name, metadata.name, lxc_rootfs.name if lxc_xz else ""}
    for old in image_out.glob(f"{image.tag}_*.tar.*"):
        if old.name not in keep:
            old.unlink()
    progress("cleanup", f"removing {work}")
    remove_tree(work)
    size, sha = manifest["template"]["size"], manifest["template"]["sha256"]
    progress("done", f"{template} ({size / 2**20:.0f} MiB, sha256 {sha[:12]})")
    return BuildResult(manifest, manifest_path, rebuilt=True)


# --- CLI ----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make image", description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="trainer", help="images/<name>/image.yml")
    parser.add_argument("--flavour", default="cpu", help="a flavour of the image (cpu, gpu, test)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the inputs are unchanged")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "images", help="output directory")
    parser.add_argument("--wheelhouse", type=Path, help="the flavour's wheelhouse (default build/wheelhouse/<flavour>)")
    parser.add_argument("--lxc-xz", action="store_true",
                        help="also write the rootfs as .tar.xz, which `lxc-create -t local` unpacks")
    parser.add_argument("--images-dir", type=Path, default=IMAGES_DIR, help=argparse.SUPPRESS)
    parser.add_argument("--apply-only", type=Path, metavar="ROOTFS",
                        help="only apply the image's roles to an existing rootfs (debugging); never /")
    args = parser.parse_args(argv)
    # A TERM (a CI timeout, `kill`) unwinds like Ctrl-C, so the chroot's mounts are undone.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        rootfs = refuse_host_root(args.apply_only) if args.apply_only is not None else None
        if os.geteuid() != 0:
            raise LaunchError("make image needs root (debootstrap, chroot, mount); run it with sudo")
        if rootfs is not None:
            if not rootfs.is_dir():
                raise LaunchError(f"{args.apply_only} is not a directory")
            image = load_image(args.name, args.flavour, args.images_dir)
            work = rootfs.parent / f".{rootfs.name}.apply"
            work.mkdir(exist_ok=True)
            wheelhouse = (args.wheelhouse or wheelhouse_mod.default_dir(image.flavour)) if image.wheelhouse else None
            apply_roles(image, rootfs, work, work / "apply.log", Progress(), wheelhouse=wheelhouse)
            return 0
        build(args.name, args.flavour, args.out, force=args.force, images_dir=args.images_dir,
              wheelhouse=args.wheelhouse, lxc_xz=args.lxc_xz)
        return 0
    except LaunchError as exc:
        print(f"make image: {exc}", file=sys.stderr)
        return 2
    except subprocess.CalledProcessError as exc:
        print(f"make image: {' '.join(map(str, exc.cmd))} failed (exit {exc.returncode})", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("make image: interrupted; mounts were undone, the work tree is left for inspection", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
