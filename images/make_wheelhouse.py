"""`make wheelhouse flavour=cpu|gpu [wheels=DIR] [os=ubuntu-24.04 | python=3.12 glibc=2.39] [lock=FILE]`:
the CLI of images/wheelhouse.py for an image flavour (its lock, its target tags, its sdists to
build and optional packages from image.yml).

By default the wheels are for the image's own target (image.yml `target:`). A container that
runs another release (Proxmox's Ubuntu 24.04 template: Python 3.12, glibc 2.39) needs wheels
for its interpreter: `os=` (or `python=`/`glibc=`) resolves them with `pip download
--python-version ... --platform manylinux_2_N_x86_64 ...` into build/wheelhouse/<flavour>-cpNNN/,
from a lock that pins that interpreter's files: `lock=`, by default
images/<name>/requirements-<flavour>-cpNNN.lock.

Kept apart from images/wheelhouse.py so that module never imports the image definition's
loader (images/build.py imports it).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import re
import sys
from pathlib import Path

from images.build import IMAGES_DIR, load_image
from images.wheelhouse import REPO as REPO_ROOT
from images.wheelhouse import SUMS, Target, build_wheelhouse, default_dir
from launch.errors import LaunchError

# The Python and glibc of the container templates the provisioning uses.
RELEASES = {"debian-12": ("3.11", "2.36"), "ubuntu-22.04": ("3.10", "2.35"), "ubuntu-24.04": ("3.12", "2.39"),
            "debian-13": ("3.13", "2.41")}


def target_for(image_target: Target, os_release: str | None, python: str | None, glibc: str | None) -> Target:
    if os_release is not None:
        if os_release not in RELEASES:
            raise LaunchError(f"os={os_release} is not one of {', '.join(sorted(RELEASES))}; give python= and glibc=")
        python, glibc = RELEASES[os_release]
    if python is None and glibc is None:
        return image_target
    if python is None or glibc is None:
        raise LaunchError("python= and glibc= go together (or os=)")
    if not re.fullmatch(r"3\.\d{1,2}", python):
        raise LaunchError(f"python={python} is not a CPython version such as 3.12")
    if not re.fullmatch(r"2\.\d{1,2}", glibc):
        raise LaunchError(f"glibc={glibc} is not a glibc version such as 2.39")
    return Target(python=python, glibc=glibc, arch=image_target.arch)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make wheelhouse", description="the flavour's wheels, resolved with this machine's pip")
    parser.add_argument("--name", default="trainer", help="images/<name>/image.yml")
    parser.add_argument("--flavour", default="cpu", help="a flavour with a wheelhouse (cpu, gpu)")
    parser.add_argument("--out", type=Path, help="the wheelhouse directory (default build/wheelhouse/<flavour>)")
    parser.add_argument("--add", type=Path, metavar="DIR",
                        help="copy wheels of optional packages from DIR in (e.g. a causal-conv1d wheel built with nvcc)")
    parser.add_argument("--os", dest="os_release", choices=sorted(RELEASES), help="the container's release")
    parser.add_argument("--python", help="the container's Python (with --glibc), e.g. 3.12")
    parser.add_argument("--glibc", help="the container's glibc, e.g. 2.39")
    parser.add_argument("--lock", type=Path, help="the lock for that target (default requirements-<flavour>-cpNNN.lock)")
    parser.add_argument("--images-dir", type=Path, default=IMAGES_DIR, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        image = load_image(args.name, args.flavour, args.images_dir)
        if image.wheelhouse is None or image.lock_file is None:
            raise LaunchError(f"flavour {args.flavour!r} of {args.name} has no wheelhouse (its image.yml sets no `wheelhouse:`)")
        target = target_for(image.wheelhouse.target, args.os_release, args.python, args.glibc)
        spec, lock, dest = image.wheelhouse, args.lock or image.lock_file, args.out or default_dir(image.flavour)
        if target != image.wheelhouse.target:
            cp = "cp" + target.python.replace(".", "")
            spec = dataclasses.replace(spec, target=target)
            dest = args.out or default_dir(f"{image.flavour}-{cp}")
            if args.lock is None:
                lock = image.lock_file.with_name(f"{image.lock_file.stem}-{cp}.lock")
                if not lock.is_file():
                    raise LaunchError(f"no lock for Python {target.python}: {image.lock_file.name} pins the files of Python "
                                      f"{image.wheelhouse.target.python}; resolve one for the container (as that lock's "
                                      f"header says, with that Python) into {lock.relative_to(REPO_ROOT)}, or give lock=")
        if not lock.is_file():
            raise LaunchError(f"lock={lock}: no such file (a requirements lock with --hash pins)")
        sums = build_wheelhouse(lock, spec, dest, args.add)
        size = sum((dest / n).stat().st_size for n in sums)
        print(f"wheelhouse: {dest} ({len(sums) - 1} wheels, {size / 2**20:.0f} MiB, {SUMS} "
              f"{hashlib.sha256((dest / SUMS).read_bytes()).hexdigest()[:12]})")
        return 0
    except LaunchError as exc:
        print(f"make wheelhouse: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
