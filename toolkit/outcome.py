"""outcome.json: how a trainer's run ended, written by the job and read by the launcher.

{"state": "completed" | "failed" | "cancelled", "step": N, "error": "one line" | null,
 "trainer": "stage1", "time": unix seconds, "job": the Slurm job that wrote it | null}. Written atomically by the trainer's main rank when
the run ends, however it ends short of SIGKILL; the full traceback, if any, stays in the log.
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path
from typing import Any

from toolkit.fsutil import atomic_write_text

OUTCOME = "outcome.json"
STATES = ("completed", "failed", "cancelled")


def write_outcome(run_dir: str | os.PathLike[str], state: str, step: int, error: str | None = None,
                  trainer: str | None = None) -> Path:
    if state not in STATES:
        raise ValueError(f"state must be one of {STATES}, got {state!r}")
    path = Path(run_dir) / OUTCOME
    record = {"state": state, "step": step, "error": error, "trainer": trainer, "time": time.time(), "job": slurm_job()}
    atomic_write_text(path, json.dumps(record) + "\n")
    return path


def slurm_job() -> str | None:
    """The Slurm job this process belongs to, as the launcher records it (array jobs: `A_T`)."""
    array, task = os.environ.get("SLURM_ARRAY_JOB_ID"), os.environ.get("SLURM_ARRAY_TASK_ID")
    return f"{array}_{task}" if array and task else os.environ.get("SLURM_JOB_ID")


def read_outcome(run_dir: str | os.PathLike[str], job: str | None = None) -> dict[str, Any] | None:
    """The run's outcome record, None when there is none (still running, or killed by SIGKILL).
    With `job`: None also when another job wrote it (a later resume's trainer writes the run
    folder's outcome.json, which is the first job's folder)."""
    try:
        rec = json.loads((Path(run_dir) / OUTCOME).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("state") not in STATES:
        return None
    return None if job and rec.get("job") and str(rec["job"]) != job else rec


def describe(outcome: dict[str, Any]) -> str:
    """One line for the user: `completed at step 60`, `cancelled at step 12`, `failed at step 3: ...`."""
    step = outcome.get("step")
    line = outcome["state"] if step is None else f"{outcome['state']} at step {step}"  # None: before step 1
    return f"{line}: {outcome['error']}" if outcome.get("error") and outcome["state"] == "failed" else line


def _head(path: Path, limit: int = 1 << 16) -> bytes | None:
    """The first `limit` bytes of a regular file (never blocks on a FIFO), None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return f.read(limit)


def run_kind(run_dir: str | os.PathLike[str]) -> str | None:
    """Which trainer's run a folder holds ("stage1", "extract", "dflash"): its outcome.json's
    `trainer`, else its metrics.jsonl header's; None for a new (or unreadable) folder. A run folder
    belongs to one trainer: another's metrics, summary and outcome would replace or mix with its own."""
    for name in (OUTCOME, "metrics.jsonl"):
        raw = _head(Path(run_dir) / name)
        if not raw:
            continue
        try:
            rec = json.loads(raw.split(b"\n", 1)[0] if name != OUTCOME else raw)
        except (ValueError, RecursionError):
            continue
        if isinstance(rec, dict) and isinstance(rec.get("trainer"), str):
            return rec["trainer"]
    return None


def kind_of_entrypoint(entrypoint: str) -> str:
    """The trainer name a run of `entrypoint` records ("train.stage1" -> "stage1")."""
    return entrypoint.rsplit(".", 1)[-1]
