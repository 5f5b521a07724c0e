"""Can the cluster ever run this request? Compared with what sinfo says the nodes have.

A request that no node can satisfy (more GPUs, CPUs or memory per node than the largest node
has, more nodes than the partition holds, a time over the partition's limit, a partition that
does not exist) sits PENDING forever in Slurm with a reason like `PartitionConfig`. It is
refused before submit instead, in one line naming what was asked and what the largest node has.
Nodes that are down or busy do not make a request infeasible: only configured resources count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from launch.errors import LaunchError
from launch.jobspec import Resources
from launch.slurmenv import run_slurm
from launch.values import parse_slurm_time


@dataclass(frozen=True)
class Node:
    name: str
    partitions: tuple[str, ...]
    cpus: int
    mem_mb: int
    gpus: int

    def describe(self) -> str:
        return f"{self.gpus} GPUs, {self.cpus} CPUs, {self.mem_mb / 1024:.0f} GB"


@dataclass(frozen=True)
class Cluster:
    nodes: tuple[Node, ...]
    default_partition: str | None
    time_limits: dict[str, int | None]  # partition -> minutes (None: unlimited)


def gres_gpus(gres: str) -> int:
    """'gpu:4', 'gpu:h200:8(S:0-1)', 'gpu:a100:2,shard:8' -> GPU count; '(null)' -> 0."""
    total = 0
    for item in gres.split(","):
        m = re.match(r"gpu(?::[^:(]+)?:(\d+)", item.strip())
        if m:
            total += int(m.group(1))
    return total


def parse_sinfo(text: str) -> Cluster:
    """Lines of `sinfo -h -N -o %N|%P|%c|%m|%G|%l` (one line per node and partition)."""
    nodes: dict[str, dict] = {}
    default, limits = None, {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 6:
            continue
        name, part, cpus, mem, gres, limit = parts[:6]
        if part.endswith("*"):
            part = part[:-1]
            default = part
        limits[part] = None if limit.strip() in ("infinite", "UNLIMITED", "n/a", "") else _minutes(limit)
        node = nodes.setdefault(name, {"partitions": [], "cpus": _int(cpus), "mem": _int(mem), "gpus": gres_gpus(gres)})
        node["partitions"].append(part)
    return Cluster(tuple(Node(n, tuple(d["partitions"]), d["cpus"], d["mem"], d["gpus"]) for n, d in nodes.items()),
                   default, limits)


def _int(text: str) -> int:
    m = re.match(r"\d+", text.strip())
    return int(m.group(0)) if m else 0


def _minutes(limit: str) -> int | None:
    try:
        return parse_slurm_time(limit.strip())
    except ValueError:
        return None


def query_cluster(env_extra: dict[str, str]) -> Cluster:
    proc = run_slurm(["sinfo", "-h", "-N", "-o", "%N|%P|%c|%m|%G|%l"], env_extra)
    if proc.returncode != 0:
        raise LaunchError(f"sinfo failed: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}")
    return parse_sinfo(proc.stdout)


ASK_LESS = "ask for less (--gpus-per-node, --cpus-per-task, --nodes) or a smaller preset"


def embedded_up_hint(r: Resources, cluster: Cluster) -> str | None:
    """The `launch cluster up` that would make an embedded cluster big enough for `r`, or None
    when its nodes' memory (the machine's) is what is short. CPUs: at least what the nodes have
    now (a cluster made for one job should still run the others), rounded up to an even count."""
    mem_mb = int(r.mem_gb * 1024) if r.mem_gb else 0
    if not cluster.nodes or any(n.mem_mb < mem_mb for n in cluster.nodes):
        return None
    cpus = max(r.tasks_per_node * r.cpus_per_task, max(n.cpus for n in cluster.nodes))
    cpus += cpus % 2
    nodes = f"--nodes {r.nodes} " if r.nodes > 1 else ""
    return f"launch cluster down && launch cluster up {nodes}--gpus {r.gpus_per_node} --cpus {cpus}"


def check(r: Resources, cluster: Cluster, what: str, advice: str = ASK_LESS) -> str:
    """'' when some nodes can run `r`, else the one-line reason it never can; `advice` ends a
    request too big for every node (the options the caller accepts)."""
    partition = r.partition or cluster.default_partition
    known = sorted(cluster.time_limits)
    if partition is None:
        return f"{what}: no partition given and the cluster has no default (partitions: {', '.join(known) or 'none'})"
    if partition not in cluster.time_limits:
        return f"{what}: partition '{partition}' does not exist (partitions: {', '.join(known) or 'none'})"
    cpus = r.tasks_per_node * r.cpus_per_task
    mem_mb = int(r.mem_gb * 1024) if r.mem_gb else 0
    asked = f"{r.nodes} node{'s' if r.nodes > 1 else ''} with {r.gpus_per_node} GPUs, {cpus} CPUs" + \
            (f", {r.mem_gb:g} GB" if r.mem_gb else "")
    in_part = [n for n in cluster.nodes if partition in n.partitions]
    fits = [n for n in in_part if n.gpus >= r.gpus_per_node and n.cpus >= cpus and n.mem_mb >= mem_mb]
    if len(fits) < r.nodes:
        if not in_part:
            return f"{what} asks for {asked}; partition {partition} has no nodes"
        big = max(in_part, key=lambda n: (n.gpus, n.cpus, n.mem_mb))
        if fits:
            return (f"{what} asks for {asked}; only {len(fits)} node(s) of partition {partition} have that "
                    f"(the largest, {big.name}: {big.describe()})")
        return (f"{what} asks for {asked}; the largest node of partition {partition} ({big.name}) has "
                f"{big.describe()}; {advice}")
    limit = cluster.time_limits.get(partition)
    if limit is not None and r.time_minutes > limit:
        return f"{what} asks for --time {r.time} ({r.time_minutes} min); partition {partition} allows {limit} min"
    return ""
