"""Entrypoints for launcher tests: tiny stand-ins for the trainers' main(argv)."""

from __future__ import annotations

import argparse
import os
import time


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--mode", default="ok", choices=["ok", "raise", "exit3"])
    p.add_argument("--sleep", type=float, default=0)
    args = p.parse_args(argv)
    for var in ("SLURM_JOB_ID", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS", "TRITON_CACHE_DIR", "LAUNCH_JOB_DIR"):
        print(f"{var}={os.environ.get(var, '')}", flush=True)
    time.sleep(args.sleep)
    if args.mode == "raise":
        raise ValueError("fixture failure: shard 7 is corrupt")
    if args.mode == "exit3":
        return 3
    print("fixture done", flush=True)
    return 0
