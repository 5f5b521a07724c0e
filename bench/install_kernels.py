"""Install the GPU fast path's kernel packages at exactly a lock's pins, from a local wheel folder.

A GPU benchmark measures what a provisioned node gets only if it runs the same kernel packages:
this installs, into a --target folder beside the machine's own torch and triton (merged with what
earlier calls installed there), every wheel of the folder that the lock pins (name, version and sha256 all checked against the lock; a wheel of
another version or hash is refused, one the lock does not pin is skipped and named), then
`--check` verifies that every package of images.wheelhouse.KERNEL_PACKAGES is there at its pin
and prints the versions a RESULTS.md row records (`--json FILE` writes them too).

    python3 bench/install_kernels.py --lock images/trainer/requirements-gpu-cp312.lock \
        --wheels WHEELS --target /tmp/gpuenv            # may run once per wheel folder
    python3 bench/install_kernels.py --lock images/trainer/requirements-gpu-cp312.lock \
        --target /tmp/gpuenv --check --json versions.json

Then run the benchmark with PYTHONPATH=/tmp/gpuenv and LD_LIBRARY_PATH=/tmp/gpuenv/z3/lib
(tilelang loads libz3 from z3-solver's folder).

A wheel may put its package on sys.path through a .pth file (nvidia-cutlass-dsl: `cutlass` lives in
nvidia_cutlass_dsl/dsl_packages), and Python runs .pth files only in site directories, never in a
PYTHONPATH entry: the install says so, and `--pythonpath` prints the PYTHONPATH a target needs
(the target and what its .pth files add), e.g. PYTHONPATH=$(python3 bench/install_kernels.py
--pythonpath --target /tmp/lossenv):$PYTHONPATH.
"""

from __future__ import annotations

import argparse
import csv
import importlib.metadata as md
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from packaging.utils import InvalidWheelFilename, canonicalize_name  # noqa: E402

from images.wheelhouse import KERNEL_PACKAGES, kernel_pins, read_lock, wheel_identity  # noqa: E402
from launch.errors import LaunchError  # noqa: E402
from toolkit import pyexec  # noqa: E402
from toolkit.fsutil import atomic_write_text, sha256_file  # noqa: E402

# Installed beside the kernels when the folder has them at the lock's pins (the trainer needs
# them; the machine's own copies may be older): recorded in the versions table too.
ALSO_RECORDED = ("transformers", "submitit", "cloudpickle", "deepspeed", "causal-conv1d")


def install(lock: Path, wheels: Path, target: Path) -> list[str]:
    pins = {p.name: p for p in read_lock(lock)}
    chosen: list[Path] = []
    if not wheels.is_dir():
        raise LaunchError(f"--wheels {wheels}: not a directory of wheels")
    for path in sorted(wheels.glob("*.whl")):
        try:
            name, version, _tags = wheel_identity(path.name)
        except InvalidWheelFilename as exc:
            raise LaunchError(f"{path.name}: not a wheel's file name ({exc}); remove or rename it") from None
        pin = pins.get(name)
        if pin is None:
            print(f"skipped {path.name}: {lock.name} does not pin {name}")
            continue
        if pin.version != version:
            raise LaunchError(f"{path.name}: {lock.name} pins {name}=={pin.version}, not {version}")
        if not pin.hashes:  # a wheel of this name and version with any bytes would do: not a pin
            raise LaunchError(f"{path.name}: {lock.name} pins {name}=={version} without --hash=sha256:...; "
                              "a lock this installs from pins each wheel's hash")
        if sha256_file(path) not in pin.hashes:
            raise LaunchError(f"{path.name}: its sha256 is not the one {lock.name} pins for {name}=={version}")
        chosen.append(path)
    if not chosen:
        raise LaunchError(f"no wheel in {wheels} is pinned by {lock.name}")
    target.mkdir(parents=True, exist_ok=True)
    # `pip install --target T --upgrade` replaces each top-level folder of T that the new wheels
    # have: wheels that share one (nvidia-cutlass-dsl's -libs-base, -libs-core and -libs-cu12 all
    # write into nvidia_cutlass_dsl/) and arrive in different calls (a wheel sent in parts is joined
    # later) would leave only the last call's files. So pip installs into a fresh folder, a package
    # already in T is removed file by file (its RECORD), and the new files are merged in.
    staging = Path(tempfile.mkdtemp(prefix=".install-", dir=target))
    try:
        proc = subprocess.run([*pyexec.python(), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                               "--no-cache-dir", "--target", str(staging), *map(str, chosen)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            errors = [line for line in (proc.stderr + proc.stdout).splitlines() if line.startswith("ERROR")]
            raise LaunchError(f"pip install failed: {(errors or ['exit ' + str(proc.returncode)])[0]}")
        names = [wheel_identity(p.name)[0] for p in chosen]
        for name in names:
            uninstall(target, name)
        merge(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return names


def _dist_infos(target: Path, name: str) -> list[Path]:
    """`name`'s .dist-info folders in `target` (any version)."""
    return [d for d in target.glob("*.dist-info")
            if d.is_dir() and canonicalize_name(d.name[:-len(".dist-info")].rpartition("-")[0]) == name]


def uninstall(target: Path, name: str) -> None:
    """Remove what `name`'s RECORD lists under `target` (never a path outside it), then its empty folders."""
    for info in _dist_infos(target, name):
        record = info / "RECORD"
        rows = list(csv.reader(record.read_text().splitlines())) if record.is_file() else []
        folders = set()
        for row in rows:
            path = (target / row[0]).resolve() if row else None
            if path is None or not path.is_relative_to(target.resolve()) or path == target.resolve():
                continue
            if path.is_file() or path.is_symlink():
                path.unlink()
            folders.update(p for p in path.parents if p.is_relative_to(target.resolve()) and p != target.resolve())
        shutil.rmtree(info, ignore_errors=True)
        for folder in sorted(folders, key=lambda f: len(f.parts), reverse=True):  # deepest first
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()


def merge(src: Path, dst: Path) -> None:
    """Move src's tree into dst: folders merged, files replaced (a rename: the same file system)."""
    for item in src.iterdir():
        to = dst / item.name
        if item.is_dir() and not item.is_symlink() and to.is_dir() and not to.is_symlink():
            merge(item, to)
            continue
        if to.is_dir() and not to.is_symlink():
            shutil.rmtree(to)
        os.replace(item, to)


# Run in a child with no site directory of its own: the entries site.addsitedir(TARGET) puts on
# sys.path besides TARGET, i.e. what TARGET's .pth files add (they may run code, as at any start).
_SITE_PATHS = ("import site, sys; before = set(sys.path); site.addsitedir(sys.argv[1]); "
               "print(*(p for p in sys.path if p not in before and p != sys.argv[1]), sep=chr(10))")


def site_paths(target: Path) -> list[str]:
    """What `target`'s .pth files add to sys.path when it is a site directory (none from PYTHONPATH)."""
    if not any(target.glob("*.pth")):
        return []
    proc = subprocess.run([sys.executable, "-I", "-S", "-c", _SITE_PATHS, str(target)], capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        raise LaunchError(f"{target}: reading its .pth files failed: {last}")
    return [line for line in proc.stdout.splitlines() if line]


def pythonpath(target: Path) -> str:
    """The PYTHONPATH entries that make `target` importable as its wheels expect."""
    return ":".join([str(target), *site_paths(target)])


def installed_versions(target: Path, also: tuple[Path, ...] = ()) -> dict[str, str]:
    """name -> version of what `target` (then each of `also`) holds, then of what the interpreter
    has beside it."""
    found: dict[str, str] = {}
    for path in ([str(target)], *([str(a)] for a in also), None):
        for dist in md.distributions(**({"path": path} if path else {})):
            name = canonicalize_name(dist.metadata["Name"] or "")
            found.setdefault(name, dist.version)
    return found


def check(lock: Path, target: Path, also: tuple[Path, ...] = ()) -> tuple[dict[str, str], list[str]]:
    versions = installed_versions(target, also)
    problems = []
    for pin in kernel_pins(lock):
        have = versions.get(pin.name)
        if have != pin.version:
            problems.append(f"{pin.name}: {have or 'not installed'} (the lock pins {pin.version})")
    recorded = {name: versions.get(name, "-") for name in (*KERNEL_PACKAGES, *ALSO_RECORDED, "torch", "triton")}
    return recorded, problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    parser.add_argument("--lock", type=Path, help="the GPU lock of this machine's Python (all but --pythonpath)")
    parser.add_argument("--wheels", type=Path, help="a folder of wheels to install at the lock's pins")
    parser.add_argument("--target", type=Path, required=True, help="the install folder (put it on PYTHONPATH)")
    parser.add_argument("--check", action="store_true", help="verify the whole kernel set is at the lock's pins")
    parser.add_argument("--json", type=Path, help="with --check: write the versions table here")
    parser.add_argument("--pythonpath", action="store_true",
                        help="print the PYTHONPATH --target needs: it and the folders its .pth files add")
    parser.add_argument("--also", type=Path, action="append", default=[],
                        help="with --check: another install folder that holds part of the set (repeatable)")
    parser.add_argument("--optional", action="append", default=[], metavar="NAME",
                        help="with --check: a package of the set whose absence is a warning, not a failure "
                        "(a bench that measures it says so in its own row; repeatable)")
    args = parser.parse_args(argv)
    try:
        if args.pythonpath:
            if not args.target.is_dir():
                raise LaunchError(f"--target {args.target}: not a directory")
            print(pythonpath(args.target))
            return 0
        if args.lock is None:
            raise LaunchError("--lock is required (the GPU lock of this machine's Python)")
        if not args.lock.is_file():
            raise LaunchError(f"--lock {args.lock}: {'not a file' if args.lock.exists() else 'no such file'}")
        if args.json is not None and (args.json.is_dir() or not args.json.parent.is_dir()):
            raise LaunchError(f"--json {args.json}: {'a directory' if args.json.is_dir() else 'its folder does not exist'}; "
                              "give a file path")
        if args.wheels is not None:
            names = install(args.lock, args.wheels, args.target)
            print(f"installed at {args.lock.name}'s pins: {', '.join(names)}")
            added = site_paths(args.target)
            if added:  # e.g. the CUTLASS DSL: `import cutlass` fails with the target on PYTHONPATH alone
                print(f"{args.target}'s .pth files add {':'.join(added)} to sys.path, and a PYTHONPATH entry's .pth "
                      f"files are not read: use PYTHONPATH={pythonpath(args.target)}")
        if args.check:
            recorded, problems = check(args.lock, args.target, tuple(args.also))
            width = max(map(len, recorded))
            print(f"{'package':<{width}}  version")
            for name, version in recorded.items():
                print(f"{name:<{width}}  {version}")
            if args.json:
                atomic_write_text(args.json, json.dumps({"lock": args.lock.name, "versions": recorded}, indent=1) + "\n")
            optional = {canonicalize_name(n) for n in args.optional}
            for line in (x for x in problems if x.split(":")[0] in optional):
                print(f"WARNING: optional, not at the lock's pin: {line}", file=sys.stderr)
            problems = [x for x in problems if x.split(":")[0] not in optional]
            if problems:
                for line in problems:
                    print(f"not at the lock's pin: {line}", file=sys.stderr)
                return 1
            print(f"kernel set at {args.lock.name}'s pins: ok")
        return 0
    except LaunchError as exc:
        print(f"install_kernels: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a file that vanished or cannot be written between the checks and the work
        print(f"install_kernels: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
