"""outcome.json: how a trainer's run ended, written by the job and read by the launcher.

{"state": "completed" | "failed" | "cancelled", "step": N, "error": "one line" | null,
 "trainer": "stage1", "time": unix seconds}. Written atomically by the trainer's main rank when
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
    record = {"state": state, "step": step, "error": error, "trainer": trainer, "time": time.time()}
    atomic_write_text(path, json.dumps(record) + "\n")
    return path


def read_outcome(run_dir: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The run's outcome record, None when there is none (still running, or killed by SIGKILL)."""
    try:
        rec = json.loads((Path(run_dir) / OUTCOME).read_text())
    except (OSError, ValueError):
        return None
    return rec if isinstance(rec, dict) and rec.get("state") in STATES else None


def describe(outcome: dict[str, Any]) -> str:
    """One line for the user: `completed at step 60`, `cancelled at step 12`, `failed at step 3: ...`."""
    step = outcome.get("step")
    line = outcome["state"] if step is None else f"{outcome['state']} at step {step}"  # None: before step 1
    return f"{line}: {outcome['error']}" if outcome.get("error") and outcome["state"] == "failed" else line
