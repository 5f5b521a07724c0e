"""`launch buckets FILE` (or `--lengths FILE`): optimised bucket edges, their efficiency, sorted/random baselines.

A thin CLI over train.common.bucketing (numpy only; no torch import, so the CLI stays fast).
"""

from __future__ import annotations

import argparse

from launch.errors import LaunchError
from launch.values import int_range, nonneg_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?", metavar="FILE", help="sample lengths: one per line, or a .npy array")
    p.add_argument("--lengths", metavar="FILE", help="the same as FILE")
    p.add_argument("--buckets", type=int_range(1, 4096), default=None, help="number of buckets (default: fewest within 3 points "
                   "of sorted batching)")
    p.add_argument("--token-budget", type=int_range(1, 10**9), default=None, help="padded tokens per batch (default 8 x longest)")
    p.add_argument("--seed", type=nonneg_int, default=0)


def run(args: argparse.Namespace) -> int:
    from train.common.bucketing import main

    if args.file and args.lengths and args.file != args.lengths:
        raise LaunchError(f"two lengths files ({args.file}, --lengths {args.lengths}); give one")
    lengths = args.file or args.lengths
    if not lengths:
        raise LaunchError("no lengths file: `launch buckets FILE` (one length per line, or a .npy array)")
    argv = ["--lengths", lengths, "--seed", str(args.seed)]
    if args.buckets is not None:
        argv += ["--buckets", str(args.buckets)]
    if args.token_budget is not None:
        argv += ["--token-budget", str(args.token_budget)]
    return main(argv)
