"""`make wheelhouse flavour=cpu|gpu`: the image's Python packages as a local wheel directory.

The flavour's lock (every distribution pinned to one file by its sha256) is resolved on the
controller, with the controller's own pip configuration and trust settings (its index, its
find-links, its CA bundle): `pip download --only-binary=:all: --no-deps --require-hashes` for
the image's Python and platform tags, and `pip wheel` for the few pure-Python sdists the image
definition names (`wheelhouse.build`). The result, `build/wheelhouse/<flavour>/`:

    *.whl              one wheel per locked distribution, plus optional ones (causal-conv1d)
    requirements.txt   name==version of every wheel there: what gets installed
    SHA256SUMS         sha256 of every file above (`sha256sum -c` format), sorted by name

Installs then need no index: `pip install --no-index --find-links DIR -r DIR/requirements.txt`
(the image build bind-mounts DIR read-only into its chroot; the python_env role takes it as
`python_env_wheelhouse`). A re-run with an unchanged lock and unchanged files runs no pip.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename

from launch.errors import LaunchError
from toolkit import pyexec
from toolkit.fsutil import atomic_write_text, sha256_file

REPO = Path(__file__).resolve().parents[1]
SUMS = "SHA256SUMS"
REQUIREMENTS = "requirements.txt"
STAMP = ".stamp.json"  # size and mtime of every file when SHA256SUMS was written: no re-hash on a no-op
# Wheels built here from sdists get fixed zip timestamps, so rebuilding one gives the same bytes.
BUILT_WHEEL_EPOCH = "315532800"  # 1980-01-01, the earliest a zip entry can carry


# The trainers' GPU fast path: every package of it is pinned in each GPU lock (one per target
# Python), so a provisioned node gets exactly what the benchmarks measured. fla's kernels (GDN,
# its Triton causal conv with cu_seqlens); FlashQLA's fused TileLang GDN (fla takes it by itself
# on Hopper and Blackwell) with tilelang's runtime needs (libz3 comes from z3-solver); the fused
# cross-entropy kernel (no materialized logits over a 273k vocab). causal-conv1d is source-only
# (needs nvcc), so a lock holds it only where a wheel was built: it is not in this set.
KERNEL_PACKAGES: tuple[str, ...] = (
    "fla-core", "flash-linear-attention", "flash-qla", "tilelang", "apache-tvm-ffi",
    "torch-c-dlpack-ext", "z3-solver", "ml-dtypes", "cut-cross-entropy",
    # liger-sm90's loss (train/common/liger_sm90.py): Liger and the CUTLASS DSL its Hopper kernel is in
    "liger-kernel", "nvidia-cutlass-dsl", "nvidia-cutlass-dsl-libs-base", "nvidia-cutlass-dsl-libs-core",
    "nvidia-cutlass-dsl-libs-cu12", "protobuf",
)
GPU_LOCKS: dict[str, str] = {  # target Python -> the GPU lock that pins its files
    "3.11": "images/trainer/requirements-gpu.lock",
    "3.12": "images/trainer/requirements-gpu-cp312.lock",
}


def kernel_pins(lock: Path) -> list[Pin]:
    """The lock's pins of KERNEL_PACKAGES; a lock without one of them is an error naming it."""
    pins = {p.name: p for p in read_lock(lock)}
    missing = [name for name in KERNEL_PACKAGES if name not in pins]
    if missing:
        raise LaunchError(f"{lock}: no pin for {', '.join(missing)} (the GPU fast path's kernel packages)")
    return [pins[name] for name in KERNEL_PACKAGES]


@dataclass(frozen=True)
class Target:
    """The image's interpreter and C library: the wheel tags its venv can load."""

    python: str = "3.11"
    glibc: str = "2.36"
    arch: str = "x86_64"

    def platforms(self) -> list[str]:
        minor = int(self.glibc.split(".")[1])
        many = [f"manylinux_2_{m}_{self.arch}" for m in range(minor, 4, -1)]
        legacy = [f"manylinux{tag}_{self.arch}" for tag in ("2014", "2010", "1")]
        return [*many, *legacy, f"linux_{self.arch}"]

    def pip_args(self) -> list[str]:
        args = ["--python-version", self.python, "--implementation", "cp",
                "--abi", "cp" + self.python.replace(".", "")]
        for platform in self.platforms():
            args += ["--platform", platform]
        return args

    def tags(self) -> set[Tag]:
        version = tuple(int(p) for p in self.python.split("."))
        platforms = self.platforms()
        return set(cpython_tags(version, platforms=platforms)) | set(compatible_tags(version, "cp" + self.python.replace(".", ""), platforms))


@dataclass(frozen=True)
class Pin:
    name: str  # canonical
    version: str
    hashes: tuple[str, ...]
    line: str  # the requirement as pip takes it: name==version --hash=sha256:...


@dataclass(frozen=True)
class WheelhouseSpec:
    """`wheelhouse:` of an image flavour: sdists to build into wheels, optional packages."""

    target: Target = field(default_factory=Target)
    build: tuple[str, ...] = ()     # pure-Python sdists, built with `pip wheel` on the controller
    optional: tuple[str, ...] = ()  # installed when a wheel for them is in the wheelhouse (added with --add)


def read_lock(path: Path) -> list[Pin]:
    """name==version pins, each with optional --hash=sha256:... options; one-line errors."""
    pins: list[Pin] = []
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        text = raw.split("#", 1)[0].strip()
        if not text:
            continue
        words = text.split()
        hashes = tuple(w.split("sha256:", 1)[1] for w in words[1:] if w.startswith("--hash=sha256:"))
        if len(hashes) != len(words) - 1:
            raise LaunchError(f"{path}:{number}: only --hash=sha256:... may follow a pin: {raw.strip()}")
        try:
            req = Requirement(words[0])
        except InvalidRequirement as exc:
            raise LaunchError(f"{path}:{number}: {exc}") from None
        spec = list(req.specifier)
        if len(spec) != 1 or spec[0].operator != "==" or "*" in spec[0].version:
            raise LaunchError(f"{path}:{number}: a lock pins one exact version (name==version): {words[0]}")
        pins.append(Pin(canonicalize_name(req.name), spec[0].version, hashes, text))
    if not pins:
        raise LaunchError(f"{path}: no pins")
    return pins


def wheel_identity(name: str) -> tuple[str, str, frozenset[Tag]]:
    dist, version, _build, tags = parse_wheel_filename(name)
    return canonicalize_name(dist), str(version), frozenset(tags)


def _wheels(directory: Path) -> dict[str, Path]:
    return {p.name: p for p in sorted(directory.glob("*.whl"))}


def _stamp(directory: Path, names: list[str]) -> dict[str, list[int]]:
    return {n: [(directory / n).stat().st_size, (directory / n).stat().st_mtime_ns] for n in names}


def read_sums(directory: Path) -> dict[str, str]:
    """SHA256SUMS as {file: sha256}; a missing or malformed one is an error naming the fix."""
    path = directory / SUMS
    if not path.is_file():
        raise LaunchError(f"no wheelhouse at {directory} ({SUMS} missing); run `make wheelhouse` for this flavour")
    sums = {}
    for line in path.read_text().splitlines():
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64:
            raise LaunchError(f"{path}: malformed line {line!r}; run `make wheelhouse` again")
        sums[name] = digest
    return sums


def verify(directory: Path) -> dict[str, str]:
    """Check every file named in SHA256SUMS against its sha256, and that no wheel is unlisted."""
    sums = read_sums(directory)
    unlisted = sorted(set(_wheels(directory)) - set(sums))
    if unlisted:
        raise LaunchError(f"{directory}: {unlisted[0]} is not in {SUMS}; run `make wheelhouse` again")
    for name, digest in sums.items():
        path = directory / name
        if not path.is_file():
            raise LaunchError(f"{directory}: {name} is listed in {SUMS} but missing; run `make wheelhouse` again")
        if sha256_file(path) != digest:
            raise LaunchError(f"{directory}: {name} does not match its sha256 in {SUMS}; run `make wheelhouse` again")
    return sums


def sums_digest(directory: Path) -> str:
    """The wheelhouse's identity: the sha256 of its SHA256SUMS (an input of the image hash)."""
    read_sums(directory)
    return sha256_file(directory / SUMS)


def _pip(argv: list[str], env: dict[str, str] | None = None) -> None:
    # The controller's pip with its own configuration: that is where the index, the local wheel
    # directories and the CA bundle this network needs are set.
    proc = subprocess.run([*pyexec.python(), "-m", "pip", *argv], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        errors = [line for line in (proc.stderr + proc.stdout).splitlines() if line.startswith("ERROR")]
        raise LaunchError(f"pip {argv[0]} failed: {(errors or ['exit ' + str(proc.returncode)])[0]}")


def build_wheelhouse(lock: Path, spec: WheelhouseSpec, dest: Path, add: Path | None = None,
                     log=print) -> dict[str, str]:
    """Bring `dest` to exactly the lock's wheels (plus optional ones); returns SHA256SUMS as a dict."""
    pins = read_lock(lock)
    locked = {p.name: p for p in pins}
    unknown = sorted(set(spec.build) - set(locked))
    if unknown:
        raise LaunchError(f"wheelhouse.build names {unknown[0]}, which {lock.name} does not pin")
    optional = {canonicalize_name(n) for n in spec.optional}
    dest.mkdir(parents=True, exist_ok=True)
    if add is None and up_to_date(dest, lock):
        return read_sums(dest)
    tags = spec.target.tags()

    if add is not None:
        for path in sorted(Path(add).glob("*.whl")):
            name, _version, wheel_tags = wheel_identity(path.name)
            if name not in optional:
                raise LaunchError(f"--add {path.name}: {name} is not an optional package of this flavour "
                                  f"({', '.join(sorted(optional)) or 'none'})")
            if not wheel_tags & tags:
                raise LaunchError(f"--add {path.name}: not installable on the image (Python {spec.target.python}, "
                                  f"glibc {spec.target.glibc}, {spec.target.arch})")
            for old in _wheels(dest).values():
                if wheel_identity(old.name)[0] == name and old.name != path.name:
                    old.unlink()
            shutil.copy2(path, dest / path.name)
            log(f"added {path.name}")

    # What is there already: keep a wheel of a locked name==version (whose hash matches, when
    # the lock pins the wheel's own hash), and optional wheels; remove everything else.
    have: dict[str, str] = {}
    for file, path in _wheels(dest).items():
        try:
            name, version, wheel_tags = wheel_identity(file)
        except InvalidWheelFilename:
            path.unlink()
            continue
        pin = locked.get(name)
        keep = name in optional and name not in locked
        if pin is not None and pin.version == version and name not in have:
            keep = name in spec.build or not pin.hashes or sha256_file(path) in pin.hashes
        if not keep or not wheel_tags & tags:
            log(f"removing {file} (not in {lock.name})")
            path.unlink()
            continue
        have[name] = file

    missing = [p for p in pins if p.name not in have]
    fetch = [p for p in missing if p.name not in spec.build]
    build = [p for p in missing if p.name in spec.build]
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=dest.parent) as tmp:
        tmp_dir = Path(tmp)
        if fetch:
            log(f"pip download: {len(fetch)} wheels for Python {spec.target.python} on glibc {spec.target.glibc} {spec.target.arch}")
            reqs = tmp_dir / "fetch.txt"
            reqs.write_text("".join(p.line + "\n" for p in fetch))
            _pip(["download", "--no-deps", "--only-binary=:all:", "--progress-bar=off", "-q", *spec.target.pip_args(),
                  "-d", str(tmp_dir / "wheels"), "-r", str(reqs)])
        if build:
            log(f"pip wheel: {', '.join(p.name for p in build)} (sdists built into wheels here)")
            reqs = tmp_dir / "build.txt"
            reqs.write_text("".join(p.line + "\n" for p in build))
            _pip(["wheel", "--no-deps", "--progress-bar=off", "-q", "-w", str(tmp_dir / "wheels"), "-r", str(reqs)],
                 env={"SOURCE_DATE_EPOCH": BUILT_WHEEL_EPOCH})
        for path in sorted((tmp_dir / "wheels").glob("*.whl")) if (tmp_dir / "wheels").is_dir() else []:
            name, version, wheel_tags = wheel_identity(path.name)
            if name not in locked or locked[name].version != version:
                raise LaunchError(f"pip returned {path.name}, which {lock.name} does not pin")
            if not wheel_tags & tags:
                raise LaunchError(f"{path.name} does not install on the image (Python {spec.target.python}, "
                                  f"glibc {spec.target.glibc}): build it with the image's Python")
            os.replace(path, dest / path.name)
            have[name] = path.name
    absent = sorted(p.name for p in pins if p.name not in have)
    if absent:
        raise LaunchError(f"no wheel for {absent[0]} after pip ran; check {lock}")
    return write_sums(dest, lock)


def write_sums(dest: Path, lock: Path) -> dict[str, str]:
    """requirements.txt and SHA256SUMS for the wheels in `dest` (hashes reused when unchanged)."""
    wheels = _wheels(dest)
    requirements = "".join(f"{n}=={v}\n" for n, v, _ in sorted(wheel_identity(f) for f in wheels))
    current = (dest / REQUIREMENTS).read_text() if (dest / REQUIREMENTS).is_file() else None
    if current != requirements:
        atomic_write_text(dest / REQUIREMENTS, requirements)
    names = sorted([*wheels, REQUIREMENTS])
    stamp = {"lock": sha256_file(lock), "files": _stamp(dest, names)}
    try:
        old_stamp = json.loads((dest / STAMP).read_text())
        old_sums = read_sums(dest)
    except (FileNotFoundError, json.JSONDecodeError, LaunchError):
        old_stamp, old_sums = {}, {}
    unchanged = {n for n in names if old_stamp.get("files", {}).get(n) == stamp["files"][n] and n in old_sums}
    sums = {n: old_sums[n] if n in unchanged else sha256_file(dest / n) for n in names}
    text = "".join(f"{sums[n]}  {n}\n" for n in names)
    if not (dest / SUMS).is_file() or (dest / SUMS).read_text() != text:
        atomic_write_text(dest / SUMS, text)
    atomic_write_text(dest / STAMP, json.dumps(stamp, sort_keys=True) + "\n")
    return sums


def up_to_date(dest: Path, lock: Path) -> bool:
    """SHA256SUMS was written for this lock and no file changed since (by size and mtime)."""
    try:
        stamp = json.loads((dest / STAMP).read_text())
        sums = read_sums(dest)
    except (FileNotFoundError, json.JSONDecodeError, LaunchError):
        return False
    names = sorted([*_wheels(dest), REQUIREMENTS])
    if set(sums) != set(names) or stamp.get("lock") != sha256_file(lock):
        return False
    try:
        return stamp.get("files") == _stamp(dest, names)
    except FileNotFoundError:
        return False


def default_dir(flavour: str) -> Path:
    return REPO / "build" / "wheelhouse" / flavour
