"""Entrypoints for launcher tests: tiny stand-ins for the trainers' main(argv).

Like the trainers, it has a `parse_args(argv)` that `launch submit` runs before queueing, and
with --steps it appends step records to metrics.jsonl in the job directory, as they do.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path

from toolkit.outcome import write_outcome


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fixture_entry")
    p.add_argument("--mode", default="ok", choices=["ok", "raise", "exit3"])
    p.add_argument("--sleep", type=float, default=0)
    p.add_argument("--steps", type=int, default=0, help="metrics.jsonl step records to write, one per --step-s")
    p.add_argument("--step-s", type=float, default=0.2)
    p.add_argument("--own-outcome", action="store_true",
                   help="like the trainers' runtime: catch SIGTERM, write outcome.json, return 143")
    args = p.parse_args(argv)
    if args.sleep < 0:
        raise ValueError(f"--sleep must be >= 0, got {args.sleep}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    task = os.environ.get("SLURM_PROCID", "0")
    for var in ("SLURM_JOB_ID", "CUDA_VISIBLE_DEVICES", "SLURM_JOB_GPUS", "TRITON_CACHE_DIR", "LAUNCH_JOB_DIR", "PROBE"):
        print(f"{var}={os.environ.get(var, '')}", flush=True)
    print(f"fixture task {task} of {os.environ.get('SLURM_NTASKS', '1')}", flush=True)
    job_dir = Path(os.environ.get("LAUNCH_JOB_DIR", "."))
    metrics = job_dir / "metrics.jsonl"
    stop: list[int] = []
    if args.own_outcome:
        signal.signal(signal.SIGTERM, lambda signum, _frame: stop.append(signum))
    for step in range(1, args.steps + 1):
        if stop:
            write_outcome(job_dir, "cancelled", step - 1, trainer="fixture")
            return 128 + stop[0]
        if task == "0":
            with open(metrics, "a") as f:
                f.write(json.dumps({"event": "step", "step": step, "loss": 1.0 / step, "steps_total": args.steps,
                                    "eta_s": (args.steps - step) * args.step_s + args.sleep}) + "\n")
        print(f"fixture step {step}", flush=True)
        time.sleep(args.step_s)
    time.sleep(args.sleep)
    if args.mode == "raise":
        raise ValueError("fixture failure: shard 7 is corrupt")
    if args.mode == "exit3":
        return 3
    print("fixture done", flush=True)
    return 0
