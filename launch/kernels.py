"""`launch kernels bake | list`: kernel caches baked once per GPU architecture and versions.

    launch kernels bake --preset qwen35-2b     a one-node Slurm job of the stage-1 preset: its kernel
                                               warm-up and first steps compile every kernel variant
                                               the preset can select; at the end the main task packs
                                               the TileLang, Triton, Inductor and CUTLASS DSL caches into the
                                               archive store, under the node's key
    launch kernels bake --job dflash --preset offline --arg data=DIR
    launch kernels bake --job extract          the DFlash drafter's (3 steps) and the extraction's
                                               (2 shards) kernels, into the same store
    launch kernels list                        the store's archives, and this machine's key

How jobs use the archives: launch/kernel_archive.py and toolkit/kernel_cache.py.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys

from launch.errors import LaunchError
from launch.kernel_archive import BAKE_ARGS, BAKE_VAR, store_dir
from toolkit import kernel_cache


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", metavar="ACTION", parser_class=type(p))
    bake = sub.add_parser("bake", help="submit a one-node job that compiles a preset's kernels and packs them")
    bake.add_argument("--job", default="stage1", help="job spec whose preset is baked (default stage1)")
    bake.add_argument("--preset", help="the job's preset (default: the spec's default preset)")
    bake.add_argument("--partition")
    bake.add_argument("--constraint", help="nodes of the GPU kind to bake for")
    bake.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                      help="a job argument on top of the bake's own (e.g. data=DIR for dflash offline)")
    bake.add_argument("--dry-run", action="store_true", help="print the sbatch script; submit nothing")
    bake.add_argument("--follow", "-f", action="store_true", help="stream the job's log until it ends")
    lst = sub.add_parser("list", help="the archive store's archives, and this machine's key")
    lst.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    if args.action == "bake":
        return bake(args)
    if args.action == "list":
        return list_archives(args.json)
    raise LaunchError("an action is needed: bake or list (see `launch kernels --help`)")


def bake(args: argparse.Namespace) -> int:
    """`launch submit JOB --preset P --nodes 1` with the bake arguments and the bake variable."""
    from launch import submit
    from launch.cli import OneLineParser

    parser = OneLineParser(prog="launch kernels bake")
    submit.add_arguments(parser)
    preset = args.preset
    argv = [args.job, "--nodes", "1", "--name", "kernels-bake",
            "--env", f"{BAKE_VAR}={args.job}:{preset or 'default'}"]
    argv += ["--preset", preset] if preset else []
    for arg in (*BAKE_ARGS.get(args.job, ()), *args.arg):
        argv += ["--arg", arg]
    for flag in ("partition", "constraint"):
        if getattr(args, flag):
            argv += [f"--{flag}", getattr(args, flag)]
    argv += ["--dry-run"] if args.dry_run else []
    argv += ["--follow"] if args.follow else []
    sub_args = parser.parse_args(argv)
    sub_args.extra = []
    sub_args.verb = "kernels bake"
    try:  # before the job: a store that is a file, or another user's, would fail its end after all the work
        kernel_cache.check_store(store_dir())
    except kernel_cache.ArchiveError as exc:
        raise LaunchError(f"{exc}; nothing submitted") from None
    print(f"# kernel archive store: {store_dir()}", flush=True)
    return submit.run(sub_args)


def list_archives(as_json: bool) -> int:
    store = store_dir()
    try:
        here = kernel_cache.archive_key(kernel_cache.key_fields())
    except Exception as exc:  # noqa: BLE001
        here = f"unknown ({type(exc).__name__})"
    try:
        kernel_cache.check_store(store)
    except kernel_cache.ArchiveError as exc:
        raise LaunchError(str(exc)) from None
    found, problems = kernel_cache.manifests_and_problems(store)
    if as_json:
        print(json.dumps({"store": str(store), "this_machine": here, "archives": found, "problems": problems}))
        return 1 if problems else 0
    print(f"store: {store}")
    print(f"this machine's key: {here}" + ("" if any(m["key"] == here for m in found) else " (no archive)"))
    for m in found:
        when = datetime.datetime.fromtimestamp(float(m.get("created") or 0), datetime.timezone.utc)
        files = sum((m.get("files") or {}).values())
        mark = "*" if m["key"] == here else " "
        print(f"{mark} {m['key']}  {when:%Y-%m-%d %H:%M}Z  {m.get('bytes', 0) / 2**20:8.1f} MiB  {files:6d} files  "
              f"{m.get('note', '')}")
    if not found:
        print("no archives (bake one: launch kernels bake --preset P)")
    for problem in problems:  # a manifest no job would use: named, and the exit status says so
        print(f"launch kernels list: {problem}; jobs compile without it", file=sys.stderr)
    return 1 if problems else 0
