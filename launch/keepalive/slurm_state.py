"""Which GPUs of this node Slurm has given to jobs right now.

The holder asks this when it starts (and periodically), so that a holder restarted while
jobs run learns their allocations from Slurm instead of re-grabbing their GPUs. The source
is `scontrol show job -d -o`, whose per-node detail reads e.g.
`Nodes=n1 CPU_IDs=0-1 Mem=0 GRES=gpu:2(IDX:0-1)`: the GRES index is the same index
SLURM_JOB_GPUS gives the prolog.
"""

from __future__ import annotations

import re
import socket
import subprocess

from launch.errors import LaunchError
from launch.keepalive.protocol import parse_gpu_list

# States in which a job may still be using its GPUs. COMPLETING: the epilog has not run yet.
ACTIVE_STATES = frozenset({"RUNNING", "CONFIGURING", "COMPLETING", "SUSPENDED", "STOPPED", "RESIZING"})
_JOB_ID = re.compile(r"\bJobId=(\d+)")
_JOB_STATE = re.compile(r"\bJobState=(\S+)")
_NODE_DETAIL = re.compile(r"\bNodes=(\S+) CPU_IDs=\S+ Mem=\S+ GRES=(\S*)")
_GPU_IDX = re.compile(r"gpu[^,(]*\(IDX:([0-9,\-]+)\)")


def _scontrol(args: list[str], timeout: float) -> str:
    try:
        done = subprocess.run(
            ["scontrol", *args], capture_output=True, text=True, timeout=timeout, check=False
        )
    except FileNotFoundError:
        raise LaunchError("scontrol not found; install the Slurm client on this node") from None
    except subprocess.TimeoutExpired:
        raise LaunchError(f"scontrol {' '.join(args)} did not answer within {timeout:g} s") from None
    if done.returncode != 0:
        raise LaunchError(f"scontrol {' '.join(args)} failed: {done.stderr.strip() or done.returncode}")
    return done.stdout


def expand_hostlist(expr: str, timeout: float = 10.0) -> list[str]:
    if "[" not in expr:
        return expr.split(",")
    return _scontrol(["show", "hostnames", expr], timeout).split()


def local_node_names(timeout: float = 10.0) -> set[str]:
    """Slurm node names that mean this machine: NodeName or NodeHostName equal to our host."""
    host = socket.gethostname()
    ours = {host, host.split(".")[0]}
    names = set(ours)
    for line in _scontrol(["show", "node", "-o"], timeout).splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        if fields.get("NodeHostName") in ours or fields.get("NodeAddr") in ours:
            names.add(fields.get("NodeName", ""))
    names.discard("")
    return names


def parse_job_allocations(scontrol_output: str, node_names: set[str]) -> dict[str, list[int]]:
    """`scontrol show job -d -o` text -> {job id: GPU indices on one of `node_names`}."""
    allocations: dict[str, list[int]] = {}
    for line in scontrol_output.splitlines():
        job = _JOB_ID.search(line)
        state = _JOB_STATE.search(line)
        if not job or not state or state.group(1) not in ACTIVE_STATES:
            continue
        gpus: set[int] = set()
        for nodes, gres in _NODE_DETAIL.findall(line):
            if not node_names.intersection(expand_hostlist(nodes)):
                continue
            for idx in _GPU_IDX.findall(gres):
                gpus.update(parse_gpu_list(idx))
        if gpus:
            allocations[job.group(1)] = sorted(gpus)
    return allocations


def current_allocations(node_names: set[str] | None = None, timeout: float = 10.0) -> dict[str, list[int]]:
    """{job id: GPU indices} for jobs Slurm counts as active on this node."""
    names = node_names if node_names is not None else local_node_names(timeout)
    output = _scontrol(["show", "job", "-d", "-o"], timeout)
    if output.strip() == "No jobs in the system":
        return {}
    return parse_job_allocations(output, names)
