"""`make lock-check`: each GPU lock's kernel pins resolve for the Python it is for.

For every lock in images.wheelhouse.GPU_LOCKS, `pip install --dry-run --no-deps
--only-binary=:all:` of its KERNEL_PACKAGES pins (with their hashes) for that Python's tags
(images.make_wheelhouse.RELEASES gives the glibc of the container release that runs it). A pin
without a wheel for its target, or a hash the index does not serve, fails here rather than on a
node. Uses this machine's pip configuration (its index and CA bundle), like `make wheelhouse`.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from images.wheelhouse import GPU_LOCKS, REPO, Target, kernel_pins
from launch.errors import LaunchError
from toolkit import pyexec

# glibc of the release each lock's Python comes with (Debian 12: 3.11; Ubuntu 24.04: 3.12).
GLIBC = {"3.11": "2.36", "3.12": "2.39"}


def dry_run(python: str, lock: Path) -> tuple[bool, str]:
    pins = kernel_pins(lock)
    target = Target(python=python, glibc=GLIBC[python])
    with tempfile.TemporaryDirectory(prefix="lock-check-") as tmp:
        reqs = Path(tmp) / "kernels.txt"
        reqs.write_text("".join(p.line + "\n" for p in pins))
        proc = subprocess.run(
            [*pyexec.python(), "-m", "pip", "install", "--dry-run", "--no-deps", "--only-binary=:all:",
             "--ignore-installed", "--progress-bar=off", "--target", str(Path(tmp) / "t"), *target.pip_args(),
             "-r", str(reqs)], capture_output=True, text=True)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0:
        errors = [line for line in out.splitlines() if line.startswith("ERROR")]
        return False, (errors or [f"pip exit {proc.returncode}"])[0]
    would = [line for line in out.splitlines() if line.startswith("Would install")]
    return True, (would or ["resolved"])[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="make lock-check", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--python", choices=sorted(GPU_LOCKS), action="append", help="only this target (repeatable)")
    args = parser.parse_args(argv)
    failed = 0
    for python in args.python or sorted(GPU_LOCKS):
        lock = REPO / GPU_LOCKS[python]
        try:
            ok, line = dry_run(python, lock)
        except LaunchError as exc:
            ok, line = False, str(exc)
        print(f"{'ok  ' if ok else 'FAIL'} cp{python.replace('.', '')} {lock.relative_to(REPO)}: {line}")
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
