"""The metrics.jsonl format the trainers write and `launch report` reads.

One JSON object per line. `{"event": "header", ...}` once per (re)start with the run's facts;
`{"event": "step", "step": N, ...}` once per logged step. A resumed run appends to the same file
and logs its steps again, so readers keep the last record of each step. Torch-free, so the CLI
on a login node and the trainers share this reader.
"""

from __future__ import annotations

import json
import os
from typing import Any


def step_records(metrics: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Step records of a metrics.jsonl, sorted by step; the last record of a step wins (a resumed
    run logs its steps again), a torn line (a killed run) is skipped."""
    by_step: dict[int, dict[str, Any]] = {}
    with open(metrics) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and rec.get("event") == "step" and "step" in rec:
                by_step[int(rec["step"])] = rec
    return [by_step[s] for s in sorted(by_step)]
