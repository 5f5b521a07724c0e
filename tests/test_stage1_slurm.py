"""stage1 through the real embedded Slurm: the guard lets a real allocation in, and a requeued
job (`scontrol requeue`, what submitit does on timeout/preemption) resumes at the same step with
the same next batch."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_launch, wait_for_state
from train.stage1.data import DataConfig, PackedBatches, build_batch
from train.stage1.train import batch_digest

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture()
def stage1_env(slurm_cluster, tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, **slurm_cluster.env(), "LAUNCH_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}
    env.pop("LAUNCH_JOBS_PATH", None)
    return env


def _steps(metrics: Path) -> list[dict]:
    if not metrics.exists():
        return []
    out = []
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # the line being written
        if rec.get("event") == "step":
            out.append(rec)
    return out


def test_requeued_stage1_resumes_with_the_same_next_batch(stage1_env: dict[str, str]) -> None:
    sub = run_launch(["submit", "stage1", "--preset", "tiny", "--cpus-per-task", "2", "--no-preflight",
                      "--arg", "steps=8", "--arg", "row_len=128", "--arg", "batch_rows=1", "--arg", "ckpt_every=2",
                      "--arg", "synthetic_samples=100"], stage1_env)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.splitlines()[0].split()[-1]
    job_dir = Path(stage1_env["LAUNCH_HOME"]) / "runs" / "stage1" / job
    metrics = job_dir / "metrics.jsonl"

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not any(r["step"] >= 3 for r in _steps(metrics)):
        time.sleep(1)
    assert any(r["step"] >= 3 for r in _steps(metrics)), run_launch(["logs", job], stage1_env).stdout[-3000:]
    subprocess.run(["scontrol", "requeue", job], env=stage1_env, check=True, capture_output=True, timeout=30)

    state = wait_for_state(job, stage1_env, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=420)
    log = run_launch(["logs", job], stage1_env).stdout
    assert state == "COMPLETED", log[-3000:]
    assert "# resumed from" in log and "refusing" not in log

    events = [json.loads(line) for line in metrics.read_text().splitlines()]
    headers = [i for i, e in enumerate(events) if e["event"] == "header"]
    assert len(headers) == 2, "expected one start and one resumed start"
    resumed_at = events[headers[1]]["start_step"]
    assert resumed_at > 0 and f"at step {resumed_at}, next batch {resumed_at}" in log
    first_after = events[headers[1] + 1]
    assert (first_after["step"], first_after["batch_index"]) == (resumed_at + 1, resumed_at)

    # Every step, before or after the requeue, trained on exactly batch step-1 of (seed 0, rank 0).
    # tiny trains with its vision tower on: images as vision-tower inputs, as in the run
    ds = PackedBatches(DataConfig(str(job_dir / "data"), row_len=128, batch_rows=1, seed=0, vision=True), rank=0)
    recs = [e for e in events if e["event"] == "step"]
    assert sorted({r["step"] for r in recs}) == list(range(1, 9))
    for r in recs:
        assert r["batch_index"] == r["step"] - 1
        assert r["batch_digest"] == batch_digest(build_batch(ds.sampler, ds.tok, ds.cfg, r["batch_index"]))
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["last_loss"] < summary["first_loss"]
