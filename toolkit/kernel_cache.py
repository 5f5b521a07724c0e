"""Baked kernel caches: the TileLang, Triton and Inductor caches of a run, packed once, unpacked on
every node, so a fresh node's first step compiles nothing.

Why: a fresh H200 spent about 10 minutes before stage-1's first step (219 s of TileLang compiles
in the kernel warm-up alone, Triton and Inductor compiles around it), and 8 ranks compiled at
once into one node-local cache. The compiled kernels depend only on the GPU architecture, the
driver and CUDA, and the versions of the packages that generate them, so they are baked once per
such KEY (``launch kernels bake``) and reused.

Layout
------
An archive store (a shared directory; ``launch`` uses ``$LAUNCH_KERNEL_ARCHIVES``, default
``$LAUNCH_HOME/kernels``) holds, per key::

    <key>.json            the manifest: key fields, the archive's sha256, file counts, preset, time
    <sha256>.tar.gz       the archive, named by its content (a re-bake of the same bytes is one file)

The archive holds ``triton/``, ``tilelang/`` and ``inductor/`` trees. On a node, :func:`unpack`
extracts it ONCE into ``<node_root>/<key>/`` (read-only: files 0444, directories 0555), under an
exclusive file lock, into a temporary directory renamed into place when complete: 8 ranks starting
together share one extraction, and a rank killed mid-way leaves no half tree behind. Each job's
(writable, per-job) cache directories are then seeded with hard links to the read-only files
(a copy across file systems), under the same lock, once per directory (a marker file): the
compilers find every baked kernel and can still add new ones beside them.

The key's GPU fields read ``cpu`` on a machine without a CUDA device.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.fsutil import atomic_write_text

# The caches an archive holds: name -> the variable that points the compiler at its directory.
CACHES = {"triton": "TRITON_CACHE_DIR", "tilelang": "TILELANG_CACHE_DIR", "inductor": "TORCHINDUCTOR_CACHE_DIR"}
# Packages whose version changes the kernels they generate (or load): part of the key.
KERNEL_PACKAGES = ("torch", "triton", "tilelang", "flash-linear-attention", "fla-core", "flash-qla", "causal-conv1d",
                   "cut-cross-entropy", "liger-kernel", "apache-tvm-ffi")
READONLY_FILE, READONLY_DIR = 0o444, 0o555
SEEDED_MARKER = ".kernel-archive-{key}"


class ArchiveError(RuntimeError):
    """A kernel archive that cannot be used (corrupt, unreadable); one line."""


def driver_version() -> str:
    """The NVIDIA kernel driver's version: ``/proc/driver/nvidia/version`` (as ``nvidia-smi``
    reports it), else ``nvidia-smi`` itself (a container may not see /proc/driver), else ``unknown``."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        text = ""
    for word in text.split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out[0] if out else "unknown"


def key_fields(gpu_arch: str | None = None, driver: str | None = None, cuda: str | None = None,
               packages: Mapping[str, str] | None = None) -> dict[str, Any]:
    """What the compiled kernels depend on. Unset fields are read from this machine: the first
    CUDA device's architecture (``sm_90``), the driver, torch's CUDA, the kernel packages'
    versions (``-`` when not installed); ``cpu`` for the GPU fields without a CUDA device."""
    if gpu_arch is None or cuda is None:
        import torch

        on_gpu = torch.cuda.is_available()
        if gpu_arch is None:
            gpu_arch = "sm_{}{}".format(*torch.cuda.get_device_capability(0)) if on_gpu else "cpu"
        if cuda is None:
            cuda = (torch.version.cuda or "cpu") if on_gpu else "cpu"
    if driver is None:
        driver = driver_version() if gpu_arch != "cpu" else "cpu"
    if packages is None:
        packages = {}
        for name in KERNEL_PACKAGES:
            try:
                packages[name] = importlib.metadata.version(name)
            except importlib.metadata.PackageNotFoundError:
                packages[name] = "-"
    return {"gpu_arch": gpu_arch, "driver": driver, "cuda": cuda,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}", "machine": platform.machine(),
            "packages": dict(sorted(packages.items()))}


def archive_key(fields: Mapping[str, Any]) -> str:
    """``<gpu_arch>-cuda<cuda>-<16 hex of the fields' hash>``: readable, and exact."""
    digest = hashlib.sha256(json.dumps(fields, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:16]
    cuda = fields["cuda"] if fields["cuda"] == "cpu" else f"cuda{fields['cuda']}"
    return f"{fields['gpu_arch']}-{cuda}-{digest}"


def cache_dirs(env: Mapping[str, str] | None = None) -> dict[str, Path]:
    """Each cache's directory as its compiler resolves it (the variable, else its default)."""
    env = os.environ if env is None else env
    home = Path(env.get("HOME") or Path.home())
    user = env.get("USER") or "user"
    defaults = {"triton": home / ".triton" / "cache", "tilelang": home / ".tilelang" / "cache",
                "inductor": Path(tempfile.gettempdir()) / f"torchinductor_{user}"}
    return {name: Path(env.get(var) or defaults[name]) for name, var in CACHES.items()}


def count_entries(dirs: Mapping[str, Path]) -> dict[str, int]:
    """Files under each cache directory: a compile adds some, a load adds none."""
    out = {}
    for name, root in dirs.items():
        n = 0
        for _, _, files in os.walk(root):
            n += sum(1 for f in files if not f.startswith(".kernel-archive-"))
        out[name] = n
    return out


# --------------------------------------------------------------------------------------------- pack


def _tar_filter(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    """Reproducible entries: no owner, one mtime; lock files and temporaries left out."""
    base = os.path.basename(info.name)
    if base.endswith(".lock") or base.startswith(".kernel-archive-") or ".tmp" in base:
        return None
    if not (info.isfile() or info.isdir()):
        return None  # links and devices: a cache holds regular files
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mtime = 0
    info.mode = 0o644 if info.isfile() else 0o755
    return info


def pack(store: Path, fields: Mapping[str, Any], dirs: Mapping[str, Path], note: str = "") -> dict[str, Any]:
    """Pack the caches in ``dirs`` into ``store`` under the key of ``fields``; the manifest.

    Entries are sorted and their metadata fixed, so the same caches give the same bytes (the
    archive's name is its sha256). The archive, then the manifest, are written atomically.
    """
    store.mkdir(parents=True, exist_ok=True)
    key = archive_key(fields)
    fd, tmp_name = tempfile.mkstemp(dir=store, prefix=f".{key}.", suffix=".tmp")
    tmp = Path(tmp_name)
    counts = {}
    try:
        with os.fdopen(fd, "wb") as raw:
            import gzip

            with gzip.GzipFile(fileobj=raw, mode="wb", mtime=0, compresslevel=6) as gz, \
                    tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:
                for name in sorted(dirs):
                    root = Path(dirs[name])
                    counts[name] = 0
                    top = tarfile.TarInfo(name)
                    top.type = tarfile.DIRTYPE
                    tar.addfile(_tar_filter(top))
                    if not root.is_dir():
                        continue
                    for path in sorted(root.rglob("*")):
                        rel = f"{name}/{path.relative_to(root).as_posix()}"
                        info = _tar_filter(tar.gettarinfo(str(path), rel))
                        if info is None:
                            continue
                        if info.isfile():
                            with open(path, "rb") as f:
                                tar.addfile(info, f)
                            counts[name] += 1
                        else:
                            tar.addfile(info)
            raw.flush()
            os.fsync(raw.fileno())
        digest = _sha256(tmp)
        archive = store / f"{digest}.tar.gz"
        os.replace(tmp, archive)
    finally:
        tmp.unlink(missing_ok=True)
    manifest = {"key": key, "fields": dict(fields), "archive": archive.name, "sha256": digest,
                "bytes": archive.stat().st_size, "files": counts, "note": note, "created": time.time()}
    atomic_write_text(store / f"{key}.json", json.dumps(manifest, indent=1) + "\n")
    return manifest


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def manifests(store: Path) -> list[dict[str, Any]]:
    """Every readable manifest in ``store``, newest first."""
    out = []
    for path in sorted(store.glob("*.json")) if store.is_dir() else []:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and {"key", "archive", "sha256"} <= set(data):
            out.append(data)
    return sorted(out, key=lambda m: -float(m.get("created") or 0))


def find_manifest(store: Path, key: str) -> dict[str, Any] | None:
    try:
        data = json.loads((store / f"{key}.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("key") == key else None


# ------------------------------------------------------------------------------------------- unpack


@dataclass(frozen=True)
class Unpacked:
    """What :func:`unpack` did: ``state`` is ``unpacked`` (this process extracted it), ``present``
    (an earlier or concurrent process had), or ``absent`` (no archive for the key)."""

    key: str
    state: str
    tree: Path | None
    seeded: dict[str, int]  # files linked into each cache directory by this process
    files: int  # files in the archive

    def line(self, store: Path) -> str:
        if self.state == "absent":
            return (f"{self.key}: no baked archive in {store}; the first step compiles the kernels "
                    "(bake one: launch kernels bake --preset P)")
        return f"{self.key}: {self.state} ({self.files} files) from {store}, seeded the job's caches"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when the fd closes, also when the process dies
        yield
    finally:
        os.close(fd)


def _extract(archive: Path, sha256: str, dest: Path) -> int:
    """Verify and extract ``archive`` into the new directory ``dest``; the files extracted."""
    try:
        if _sha256(archive) != sha256:
            raise ArchiveError(f"kernel archive {archive} does not match its manifest's sha256 (corrupt or replaced)")
    except OSError as exc:
        raise ArchiveError(f"kernel archive {archive} cannot be read ({exc.strerror or exc})") from None
    n = 0
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
            tar.extractall(dest, members=members, filter="data")  # no absolute paths, no `..`, no links
            n = sum(1 for m in members if m.isfile())
    except (tarfile.TarError, OSError, EOFError) as exc:
        raise ArchiveError(f"kernel archive {archive} cannot be extracted ({type(exc).__name__}: {exc})") from None
    for root, dirnames, files in os.walk(dest, topdown=False):
        for f in files:  # today's mtime (the archive's is 0): /tmp cleaners judge files by age
            os.utime(os.path.join(root, f))
            os.chmod(os.path.join(root, f), READONLY_FILE)
        for d in dirnames:
            os.chmod(os.path.join(root, d), READONLY_DIR)
    return n


def _seed(tree: Path, dirs: Mapping[str, Path], key: str) -> dict[str, int]:
    """Hard-link (else copy) every file of ``tree/<cache>`` into that cache's directory, once."""
    seeded = {}
    for name, target in dirs.items():
        marker = Path(target) / SEEDED_MARKER.format(key=key)
        source = tree / name
        if marker.exists() or not source.is_dir():
            continue
        n = 0
        for root, _, files in os.walk(source):
            out_dir = Path(target) / Path(root).relative_to(source)
            out_dir.mkdir(parents=True, exist_ok=True)
            for f in files:
                dst = out_dir / f
                if dst.exists():
                    continue  # the job's own (newer) entry wins
                try:
                    os.link(os.path.join(root, f), dst)
                except OSError:  # another file system, or links not allowed: a private copy
                    shutil.copy2(os.path.join(root, f), dst)
                n += 1
        atomic_write_text(marker, key + "\n")
        seeded[name] = n
    return seeded


def unpack(store: Path, key: str, node_root: Path, dirs: Mapping[str, Path]) -> Unpacked:
    """The archive of ``key`` from ``store``, extracted once per node into ``node_root/<key>``
    and linked into the caches ``dirs``; safe with many processes at once (module docstring)."""
    manifest = find_manifest(store, key)
    if manifest is None:
        return Unpacked(key, "absent", None, {}, 0)
    tree = node_root / key
    with _locked(node_root / f".{key}.lock"):
        state = "present"
        if not (tree / ".complete").exists():
            if tree.exists():  # a tree without its marker cannot be: renamed only when complete
                raise ArchiveError(f"{tree} exists without its .complete marker; remove it")
            tmp = Path(tempfile.mkdtemp(dir=node_root, prefix=f".{key}.tmp."))
            try:
                _extract(store / manifest["archive"], manifest["sha256"], tmp)
                (tmp / ".complete").write_text(manifest["sha256"] + "\n")
                os.chmod(tmp / ".complete", READONLY_FILE)
                os.chmod(tmp, READONLY_DIR)
                os.rename(tmp, tree)
            except BaseException:
                _rmtree(tmp)
                raise
            state = "unpacked"
        seeded = _seed(tree, dirs, key)
    return Unpacked(key, state, tree, seeded, sum(int(v) for v in (manifest.get("files") or {}).values()))


def _rmtree(path: Path) -> None:
    """Remove a (possibly read-only) tree of ours."""
    if not path.exists():
        return
    for root, dirnames, _ in os.walk(path):
        for d in dirnames:
            os.chmod(os.path.join(root, d), 0o755)
    os.chmod(path, 0o755)
    shutil.rmtree(path, ignore_errors=True)
