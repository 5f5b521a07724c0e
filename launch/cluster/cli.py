"""`launch cluster up | down | status`: the embedded Slurm cluster (one or more nodes on this machine)."""

from __future__ import annotations

import argparse
import json
import time

from launch.cluster.embedded import EmbeddedCluster
from launch.errors import LaunchError
from launch.values import nonneg_int, positive_int


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--nodes", type=positive_int, help="compute nodes, each its own slurmd on a loopback "
                   "address (default 1)")
    p.add_argument("--gpus", type=nonneg_int, help="GPUs per node: the real ones by default (split between the "
                   "nodes); on a machine without the NVIDIA driver, N stand-in devices (major 195)")
    p.add_argument("--cpus", type=positive_int, help="CPUs per node (default: this machine's)")
    p.add_argument("--prolog", help="Slurm Prolog executable (e.g. the keepalive hook)")
    p.add_argument("--epilog", help="Slurm Epilog executable")
    p.add_argument("--slurmd-timeout", type=positive_int, metavar="S",
                   help="seconds a silent node stays up before Slurm marks it DOWN (Slurm's default 300)")
    p.add_argument("--requeue-delay", type=positive_int, metavar="S",
                   help="seconds a requeued job waits before it may start again (default: --slurmd-timeout "
                   "when given, else Slurm's 120)")
    p.add_argument("--json", action="store_true", help="status: one JSON object (daemons, nodes, GPUs)")
    p.add_argument("--state-dir", help="where configs, logs and data live (default $LAUNCH_HOME/cluster)")


UP_ONLY = ("nodes", "gpus", "cpus", "prolog", "epilog", "slurmd_timeout", "requeue_delay")


def run(args: argparse.Namespace) -> int:
    # An option the action does not read is an error, not silently dropped (`down --gpus 2`).
    given = [f"--{k.replace('_', '-')}" for k in UP_ONLY if getattr(args, k) is not None]
    if given and args.action != "up":
        raise LaunchError(f"{' '.join(given)} go(es) with `cluster up`; `cluster {args.action}` takes no resources")
    if args.json and args.action != "status":
        raise LaunchError(f"--json goes with `cluster status`, not `cluster {args.action}`")
    if args.state_dir is not None and not args.state_dir.strip():
        raise LaunchError("--state-dir is empty; give a directory (default $LAUNCH_HOME/cluster)")
    cluster = EmbeddedCluster(args.state_dir)
    if args.action == "up":
        t0 = time.monotonic()
        started = cluster.up(gpus=args.gpus, cpus=args.cpus, prolog=args.prolog, epilog=args.epilog,
                             nodes=args.nodes, slurmd_timeout=args.slurmd_timeout, requeue_delay=args.requeue_delay,
                             progress=lambda msg: print(f"[cluster] {msg}", flush=True))
        if not started:
            print(f"embedded cluster is already up in {cluster.state_dir}; nothing changed")
            return 0
        print(f"embedded cluster up in {time.monotonic() - t0:.1f} s")
        print(cluster.status_text())
        print(f"\nto use Slurm's own commands here: export SLURM_CONF={cluster.slurm_conf}")
        return 0
    if args.action == "down":
        stopped = cluster.down(progress=lambda msg: print(f"[cluster] {msg}", flush=True))
        print("embedded cluster down" if stopped else f"no embedded cluster running in {cluster.state_dir}")
        return 0
    if args.json:
        status = cluster.status_dict()
        print(json.dumps(status, indent=1))
        return 0 if status["up"] else 1
    print(cluster.status_text())
    return 0 if cluster.is_up() else 1
