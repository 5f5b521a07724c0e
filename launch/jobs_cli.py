"""`launch status | logs | cancel | list`: follow-up verbs on submitted jobs."""

from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from pathlib import Path
from typing import TextIO

from launch import registry
from launch.errors import LaunchError
from launch.registry import JobRecord
from launch.runs import requeue_line
from launch.slurmenv import TERMINAL_STATES, job_state, run_slurm


def add_status_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id", nargs="?", help="job id (default: the 10 most recent jobs)")


def add_logs_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id")
    p.add_argument("-f", "--follow", action="store_true", help="keep printing until the job ends")
    p.add_argument("--stderr", action="store_true", help="only stderr")


def add_cancel_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id")


def add_list_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", type=int, default=20, help="how many recent jobs")


def job_error(rec: JobRecord) -> str | None:
    """The failure text of a finished job: submitit's pickled exception, else stderr's last line."""
    result = Path(rec.folder) / f"{rec.job_id}_0_result.pkl"
    if result.exists():
        try:
            with open(result, "rb") as f:
                outcome, payload = pickle.load(f)
        except Exception:  # a torn or foreign pickle: fall back to stderr
            outcome, payload = None, None
        if outcome == "error":
            lines = [ln for ln in str(payload).strip().splitlines() if ln.strip()]
            return lines[-1].strip() if lines else "failed"
    if rec.stderr.exists():
        lines = [ln for ln in rec.stderr.read_text(errors="replace").splitlines()
                 if ln.strip() and not ln.startswith("submitit")]
        errors = [ln for ln in lines if "Error" in ln or "error" in ln]
        if errors:
            return errors[-1].strip()
    return None


def _status_line(rec: JobRecord) -> tuple[str, dict[str, str]]:
    st = job_state(rec.job_id, rec.slurm_env())
    line = f"{rec.job_id:<8} {rec.name:<10} {rec.preset or '-':<12} {st['state']:<11} {st['elapsed']:<10}"
    return line, st


def run_status(args: argparse.Namespace) -> int:
    if args.job_id is None:
        return run_list(argparse.Namespace(n=10))
    rec = registry.find(args.job_id)
    line, st = _status_line(rec)
    print(f"{'JOBID':<8} {'NAME':<10} {'PRESET':<12} {'STATE':<11} {'ELAPSED':<10}")
    print(line)
    if st["reason"] and st["state"] == "PENDING":
        print(f"  pending: {st['reason']}")
    requeued = requeue_line(rec.job_id, rec.folder, {**os.environ, **rec.slurm_env()})
    if requeued:
        print(f"  {requeued}")
    print(f"  folder: {rec.folder}")
    if st["state"] in TERMINAL_STATES - {"COMPLETED"}:
        err = job_error(rec)
        if err:
            print(f"  error: {err}")
        print(f"  see: launch logs {rec.job_id}")
        return 1
    return 0


def run_list(args: argparse.Namespace) -> int:
    jobs = registry.all_jobs()[-args.n:]
    if not jobs:
        print("no jobs submitted from here yet (`launch submit stage1 --preset tiny`)")
        return 0
    print(f"{'JOBID':<8} {'NAME':<10} {'PRESET':<12} {'STATE':<11} {'ELAPSED':<10} SUBMITTED")
    for rec in jobs:
        line, _ = _status_line(rec)
        print(f"{line} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(rec.submitted_at))}")
    return 0


def run_cancel(args: argparse.Namespace) -> int:
    rec = registry.find(args.job_id)
    proc = run_slurm(["scancel", rec.job_id], rec.slurm_env())
    if proc.returncode != 0:
        raise LaunchError(f"scancel {rec.job_id}: {proc.stderr.strip()}")
    print(f"cancel requested for job {rec.job_id}")
    return 0


def _print_new(path: Path, offset: int, out: TextIO) -> int:
    if not path.exists():
        return offset
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    if data:
        out.write(data.decode(errors="replace"))
        out.flush()
    return offset + len(data)


def follow(rec: JobRecord, out: TextIO, poll_s: float = 1.0) -> int:
    """Stream stdout and stderr until the job reaches a terminal state; exit 0 only on COMPLETED."""
    offsets = {rec.stdout: 0, rec.stderr: 0}
    last_state = ""
    while True:
        st = job_state(rec.job_id, rec.slurm_env())
        if st["state"] != last_state:
            out.write(f"[launch] job {rec.job_id}: {st['state']}\n")
            out.flush()
            last_state = st["state"]
        for path in offsets:
            offsets[path] = _print_new(path, offsets[path], out)
        if st["state"] in TERMINAL_STATES:
            time.sleep(poll_s)  # the last lines may land just after the state flips
            for path in offsets:
                offsets[path] = _print_new(path, offsets[path], out)
            if st["state"] == "COMPLETED":
                return 0
            err = job_error(rec)
            out.write(f"[launch] job {rec.job_id} ended {st['state']}" + (f": {err}" if err else "") + "\n")
            return 1
        time.sleep(poll_s)


def run_logs(args: argparse.Namespace) -> int:
    rec = registry.find(args.job_id)
    if args.follow:
        return follow(rec, sys.stdout)
    paths = [rec.stderr] if args.stderr else [rec.stdout, rec.stderr]
    found = False
    for path in paths:
        if path.exists():
            found = True
            print(f"==> {path} <==")
            sys.stdout.write(path.read_text(errors="replace"))
    if not found:
        st = job_state(rec.job_id, rec.slurm_env())
        print(f"no log yet for job {rec.job_id} (state {st['state']}); expected at {rec.stdout}")
    err = job_error(rec)
    if err:
        print(f"==> error <==\n{err}")
    return 0


run = run_status
add_arguments = add_status_arguments
