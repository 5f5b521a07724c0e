"""Submit-to-RUNNING latency on the embedded Slurm cluster.

Two paths side by side, in one run, on one private cluster:
  launch  - `launch submit` (job spec -> submitit -> sbatch), as a user runs it
  sbatch  - a bare `sbatch --wrap`, the floor set by Slurm itself
Latency = from just before the submit call until squeue first reports RUNNING (polled every
20 ms). Prints a table with median, p90 and the launch/sbatch ratio.

    python bench/submit_latency.py [--n 10]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launch.cluster.embedded import EmbeddedCluster  # noqa: E402
from toolkit import pyexec  # noqa: E402

FIXTURES = REPO / "tests" / "jobfixtures"


def wait_running(job_id: str, env: dict[str, str], timeout: float = 60) -> float:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        q = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], env=env, capture_output=True, text=True)
        state = q.stdout.strip()
        if state in ("RUNNING", "COMPLETING") or (not state and q.returncode == 0):
            return time.monotonic()
        time.sleep(0.02)
    raise RuntimeError(f"job {job_id} never ran")


def one_launch(env: dict[str, str]) -> float:
    t0 = time.monotonic()
    out = subprocess.run([*pyexec.python(), "-m", "launch", "submit", "fixture", "--preset", "quick"], env=env,
                         capture_output=True, text=True, check=True, cwd=REPO)
    job_id = out.stdout.splitlines()[0].split()[-1]
    return wait_running(job_id, env) - t0


def one_sbatch(env: dict[str, str], out_dir: Path) -> float:
    t0 = time.monotonic()
    out = subprocess.run(["sbatch", "--parsable", "-o", str(out_dir / "%j.out"), "--wrap", "true"], env=env,
                         capture_output=True, text=True, check=True)
    return wait_running(out.stdout.strip().split(";")[0], env) - t0


def main() -> int:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--n", type=int, default=10)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cluster = EmbeddedCluster(Path(tmp) / "cluster")
        t0 = time.monotonic()
        cluster.up(gpus=0, cpus=2)
        up_s = time.monotonic() - t0
        env = {**os.environ, **cluster.env(), "LAUNCH_HOME": str(Path(tmp) / "home"),
               "LAUNCH_JOBS_PATH": str(FIXTURES), "PYTHONPATH": f"{REPO}{os.pathsep}{FIXTURES}"}
        try:
            launch_s, sbatch_s = [], []
            for _ in range(args.n):  # interleaved, so drift on a shared machine hits both alike
                launch_s.append(one_launch(env))
                sbatch_s.append(one_sbatch(env, Path(tmp)))
        finally:
            cluster.down()
    def p90(xs: list[float]) -> float:
        return sorted(xs)[max(0, int(round(0.9 * len(xs))) - 1)]
    print(f"embedded cluster up: {up_s:.2f} s   samples per path: {args.n}")
    print(f"{'path':<8} {'median s':>9} {'p90 s':>7} {'min s':>7}")
    for name, xs in (("launch", launch_s), ("sbatch", sbatch_s)):
        print(f"{name:<8} {statistics.median(xs):>9.2f} {p90(xs):>7.2f} {min(xs):>7.2f}")
    print(f"ratio launch/sbatch (median): {statistics.median(launch_s) / statistics.median(sbatch_s):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
