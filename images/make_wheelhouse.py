"""`make wheelhouse flavour=cpu|gpu [wheels=DIR]`: the CLI of images/wheelhouse.py for an image
flavour (its lock, its target tags, its sdists to build and optional packages from image.yml).

Kept apart from images/wheelhouse.py so that module never imports the image definition's
loader (images/build.py imports it).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

from images.build import IMAGES_DIR, load_image
from images.wheelhouse import SUMS, build_wheelhouse, default_dir
from launch.errors import LaunchError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make wheelhouse", description="the flavour's wheels, resolved with this machine's pip")
    parser.add_argument("--name", default="trainer", help="images/<name>/image.yml")
    parser.add_argument("--flavour", default="cpu", help="a flavour with a wheelhouse (cpu, gpu)")
    parser.add_argument("--out", type=Path, help="the wheelhouse directory (default build/wheelhouse/<flavour>)")
    parser.add_argument("--add", type=Path, metavar="DIR",
                        help="copy wheels of optional packages from DIR in (e.g. a causal-conv1d wheel built with nvcc)")
    parser.add_argument("--images-dir", type=Path, default=IMAGES_DIR, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        image = load_image(args.name, args.flavour, args.images_dir)
        if image.wheelhouse is None or image.lock_file is None:
            raise LaunchError(f"flavour {args.flavour!r} of {args.name} has no wheelhouse (its image.yml sets no `wheelhouse:`)")
        dest = args.out or default_dir(image.flavour)
        sums = build_wheelhouse(image.lock_file, image.wheelhouse, dest, args.add)
        size = sum((dest / n).stat().st_size for n in sums)
        print(f"wheelhouse: {dest} ({len(sums) - 1} wheels, {size / 2**20:.0f} MiB, {SUMS} "
              f"{hashlib.sha256((dest / SUMS).read_bytes()).hexdigest()[:12]})")
        return 0
    except LaunchError as exc:
        print(f"make wheelhouse: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
