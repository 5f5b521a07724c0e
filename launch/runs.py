"""A job's earlier runs: what ended them, in one line for `launch status`.

Slurm requeues a batch job whose node failed (NODE_FAIL, with JobRequeue=1, Slurm's default)
or that was preempted; the job keeps its id and waits to run again, and the trainers resume
from their last checkpoint when it does. `sacct -D` lists every run of the job, the current
one last. Which node failed is in the job's own stderr, where srun wrote "Node failure on X".
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

_NODE_FAILURE = re.compile(r"Node failure on (\S+)")
ENDED_STATES = {"NODE_FAIL", "PREEMPTED", "REQUEUED", "BOOT_FAIL", "FAILED", "TIMEOUT", "CANCELLED"}


def earlier_runs(job_id: str, env: dict[str, str], timeout: float = 30) -> list[dict[str, str]]:
    """Every run of the job before the current one: state and nodes, oldest first."""
    try:
        proc = subprocess.run(["sacct", "-j", job_id, "-D", "-X", "-n", "-P", "-o", "JobID,State,NodeList"],
                              env=env, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return []
    runs = []
    for line in proc.stdout.splitlines():
        fields = line.split("|")
        if len(fields) == 3 and fields[0] == job_id:
            runs.append({"state": fields[1].split()[0], "nodes": fields[2]})
    return [r for r in runs[:-1] if r["state"] in ENDED_STATES]


def failed_node(folder: Path, job_id: str) -> str | None:
    """The node srun reported failed, from the job's stderr files."""
    for path in sorted(folder.glob(f"{job_id}_*_log.err")):
        try:
            found = _NODE_FAILURE.findall(path.read_text(errors="replace"))
        except OSError:
            continue
        if found:
            return found[-1]
    return None


def requeue_line(job_id: str, folder: str | Path, env: dict[str, str]) -> str | None:
    """'requeued after run 1 ended NODE_FAIL (node2 stopped responding)', or None."""
    runs = earlier_runs(job_id, env)
    if not runs:
        return None
    last = runs[-1]
    node = failed_node(Path(folder), job_id) if last["state"] == "NODE_FAIL" else None
    why = f"{node} stopped responding" if node else f"on {last['nodes']}"
    return f"requeued after run {len(runs)} ended {last['state']} ({why})"
