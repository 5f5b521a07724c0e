#!/usr/bin/env python3
"""The project's own wheel (the `launch`, `train` and `toolkit` packages), built on the controller for the
python_env role.

    project_wheel.py hash SRC            print the sha256 of the sources that go into the wheel
    project_wheel.py build SRC CACHE     print the path of the wheel for those sources, building
                                         it into CACHE/<hash>/ when absent

The hash covers pyproject.toml, README.md and every file under launch/, train/ and toolkit/ (bytecode
excluded); the role keeps it in the venv as a marker, so an unchanged tree installs nothing.
The build runs `pip wheel --no-deps --no-build-isolation` on a copy of those files, so the
source tree gets no build/ or *.egg-info, and nothing is fetched from an index.
Errors: one line on stderr, exit 2.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

TOP_FILES = ("pyproject.toml", "README.md")
PACKAGES = ("launch", "train", "toolkit")


class WheelError(Exception):
    pass


def source_files(src: Path) -> list[Path]:
    """The files the wheel is built from, relative to src, sorted."""
    missing = [name for name in (*TOP_FILES, *PACKAGES) if not (src / name).exists()]
    if missing:
        raise WheelError(f"{src} is not the project's source tree (no {', '.join(missing)})")
    files = [Path(name) for name in TOP_FILES]
    for package in PACKAGES:
        for path in (src / package).rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".pyc", ".pyo"):
                files.append(path.relative_to(src))
    return sorted(files)


def source_hash(src: Path) -> str:
    digest = hashlib.sha256()
    for rel in source_files(src):
        digest.update(str(rel).encode() + b"\0")
        digest.update(hashlib.sha256((src / rel).read_bytes()).digest())
    return digest.hexdigest()


def build(src: Path, cache: Path) -> Path:
    out = cache / source_hash(src)
    wheels = sorted(out.glob("*.whl"))
    if wheels:
        return wheels[0]
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="project-wheel-", dir=cache) as tmp:
        tree, dist = Path(tmp) / "src", Path(tmp) / "dist"
        for rel in source_files(src):
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src / rel, tree / rel)
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check", "--no-deps",
                               "--no-build-isolation", "--no-index", "-q", "-w", str(dist), str(tree)],
                              capture_output=True, text=True,
                              # Fixed zip dates: the same sources give the same wheel bytes on any
                              # checkout (an image keeps the wheel, and its bytes are compared).
                              env={**os.environ, "SOURCE_DATE_EPOCH": "315532800"})
        built = sorted(dist.glob("*.whl"))
        if proc.returncode != 0 or len(built) != 1:
            last = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no wheel written"]
            raise WheelError(f"pip wheel of {src} failed: {last[0]}")
        # Publish the hash directory whole, so a concurrent or interrupted build never leaves a partial one.
        staged = Path(tmp) / "out"
        staged.mkdir()
        os.replace(built[0], staged / built[0].name)
        try:
            os.replace(staged, out)
        except OSError:
            if not any(out.glob("*.whl")):
                raise
    return sorted(out.glob("*.whl"))[0]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    try:
        if len(args) == 2 and args[0] == "hash":
            print(source_hash(Path(args[1]).resolve()))
        elif len(args) == 3 and args[0] == "build":
            print(build(Path(args[1]).resolve(), Path(args[2]).expanduser()))
        else:
            raise WheelError("usage: project_wheel.py hash SRC | build SRC CACHE")
    except (WheelError, OSError) as exc:
        print(f"project_wheel: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
