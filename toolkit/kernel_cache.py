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

The archive holds ``triton/``, ``tilelang/``, ``inductor/`` and ``cute_dsl/`` (the CUTLASS DSL's, when a
run compiled CuTe kernels: ``--loss-impl liger-sm90``) trees. On a node, :func:`unpack`
extracts it ONCE into ``<node_root>/<key>/`` (read-only: files 0444, directories 0555), under an
exclusive file lock, into a temporary directory renamed into place when complete: 8 ranks starting
together share one extraction, and a rank killed mid-way leaves no half tree behind. Each job's
(writable, per-job) cache directories are then seeded with hard links to the read-only files
(a copy across file systems), under the same lock, once per directory (a marker file): the
compilers find every baked kernel and can still add new ones beside them.

The key's GPU fields read ``cpu`` on a machine without a CUDA device.

torch's own cache artifacts ride in the same archive: at the end of a bake the baking process's
``torch.compiler.save_cache_artifacts()`` (Inductor's FX graphs, AOTAutograd's forward/backward
graphs, autotuning results, dynamic-shape profiles: everything this process compiled or loaded)
is written under the Inductor cache as ``torch-artifacts/<sha256>.bin`` (:func:`save_torch_artifacts`),
and a job's trainer loads every such file of its seeded cache before it compiles
(:func:`load_torch_artifacts`), so AOTAutograd and Inductor hit their caches instead of running
again. Each bake adds its own file (named by content): an archive baked for several presets
carries each one's artifacts.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from toolkit.fsutil import atomic_write_bytes, atomic_write_text

# The caches an archive holds: name -> the variable that points the compiler at its directory.
# cute_dsl: the CUTLASS DSL's (liger-sm90's CuTe kernels), whose default is a shared /tmp/<user>/ path.
CACHES = {"triton": "TRITON_CACHE_DIR", "tilelang": "TILELANG_CACHE_DIR", "inductor": "TORCHINDUCTOR_CACHE_DIR",
          "cute_dsl": "CUTE_DSL_CACHE_DIR"}
# Packages whose version changes the kernels they generate (or load): part of the key.
KERNEL_PACKAGES = ("torch", "triton", "tilelang", "flash-linear-attention", "fla-core", "flash-qla", "causal-conv1d",
                   "cut-cross-entropy", "liger-kernel", "apache-tvm-ffi")
READONLY_FILE, READONLY_DIR = 0o444, 0o555
SEEDED_MARKER = ".kernel-archive-{key}"
ARCHIVE_KEY = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")  # a file name in the store, nothing more


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
    tmp = Path(env.get("TMPDIR") or tempfile.gettempdir())
    defaults = {"triton": home / ".triton" / "cache", "tilelang": home / ".tilelang" / "cache",
                "inductor": Path(tempfile.gettempdir()) / f"torchinductor_{user}",
                "cute_dsl": tmp / user / "cutlass_python_cache"}
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


# ------------------------------------------------------------------------- torch's cache artifacts

TORCH_ARTIFACTS = "torch-artifacts"
BAKE_VAR = "LAUNCH_KERNEL_BAKE"  # set in a bake job (launch kernels bake): its trainer saves the artifacts  # under the inductor cache: files <sha256 prefix>.bin


def torch_artifacts_dir(dirs: Mapping[str, Path]) -> Path:
    return Path(dirs["inductor"]) / TORCH_ARTIFACTS


def save_torch_artifacts(dirs: Mapping[str, Path]) -> Path | None:
    """This process's torch cache artifacts, written atomically under the inductor cache (the
    archive then carries them); None when torch was not imported or compiled nothing."""
    if "torch" not in sys.modules:
        return None
    import torch

    save = getattr(torch.compiler, "save_cache_artifacts", None)
    result = save() if save is not None else None
    if not result:
        return None
    data = result[0]
    path = torch_artifacts_dir(dirs) / f"{hashlib.sha256(data).hexdigest()[:32]}.bin"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        atomic_write_bytes(path, data)
    return path


def load_torch_artifacts(dirs: Mapping[str, Path]) -> dict[str, int]:
    """Load every torch cache artifact file of the inductor cache into this process's caches,
    before anything compiles; counts per artifact kind plus ``files`` (empty: none there). A file
    that is not this user's, or that torch refuses, is skipped and counted in ``skipped``: it is
    deserialized by torch, so only files of the user's own archive are read."""
    root = torch_artifacts_dir(dirs)
    if not root.is_dir():
        return {}
    import torch

    load = getattr(torch.compiler, "load_cache_artifacts", None)
    counts: dict[str, int] = {"files": 0}
    for path in sorted(root.glob("*.bin")):
        try:
            check_owned(path, "torch cache artifact")
            info = load(path.read_bytes()) if load is not None else None
        except Exception:  # noqa: BLE001 - an unusable file means compiles, never a failed job
            counts["skipped"] = counts.get("skipped", 0) + 1
            continue
        counts["files"] += 1
        for kind, keys in (getattr(info, "artifacts", None) or {}).items():
            name = getattr(kind, "value", None) or str(kind)
            counts[name] = counts.get(name, 0) + len(keys)
    return counts


def torch_cache_hits() -> dict[str, int]:
    """This process's Inductor FX-graph and AOTAutograd cache hits and misses so far."""
    if "torch._dynamo" not in sys.modules:
        return {}
    from torch._dynamo.utils import counters

    return {"fxgraph_hit": int(counters["inductor"].get("fxgraph_cache_hit", 0)),
            "fxgraph_miss": int(counters["inductor"].get("fxgraph_cache_miss", 0)),
            "aot_autograd_hit": int(counters["aot_autograd"].get("autograd_cache_hit", 0)),
            "aot_autograd_miss": int(counters["aot_autograd"].get("autograd_cache_miss", 0))}


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
    check_store(store, create=True)
    key = archive_key(fields)
    fd, tmp_name = tempfile.mkstemp(dir=store, prefix=f".{key}.", suffix=".tmp")
    tmp = Path(tmp_name)
    counts, unpacked = {}, 0
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
                            unpacked += info.size
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
                "bytes": archive.stat().st_size, "unpacked": unpacked, "files": counts, "note": note, "created": time.time()}
    atomic_write_text(store / f"{key}.json", json.dumps(manifest, indent=1) + "\n")
    return manifest


def check_store(store: Path, create: bool = False) -> None:
    """The archive store is a directory of ours (or root's) that others cannot write (group
    members may: a team's shared store); made when ``create``. ArchiveError, one line, otherwise."""
    if store.exists() and not store.is_dir():
        raise ArchiveError(f"kernel archive store {store} exists and is not a directory; "
                           "set LAUNCH_KERNEL_ARCHIVES to a directory")
    if create:
        try:
            store.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ArchiveError(f"kernel archive store {store} cannot be made ({exc.strerror or exc})") from None
    check_owned(store, "kernel archive store", writable_mask=0o002)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


MANIFEST_MAX_BYTES = 1 << 20
ARCHIVE_NAME = re.compile(r"[0-9a-f]{64}\.tar\.gz")
HEX64 = re.compile(r"[0-9a-f]{64}")
# Without the manifest's `unpacked` (archives baked before it was recorded): at most this many
# times the archive's size (compiler caches compress a few times, not a thousand).
UNPACKED_RATIO = 100


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def check_owned(path: Path, what: str, writable_mask: int = 0o002) -> None:
    """``path`` (lstat: a symlink is not followed) is ours or root's and not writable by others:
    another local user's manifest, archive or tree would be unpacked into the job's compiler
    caches (their code, compiled into the job). ArchiveError, one line, otherwise."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ArchiveError(f"{what} {path} cannot be read ({exc.strerror or exc})") from None
    if stat.S_ISLNK(st.st_mode):
        raise ArchiveError(f"{what} {path} is a symbolic link; it is not followed (another user may have put it there)")
    if st.st_uid not in (os.geteuid(), 0):
        raise ArchiveError(f"{what} {path} belongs to uid {st.st_uid}, another user; its kernels would run as you")
    if st.st_mode & writable_mask and not (stat.S_ISDIR(st.st_mode) and st.st_mode & stat.S_ISVTX and st.st_uid == 0):
        raise ArchiveError(f"{what} {path} is writable by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                           "another user could put their kernels in it")


def read_manifest(path: Path) -> dict[str, Any]:
    """One manifest, checked: a regular file of ours (never a FIFO or a device: opened without
    blocking, then fstat), bounded, each field of its type. ArchiveError (one line) otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise ArchiveError(f"kernel archive manifest {path} cannot be read ({exc.strerror or exc})") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ArchiveError(f"kernel archive manifest {path} is not a regular file")
        if st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o002:
            raise ArchiveError(f"kernel archive manifest {path} belongs to uid {st.st_uid} or is writable by others "
                               f"(mode {stat.S_IMODE(st.st_mode):o}); not used")
        raw = f.read(MANIFEST_MAX_BYTES + 1)
    if len(raw) > MANIFEST_MAX_BYTES:
        raise ArchiveError(f"kernel archive manifest {path} is larger than {MANIFEST_MAX_BYTES} bytes")
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ArchiveError(f"kernel archive manifest {path} is not JSON ({str(exc).splitlines()[0][:120]})") from None
    problem = manifest_problem(data)
    if problem:
        raise ArchiveError(f"kernel archive manifest {path}: {problem}")
    return data


def manifest_problem(data: object) -> str | None:
    """Why a parsed manifest cannot be used, or None."""
    if not isinstance(data, dict):
        return f"an object is expected, found {type(data).__name__}"
    if not isinstance(data.get("key"), str):
        return "'key' is not a string"
    if not isinstance(data.get("archive"), str) or not ARCHIVE_NAME.fullmatch(data["archive"]):
        return f"'archive' is not '<sha256>.tar.gz' (found {data.get('archive')!r:.80})"
    if not isinstance(data.get("sha256"), str) or not HEX64.fullmatch(data["sha256"]):
        return "'sha256' is not 64 hex digits"
    files = data.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(k, str) and _is_count(v) for k, v in files.items()):
        return f"'files' is not a mapping of cache name to a file count (found {type(files).__name__})"
    for field in ("bytes", "unpacked"):
        if field in data and not _is_count(data[field]):
            return f"'{field}' is not a byte count (found {data[field]!r:.40})"
    created = data.get("created", 0)
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not 0 <= created < 1e11:
        return f"'created' is not a time in seconds (found {created!r:.40})"
    if not isinstance(data.get("note", ""), str):
        return "'note' is not a string"
    return None


def manifests(store: Path) -> list[dict[str, Any]]:
    """Every usable manifest in ``store``, newest first (:func:`manifests_and_problems`)."""
    return manifests_and_problems(store)[0]


def manifests_and_problems(store: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """(usable manifests, newest first; one line per manifest that cannot be used)."""
    out, problems = [], []
    for path in sorted(store.glob("*.json")) if store.is_dir() else []:
        try:
            out.append(read_manifest(path))
        except FileNotFoundError:
            continue
        except ArchiveError as exc:
            problems.append(str(exc))
    return sorted(out, key=lambda m: -float(m.get("created") or 0)), problems


def find_manifest(store: Path, key: str) -> dict[str, Any] | None:
    """The manifest of ``key``; None without one; ArchiveError for one that cannot be used."""
    if not ARCHIVE_KEY.fullmatch(key):
        raise ArchiveError(f"kernel archive key {key!r} is not a file name")
    try:
        data = read_manifest(store / f"{key}.json")
    except FileNotFoundError:
        return None
    if data["key"] != key:
        raise ArchiveError(f"kernel archive manifest {store / f'{key}.json'} names key {data['key']!r:.80}, not {key}")
    return data


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
    # O_NOFOLLOW: a symlink another user planted at the lock's path is not followed (as root, the
    # O_CREAT would make the file it points to); the lock file itself is then checked as ours.
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise ArchiveError(f"kernel archive lock {path} cannot be opened ({exc.strerror or exc}; "
                           "a symbolic link there is not followed)") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (os.geteuid(), 0) or st.st_mode & 0o002:
            raise ArchiveError(f"kernel archive lock {path} is not a regular file of yours that only you can write; "
                               "remove it")
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when the fd closes, also when the process dies
        yield
    finally:
        os.close(fd)


def _extract(archive: Path, sha256: str, dest: Path, manifest: Mapping[str, Any] | None = None) -> int:
    """Verify and extract ``archive`` into the new directory ``dest``; the files extracted.

    Its members are counted and sized from the tar headers before anything is written: more
    files than the manifest says, or more bytes than it says were packed (or than the node's
    free space), is refused, so a small archive cannot fill the node's scratch (a tar bomb)."""
    try:
        if _sha256(archive) != sha256:
            raise ArchiveError(f"kernel archive {archive} does not match its manifest's sha256 (corrupt or replaced)")
    except OSError as exc:
        raise ArchiveError(f"kernel archive {archive} cannot be read ({exc.strerror or exc})") from None
    n = 0
    try:
        with tarfile.open(archive, mode="r:gz") as tar:
            members = [m for m in tar.getmembers() if m.isfile() or m.isdir()]
            _check_bounds(archive, members, manifest or {}, dest)
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


def _check_bounds(archive: Path, members: list[tarfile.TarInfo], manifest: Mapping[str, Any], dest: Path) -> None:
    files = [m for m in members if m.isfile()]
    want_files = sum((manifest.get("files") or {}).values())
    if len(files) > want_files:
        raise ArchiveError(f"kernel archive {archive} holds {len(files)} files, its manifest says {want_files}; "
                           "not unpacked")
    size = sum(m.size for m in files)
    limit = manifest.get("unpacked")
    if limit is None:
        limit = UNPACKED_RATIO * int(manifest.get("bytes") or archive.stat().st_size)
    if size > limit:
        raise ArchiveError(f"kernel archive {archive} unpacks to {size / 2**20:.1f} MiB, more than the "
                           f"{limit / 2**20:.1f} MiB its manifest allows; not unpacked")
    free = shutil.disk_usage(dest).free
    if size > free:
        raise ArchiveError(f"kernel archive {archive} unpacks to {size / 2**20:.1f} MiB, more than the "
                           f"{free / 2**20:.1f} MiB free under {dest.parent}; not unpacked")


def _seed(tree: Path, dirs: Mapping[str, Path], key: str, sha256: str = "") -> dict[str, int]:
    """Hard-link (else copy) every file of ``tree/<cache>`` into that cache's directory, once per
    archive (the marker holds its sha256: a re-bake under the same key is seeded again)."""
    seeded = {}
    for name, target in dirs.items():
        marker = Path(target) / SEEDED_MARKER.format(key=key)
        source = tree / name
        if not source.is_dir() or _first_line(marker) in (sha256, key):
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
        atomic_write_text(marker, (sha256 or key) + "\n")
        seeded[name] = n
    return seeded


def _first_line(path: Path) -> str | None:
    """The first line of a small regular file, None when it is not one (never blocks on a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return f.read(4096).decode("utf-8", "replace").strip().split("\n")[0]


def unpack(store: Path, key: str, node_root: Path, dirs: Mapping[str, Path]) -> Unpacked:
    """The archive of ``key`` from ``store``, extracted once per node into ``node_root/<key>``
    and linked into the caches ``dirs``; safe with many processes at once (module docstring).

    The store, the node root, its lock and its tree are checked as the job's user's (or root's)
    and not writable by others before each is used; a tree extracted from another archive than
    the store's manifest names now (a re-bake under the same key) is replaced."""
    check_store(store)
    manifest = find_manifest(store, key)
    if manifest is None:
        return Unpacked(key, "absent", None, {}, 0)
    check_owned(store / manifest["archive"], "kernel archive")
    try:
        node_root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ArchiveError(f"kernel archive node root {node_root} cannot be made ({exc.strerror or exc})") from None
    check_owned(node_root, "kernel archive node root")
    if not node_root.is_dir():
        raise ArchiveError(f"kernel archive node root {node_root} is not a directory")
    tree = node_root / key
    with _locked(node_root / f".{key}.lock"):
        check_owned(tree, "unpacked kernel archive")
        state = "present"
        if tree.exists() and _first_line(tree / ".complete") != manifest["sha256"]:
            if (tree / ".complete").exists() or (tree / ".complete").is_symlink():
                _rmtree(tree)  # extracted from another archive (a re-bake under this key): unpack this one
            else:  # a tree without its marker cannot be: renamed only when complete
                raise ArchiveError(f"{tree} exists without its .complete marker; remove it")
        if not tree.exists():
            tmp = Path(tempfile.mkdtemp(dir=node_root, prefix=f".{key}.tmp."))
            try:
                _extract(store / manifest["archive"], manifest["sha256"], tmp, manifest)
                (tmp / ".complete").write_text(manifest["sha256"] + "\n")
                os.chmod(tmp / ".complete", READONLY_FILE)
                os.chmod(tmp, READONLY_DIR)
                os.rename(tmp, tree)
            except BaseException:
                _rmtree(tmp)
                raise
            state = "unpacked"
        seeded = _seed(tree, dirs, key, manifest["sha256"])
    return Unpacked(key, state, tree, seeded, sum((manifest.get("files") or {}).values()))


def _rmtree(path: Path) -> None:
    """Remove a (possibly read-only) tree of ours."""
    if not path.exists():
        return
    for root, dirnames, _ in os.walk(path):
        for d in dirnames:
            os.chmod(os.path.join(root, d), 0o755)
    os.chmod(path, 0o755)
    shutil.rmtree(path, ignore_errors=True)
