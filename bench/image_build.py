"""Time `make image`: a forced build, the no-op re-run, and the template size.

Builds the trainer image's test flavour (the CI flavour: cached base rootfs, offline apt and
lock) into a temp dir, through the same entry `make image` runs. Run as root:

    PYTHONPATH=. .venv/bin/python bench/image_build.py [--flavour test] [--repeat 1]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def make_image(out: Path, flavour: str, *args: str) -> float:
    start = time.monotonic()
    subprocess.run([sys.executable, "-m", "images.build", "--flavour", flavour, "--out", str(out), *args],
                   check=True, cwd=REPO, stdout=subprocess.DEVNULL, env={**os.environ, "PYTHONPATH": str(REPO)})
    return time.monotonic() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flavour", default="test")
    parser.add_argument("--repeat", type=int, default=1, help="forced builds to time")
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("bench/image_build.py: needs root (debootstrap, chroot, mount); run it as root", file=sys.stderr)
        return 2
    out = Path(tempfile.mkdtemp(prefix="bench-image-"))
    try:
        builds = [make_image(out, args.flavour, "--force") for _ in range(args.repeat)]
        noops = [make_image(out, args.flavour) for _ in range(3)]
        manifest = json.loads((out / f"trainer-{args.flavour}" / "manifest.json").read_text())
    finally:
        shutil.rmtree(out, ignore_errors=True)
    size_mib = manifest["template"]["size"] / 2**20
    print(f"machine: {platform.node()} {os.cpu_count()} cores, {platform.platform()}")
    print(f"{'what':<34}{'seconds':>10}")
    print(f"{'build (force=1), best of ' + str(len(builds)):<34}{min(builds):>10.1f}")
    print(f"{'no-op re-run, median of 3':<34}{sorted(noops)[1]:>10.2f}")
    print(f"{'ratio build / no-op':<34}{min(builds) / sorted(noops)[1]:>10.0f}x")
    print(f"template: {manifest['template']['file']} {size_mib:.0f} MiB, "
          f"{len(manifest['apt_packages'])} Debian packages, venv {manifest['venv'].get('packages', {})}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
