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
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

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
from launch.errors import LaunchError
from toolkit.fsutil import atomic_write_text

REPO = Path(__file__).resolve().parents[1]
IMAGES_DIR = REPO / "images"
ANSIBLE_DIR = REPO / "ansible"
PLAYBOOK = ANSIBLE_DIR / "playbooks" / "image.yml"
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
    roles: tuple[str, ...]
    role_vars: dict[str, Any]
    lock_file: Path | None

    @property
    def tag(self) -> str:
        return f"{self.name}-{self.flavour}"


def _merge(base: dict, over: dict) -> dict:
    merged = dict(base)
    for key, value in over.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
    return merged


def load_image(name: str, flavour: str, images_dir: Path = IMAGES_DIR) -> ImageDef:
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
        if not (ANSIBLE_DIR / "roles" / role / "tasks" / "main.yml").is_file():
            raise LaunchError(f"{path}: role {role!r} is not in ansible/roles")
    lock = spec.get("lock_file") or ""
    lock_path = (path.parent / lock) if lock else None
    if lock_path is not None and not lock_path.is_file():
        raise LaunchError(f"{path}: lock_file {lock} not found next to image.yml")
    if not base.get("release"):
        raise LaunchError(f"{path}: base.release is missing (e.g. bookworm)")
    return ImageDef(
        name=spec.get("name", name), flavour=flavour, directory=path.parent,
        base=BaseSpec(suite=base["release"], variant=base.get("variant", "minbase"),
                      include=tuple(base.get("include") or ()), download=tuple(base.get("download") or ()),
                      mirror=base.get("mirror") or ""),
        distribution=base.get("distribution", "debian"),
        packages=tuple(spec.get("packages") or ()), roles=roles,
        role_vars=dict(spec.get("vars") or {}), lock_file=lock_path,
    )


# --- inputs and their hash ----------------------------------------------------------------------

def input_files(image: ImageDef) -> list[Path]:
    """Every file whose bytes shape the image, in a stable order."""
    files = [image.directory / "image.yml", PLAYBOOK, ANSIBLE_DIR / "ansible.cfg", *BUILDER_FILES]
    if image.lock_file:
        files.append(image.lock_file)
    for role in image.roles:
        files += sorted(p for p in (ANSIBLE_DIR / "roles" / role).rglob("*") if p.is_file())
    return files


def inputs_digest(image: ImageDef, base_tarball: Path) -> tuple[str, dict[str, Any]]:
    """The content hash of all inputs, and the inputs themselves (recorded in the manifest)."""
    def name(path: Path) -> str:
        # Repo files by their repo path; an image dir outside the repo (--images-dir) as images/<name>/...
        try:
            return str(path.relative_to(REPO))
        except ValueError:
            return str(Path("images") / path.relative_to(image.directory.parent))

    files = {name(p): file_sha256(p) for p in input_files(image)}
    base = {"suite": image.base.suite, "variant": image.base.variant, "include": list(image.base.include),
            "download": list(image.base.download), "tarball": base_tarball.name,
            "sha256": file_sha256(base_tarball, cache_sidecar=True)}
    inputs = {"image": image.tag, "files": files, "base": base}
    digest = hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()
    return digest, inputs


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

def write_inventory(path: Path, image: ImageDef, rootfs: Path) -> None:
    host_vars = {
        **image.role_vars,
        "image_rootfs": str(rootfs),
        "ansible_host": str(rootfs),
        "ansible_connection": "community.general.chroot",
        "ansible_python_interpreter": "/usr/bin/python3",
        "image_roles": list(image.roles),
        "image_packages": list(image.packages),
        "python_env_lock_file": str(image.lock_file) if image.lock_file else "",
        # Services are not started in a build chroot (and the slurm role would try).
        "slurm_manage_services": False,
    }
    atomic_write_text(path, yaml.safe_dump({"all": {"hosts": {"image": host_vars}}}, sort_keys=False))


def apply_roles(image: ImageDef, rootfs: Path, work: Path, log: Path, progress: Progress,
                extra_args: tuple[str, ...] = ()) -> None:
    rootfs = refuse_host_root(rootfs)
    inventory = work / "inventory.yml"
    write_inventory(inventory, image, rootfs)
    # The chroot connection passes this environment into the chroot: the build host's pip
    # settings (PIP_FIND_LINKS, PIP_CERT, ...) name host paths and must not shape the image.
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PIP_")}, "ANSIBLE_CONFIG": str(ANSIBLE_DIR / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1",
           "ANSIBLE_FORCE_COLOR": "0", "PYTHONUNBUFFERED": "1", "ANSIBLE_RETRY_FILES_ENABLED": "0"}
    playbook = Path(sys.executable).parent / "ansible-playbook"
    argv = [str(playbook) if playbook.exists() else "ansible-playbook", "-i", str(inventory),
            *extra_args, str(PLAYBOOK)]
    with chroot_mounts(rootfs):
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
    return {"os": os_release.get("PRETTY_NAME", ""), "apt_packages": packages,
            "python": system_python, "venv": venv}


def pack(rootfs: Path, template: Path, progress: Progress) -> None:
    """A rootfs tarball with ./ paths and numeric owners: what `pct create --ostemplate` takes,
    and what the lxc_container role unpacks into <lxcpath>/<name>/rootfs."""
    partial = template.with_name(template.name + ".partial")
    subprocess.run(["tar", "--numeric-owner", "--xattrs", "--acls", "-I", "zstd -T0 -6 -q",
                    "-cpf", str(partial), "-C", str(rootfs), "."], check=True)
    os.replace(partial, template)


# --- the build ----------------------------------------------------------------------------------

@dataclass
class BuildResult:
    manifest: dict[str, Any]
    manifest_path: Path
    rebuilt: bool


def build(name: str, flavour: str, out_dir: Path, force: bool = False, images_dir: Path = IMAGES_DIR,
          cache: Path | None = None, progress: Progress | None = None) -> BuildResult:
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

        cache = cache or cache_dir()
        base_tarball = image.base.tarball(cache)
        if base_tarball.exists():
            digest, inputs = inputs_digest(image, base_tarball)
            last = _read_manifest(manifest_path)
            if not force and last and last.get("inputs_hash") == digest and _template_intact(image_out, last):
                progress("up to date", f"{image.tag} inputs {digest[:12]} match the last build; "
                         f"template {image_out / last['template']['file']} (force=1 rebuilds)")
                return BuildResult(last, manifest_path, rebuilt=False)
        return _build(image, image_out, manifest_path, cache, progress)


def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _template_intact(image_out: Path, manifest: dict[str, Any]) -> bool:
    template = image_out / manifest.get("template", {}).get("file", "")
    return template.is_file() and template.stat().st_size == manifest["template"].get("size")


def _build(image: ImageDef, image_out: Path, manifest_path: Path, cache: Path, progress: Progress) -> BuildResult:
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
    digest, inputs = inputs_digest(image, base_tarball)
    progress("inputs", f"{len(inputs['files'])} files + base rootfs, hash {digest[:12]}")

    rootfs = work / "rootfs"
    rootfs.mkdir()
    progress("unpack", f"{base_tarball.name} -> {rootfs}")
    subprocess.run(["tar", "--zstd", "--numeric-owner", "-xpf", str(base_tarball), "-C", str(rootfs)], check=True)

    progress("roles", f"{', '.join(image.roles)} through the chroot connection (log: {log})")
    apply_roles(image, rootfs, work, log, progress)

    progress("versions", "reading dpkg and the venv inside the rootfs")
    versions = versions_inside(rootfs, image)

    arch = platform.machine().replace("x86_64", "amd64").replace("aarch64", "arm64")
    template = image_out / f"{image.tag}_{digest[:12]}_{arch}.tar.zst"
    progress("pack", f"{template.name}")
    pack(rootfs, template, progress)
    size = template.stat().st_size
    sha = file_sha256(template)

    manifest = {
        "manifest_version": MANIFEST_VERSION,
        "image": image.name, "flavour": image.flavour, "distribution": image.distribution,
        "release": image.base.suite, "arch": arch,
        "inputs_hash": digest, "inputs": inputs,
        "roles": list(image.roles),
        "template": {"file": template.name, "size": size, "sha256": sha},
        **versions,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "build_seconds": round(time.monotonic() - started, 1),
    }
    atomic_write_text(manifest_path, json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    for old in image_out.glob(f"{image.tag}_*.tar.zst"):
        if old != template:
            old.unlink()
    progress("cleanup", f"removing {work}")
    remove_tree(work)
    progress("done", f"{template} ({size / 2**20:.0f} MiB, sha256 {sha[:12]})")
    return BuildResult(manifest, manifest_path, rebuilt=True)


# --- CLI ----------------------------------------------------------------------------------------

def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make image", description=__doc__.splitlines()[0])
    parser.add_argument("--name", default="trainer", help="images/<name>/image.yml")
    parser.add_argument("--flavour", default="cpu", help="a flavour of the image (cpu, gpu, test)")
    parser.add_argument("--force", action="store_true", help="rebuild even when the inputs are unchanged")
    parser.add_argument("--out", type=Path, default=REPO / "build" / "images", help="output directory")
    parser.add_argument("--images-dir", type=Path, default=IMAGES_DIR, help=argparse.SUPPRESS)
    parser.add_argument("--apply-only", type=Path, metavar="ROOTFS",
                        help="only apply the image's roles to an existing rootfs (debugging); never /")
    args = parser.parse_args(argv)
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
            apply_roles(image, rootfs, work, work / "apply.log", Progress())
            return 0
        build(args.name, args.flavour, args.out, force=args.force, images_dir=args.images_dir)
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
