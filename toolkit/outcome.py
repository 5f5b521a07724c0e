"""outcome.json: how a trainer's run ended, written by the job and read by the launcher.

{"state": "completed" | "failed" | "cancelled", "step": N, "error": "one line" | null,
 "trainer": "stage1", "time": unix seconds, "job": the Slurm job that wrote it | null}. Written atomically by the trainer's main rank when
the run ends, however it ends short of SIGKILL; the full traceback, if any, stays in the log.
"""

from __future__ import annotations

import json
import os
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
