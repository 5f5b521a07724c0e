"""Baked kernel caches, the launcher's side at a job's start and end (`launch kernels` is the CLI).

Every job started by `launch` unpacks the archive of its node's key at start (once per node, under
a file lock; toolkit/kernel_cache.py) and seeds the job's node-local caches with it; a key without
an archive is said in the job's log and header, and by `launch doctor` (check cache.kernel_archive).
The store is $LAUNCH_KERNEL_ARCHIVES (default $LAUNCH_HOME/kernels): a directory every node reads.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from launch.fsutil import launch_home
from toolkit import kernel_cache

STORE_VAR = "LAUNCH_KERNEL_ARCHIVES"
BAKE_VAR = kernel_cache.BAKE_VAR  # set in a bake job: its main task packs the caches at the end
STATUS_VAR = "LAUNCH_KERNEL_ARCHIVE"  # what the job's start found, for the trainer's header
# What a bake job runs, per job spec: a few steps (every kernel a step selects compiles), nothing
# else (no checkpoint, no export). A spec not named here is baked with its own arguments.
BAKE_ARGS: dict[str, tuple[str, ...]] = {
    "stage1": ("steps=3", "ckpt_every=0", "export=off"),
    "dflash": ("steps=3",),
    "extract": ("stop_after=2",),  # two shards: the forward's kernels, the copy and write path
}


def store_dir(env: Mapping[str, str] | None = None) -> Path:
    env = os.environ if env is None else env
    value = env.get(STORE_VAR, "").strip()
    return Path(value).expanduser() if value else launch_home() / "kernels"


def node_root(env: Mapping[str, str] | None = None) -> Path:
    """Where a node keeps its unpacked archives: node-local scratch, per user, across jobs."""
    env = os.environ if env is None else env
    user = env.get("USER") or str(os.getuid())
    return Path(env.get("LAUNCH_NODE_SCRATCH") or "/tmp") / f"launch-kernels-{user}"


def install_for_job(env: Mapping[str, str] | None = None, log=print) -> str:
    """At a job's start (every task): unpack this node's archive and seed the job's caches. Never
    fatal: a missing or broken archive means compiles, which the job then does as it always did.
    Returns (and exports as $LAUNCH_KERNEL_ARCHIVE) one line: `<state> <key>: ...`."""
    env = os.environ if env is None else env
    store = store_dir(env)
    cpu_only, quiet = False, False  # a key without a GPU (no CUDA device on this node)
    try:
        fields = kernel_cache.key_fields()
        key = kernel_cache.archive_key(fields)
        cpu_only = fields["gpu_arch"] == "cpu"
    except Exception as exc:  # noqa: BLE001 - a key that cannot be read is a note, never a failed job
        line = f"error: the kernel archive key cannot be read ({type(exc).__name__}: {exc})"
    else:
        try:
            got = kernel_cache.unpack(store, key, node_root(env), kernel_cache.cache_dirs(env))
            line = f"{got.state} {got.line(store)}"
            quiet = cpu_only and got.state == "absent"
        except (kernel_cache.ArchiveError, OSError) as exc:
            line = f"error {key}: {exc}; the kernels compile as without an archive"
        except Exception as exc:  # noqa: BLE001 - never fatal (module docstring): a note, and compiles
            line = f"error {key}: {type(exc).__name__}: {exc}; the kernels compile as without an archive"
    os.environ[STATUS_VAR] = line
    # A CPU node's absent archive is the normal case (nothing GPU-specific to bake): the trainer's
    # header still says it; the job's log names the archive only where it matters.
    if not quiet:
        log(f"[launch] kernel archive: {line}")
    return line


def bake_at_end(env: Mapping[str, str] | None = None, log=print) -> Path:
    """The end of a bake job's main task: pack this job's caches under this node's key."""
    env = os.environ if env is None else env
    fields = kernel_cache.key_fields()
    # the trainer (this process) saved torch's artifacts already; a trainer that did not gets them here
    kernel_cache.save_torch_artifacts(kernel_cache.cache_dirs(env))
    manifest = kernel_cache.pack(store_dir(env), fields, kernel_cache.cache_dirs(env), note=env.get(BAKE_VAR, ""))
    path = store_dir(env) / manifest["archive"]
    log(f"[launch] kernel archive baked: {manifest['key']} -> {path} ({manifest['bytes'] / 2**20:.1f} MiB, "
        f"files {manifest['files']})")
    return path


def doctor_check(env: Mapping[str, str], gpus: list | None):  # -> CheckResult
    """cache.kernel_archive: is there an archive for this node's key? (doctor, CPU-cheap: the
    key's GPU fields from nvidia-smi, torch's CUDA from its version file, no torch import)."""
    from launch.doctor.driver_cuda import torch_cuda_version
    from launch.doctor.results import CheckResult, Status

    if gpus:
        major, minor = gpus[0].compute_cap or (0, 0)
        fields = kernel_cache.key_fields(gpu_arch=f"sm_{major}{minor}", driver=gpus[0].driver,
                                         cuda=torch_cuda_version() or "cpu")
    else:
        fields = kernel_cache.key_fields(gpu_arch="cpu", driver="cpu", cuda="cpu")
    key = kernel_cache.archive_key(fields)
    store = store_dir(env)
    try:
        kernel_cache.check_store(store)
        manifest = kernel_cache.find_manifest(store, key)
    except kernel_cache.ArchiveError as exc:
        return CheckResult("cache.kernel_archive", Status.WARN, f"{exc}; jobs compile their kernels",
                           "rebake (launch kernels bake --preset P) or remove the file")
    if manifest is None:
        return CheckResult("cache.kernel_archive", Status.WARN,
                           f"no baked kernel archive for this node's key {key} in {store}: the first job on each "
                           "node compiles its kernels before step 1",
                           "launch kernels bake --preset P (one job; then every job unpacks it at start)")
    return CheckResult("cache.kernel_archive", Status.PASS,
                       f"{key}: {store / manifest['archive']} ({int(manifest.get('bytes', 0)) / 2**20:.1f} MiB)")
