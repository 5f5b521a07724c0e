"""Extraction and DFlash through the real embedded Slurm cluster (conftest.slurm_cluster).

`launch submit` -> submitit -> sbatch -> the guarded entrypoints. The online test runs the 2-1
topology as 3 Slurm tasks talking gloo; its 3 "GPUs" are the cluster's stand-in device nodes,
which here only set the task count (torch sees no CUDA and uses the CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_launch

pytestmark = pytest.mark.slurm


def _job_dir(env: dict[str, str], stdout: str, job: str) -> Path:
    first = stdout.splitlines()[0]
    assert first.startswith(f"submitted {job}"), stdout
    return Path(env["LAUNCH_HOME"]) / "runs" / job / first.split()[-1]


def _learned(run_dir: Path) -> float:
    """Loss fell, and slot-1 accuracy under the strict mask, pooled over the last 5 steps, is above
    chance (1/64, the synthetic alphabet) by 0.13 (train/dflash/README.md records the numbers)."""
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if r.get("event") == "step"]
    losses = [r["loss"] for r in steps]
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < first, (first, last)
    acc1 = sum(r["acc_slot"][0] for r in steps[-5:]) / 5
    assert acc1 > 1 / 64 + 0.13, [r["acc_slot"][0] for r in steps[-5:]]
    return acc1


def test_extract_then_offline_dflash(launch_env):
    # Two tasks: ranks write alternate shards and their own index files (gloo group on CPU).
    out = run_launch(["submit", "extract", "--preset", "tiny", "--gpus-per-node", "2", "--follow"], launch_env,
                     timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    shards = _job_dir(launch_env, out.stdout, "extract")
    assert "samples/s" in out.stdout
    summary = json.loads((shards / "summary.json").read_text())
    assert summary["complete"] and summary["written"] == summary["shards"] >= 2
    assert len(list(shards.glob("shard_*.safetensors"))) == summary["shards"]
    assert (shards / "index.00000.json").is_file() and (shards / "index.00001.json").is_file()

    out = run_launch(["submit", "dflash", "--preset", "tiny", "--arg", f"data={shards}", "--follow"],
                     launch_env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    run = _job_dir(launch_env, out.stdout, "dflash")
    assert json.loads((run / "summary.json").read_text())["steps"] == 30
    _learned(run)


def test_online_2_1_topology_over_slurm_tasks(launch_env):
    out = run_launch(["submit", "dflash", "--preset", "tiny-online", "--follow"], launch_env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    run = _job_dir(launch_env, out.stdout, "dflash")
    # Each Slurm task has its own log; `--follow` streams task 0's.
    logs = "".join(p.read_text() for p in sorted(run.glob("*_log.out")))
    # 30 steps: target rank 0 produced the even steps, rank 1 the odd ones; rank 2 trained.
    assert "target rank 0: sent 15 batches" in logs and "target rank 1: sent 15 batches" in logs, logs
    assert "mode=online topology=2-1" in logs
    assert json.loads((run / "summary.json").read_text())["steps"] == 30
    _learned(run)
