"""Keepalive latency: how long a job waits for its GPUs (yield) and how soon they are held
again after it ends (reclaim). Median of N (default 20) of each, printed as a table.

Modes:
  direct  the holder plus the hook commands run here, as slurmd would run them:
          - socket: request -> ack round trip only (in-process client)
          - hook:   wall time of the hook process, exec -> exit after the ack
                    (what slurmd actually waits for: python start-up + round trip)
  slurm   the real embedded Slurm with the hooks as Prolog/Epilog; N sequential 1-GPU jobs;
          the latency is read from the hook log ("ms after hook start": wrapper exec -> ack).

Backends: stand-in GPUs held by lock (default, any machine as root), or real GPUs through
CUDA (--cuda: the holder's per-GPU worker takes --mem-fraction of memory; release waits
for the worker to exit, i.e. for the memory to be freed).

    sudo .venv/bin/python bench/keepalive_latency.py                 # stand-ins, direct
    sudo .venv/bin/python bench/keepalive_latency.py --mode slurm    # stand-ins, real Slurm
    sudo .venv/bin/python bench/keepalive_latency.py --cuda --gpus 0 # real GPU, direct
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from launch.keepalive.protocol import request  # noqa: E402
from toolkit import pyexec  # noqa: E402


def _env(root: Path, extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHONPATH=str(REPO), LAUNCH_KEEPALIVE_SOCKET=str(root / "run" / "ctl" / "sock"),
               LAUNCH_KEEPALIVE_STATE=str(root / "run" / "state.json"),
               LAUNCH_KEEPALIVE_HOOK_LOG=str(root / "hooks.log"))
    env.update(extra or {})
    return env


def _start_holder(root: Path, args: argparse.Namespace, env: dict[str, str]) -> subprocess.Popen[bytes]:
    cmd = [*pyexec.python(), "-m", "launch", "keepalive", "run", "--gpus", args.gpus,
           "--mem-fraction", str(args.mem_fraction)]
    if not args.cuda:
        cmd += ["--devices-dir", str(args.devices_dir)]
    if args.mode == "direct":
        cmd += ["--no-slurm"]
    log = open(root / "holder.log", "ab")  # noqa: SIM115
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log)
    state_file = Path(env["LAUNCH_KEEPALIVE_STATE"])
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            sys.exit(f"holder exited: {(root / 'holder.log').read_text()[-2000:]}")
        if state_file.exists() and json.loads(state_file.read_text())["pid"] == proc.pid:
            return proc
        time.sleep(0.05)
    sys.exit("holder did not come up in 300 s")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def _hook(hook: str, job: str, gpus: str, env: dict[str, str]) -> float:
    t0 = time.perf_counter()
    done = subprocess.run([*pyexec.python(), "-m", "launch.keepalive.cli", hook],
                          env={**env, "SLURM_JOB_ID": job, "SLURM_JOB_GPUS": gpus}, capture_output=True)
    elapsed = time.perf_counter() - t0
    if done.returncode != 0:
        sys.exit(f"{hook} failed: {done.stderr.decode()}")
    return 1e3 * elapsed


def bench_direct(root: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    env = _env(root)
    holder = _start_holder(root, args, env)
    sock = Path(env["LAUNCH_KEEPALIVE_SOCKET"])
    gpu = int(args.gpus.split(",")[0]) if args.gpus != "auto" else 0
    results: dict[str, list[float]] = {k: [] for k in
                                       ("yield: socket round trip", "yield: prolog process",
                                        "reclaim: socket round trip", "reclaim: epilog process")}
    try:
        for i in range(args.n):
            t0 = time.perf_counter()
            request(sock, {"op": "release", "job": f"s{i}", "gpus": [gpu]}, 60)
            results["yield: socket round trip"].append(1e3 * (time.perf_counter() - t0))
            t0 = time.perf_counter()
            answer = request(sock, {"op": "reclaim", "job": f"s{i}"}, 300)
            results["reclaim: socket round trip"].append(1e3 * (time.perf_counter() - t0))
            assert answer["reclaimed"] == [gpu], answer
        for i in range(args.n):
            results["yield: prolog process"].append(_hook("prolog", f"h{i}", str(gpu), env))
            results["reclaim: epilog process"].append(_hook("epilog", f"h{i}", str(gpu), env))
    finally:
        _stop(holder)
    return results


def bench_slurm(root: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    from launch.cluster.embedded import EmbeddedCluster

    env = _env(root)
    subprocess.run([*pyexec.python(), "-m", "launch", "keepalive", "hooks", "--dir", str(root / "hooks"),
                    "--socket", env["LAUNCH_KEEPALIVE_SOCKET"], "--log", env["LAUNCH_KEEPALIVE_HOOK_LOG"]],
                   env=env, check=True, capture_output=True)
    cluster = EmbeddedCluster(root / "cluster")
    cluster.up(gpus=4, cpus=4, prolog=str(root / "hooks" / "prolog"), epilog=str(root / "hooks" / "epilog"))
    args.devices_dir = cluster.dev_dir
    env.update(cluster.env())
    holder = _start_holder(root, args, env)
    try:
        for _ in range(args.n):
            subprocess.run(["sbatch", "--wait", "--gres=gpu:1", "-o", "/dev/null", "--wrap", "true"],
                           env=env, check=True, capture_output=True, timeout=120)
        # the epilog of the last job may still be running when sbatch --wait returns
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if len(re.findall(r"epilog job=\d+: reclaimed", (root / "hooks.log").read_text())) >= args.n:
                break
            time.sleep(0.2)
    finally:
        _stop(holder)
        cluster.down()
    text = (root / "hooks.log").read_text()
    pattern = r"{}.*? in ([\d.]+) ms; ([\d.]+) ms after hook start"
    yields = re.findall(pattern.format("prolog job="), text)
    reclaims = re.findall(pattern.format("epilog job="), text)
    return {
        "yield: socket round trip (in prolog)": [float(a) for a, _ in yields],
        "yield: slurmd exec -> ack": [float(b) for _, b in yields],
        "reclaim: socket round trip (in epilog)": [float(a) for a, _ in reclaims],
        "reclaim: slurmd exec -> ack": [float(b) for _, b in reclaims],
    }


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=("direct", "slurm"), default="direct")
    parser.add_argument("--cuda", action="store_true", help="real GPUs through CUDA instead of stand-ins")
    parser.add_argument("--gpus", default="auto")
    parser.add_argument("--mem-fraction", type=float, default=0.5)
    parser.add_argument("-n", type=int, default=20)
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("run as root: the holder's socket is root-only (and mknod needs root)")
    if args.cuda and args.mode == "slurm":
        sys.exit("--mode slurm uses the embedded cluster's stand-in GPUs; use --mode direct with --cuda")
    root = Path(tempfile.mkdtemp(prefix="keepalive-bench-"))
    try:
        if not args.cuda:
            args.devices_dir = root / "dev"
            args.devices_dir.mkdir()
            for i in range(4):
                os.mknod(args.devices_dir / f"nvidia{i}", 0o666 | 0o020000, os.makedev(195, i))
        results = bench_direct(root, args) if args.mode == "direct" else bench_slurm(root, args)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    backend = "CUDA (real GPU)" if args.cuda else "lock (stand-in GPU)"
    print(f"keepalive latency, mode={args.mode}, backend={backend}, host={platform.node()}, "
          f"python {platform.python_version()}")
    print(f"{'measure':<42} {'n':>3} {'median ms':>10} {'p90 ms':>8} {'min ms':>8} {'max ms':>8}")
    for name, values in results.items():
        if not values:
            print(f"{name:<42}   0  (no samples)")
            continue
        values = sorted(values)
        p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
        print(f"{name:<42} {len(values):>3} {statistics.median(values):>10.1f} {p90:>8.1f} "
              f"{values[0]:>8.1f} {values[-1]:>8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
