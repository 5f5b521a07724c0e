"""`launch resume`: a finished 20-step tiny stage-1 run continued to 40 steps as a new job on
the session cluster. The new job writes into the first job's run folder; report, export and
status of the new job follow the whole run."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import REPO, run_launch, wait_for_state

from toolkit.metrics import logged_step_records

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TINY = ["--arg", "export=off", "--arg", "row_len=64", "--arg", "batch_rows=1", "--arg", "synthetic_samples=60", "--arg", "ckpt_every=10"]


def test_resume_a_finished_run_to_40_steps(slurm_cluster, tmp_path: Path) -> None:
    env = {**os.environ, **slurm_cluster.env(), "LAUNCH_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}
    env.pop("LAUNCH_JOBS_PATH", None)
    first = run_launch(["submit", "stage1", "--preset", "tiny", "--parsable", "--no-preflight", "--arg", "steps=20",
                        *TINY], env)
    assert first.returncode == 0, first.stderr
    job1 = first.stdout.strip()
    assert wait_for_state(job1, env, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=500) == "COMPLETED", \
        run_launch(["logs", job1, "--tail", "30"], env).stdout
    run_dir = Path(env["LAUNCH_HOME"]) / "runs" / "stage1" / job1

    second = run_launch(["resume", job1, "--steps", "40", "--parsable", "--no-preflight"], env)
    assert second.returncode == 0, second.stderr
    job2 = second.stdout.strip()
    assert job2 != job1
    # One trainer per run folder: while job2 is queued or running, neither another resume nor a
    # new job with the same --out is queued (each one line, nothing submitted).
    again = run_launch(["resume", job1, "--steps", "60", "--parsable", "--no-preflight"], env)
    same_out = run_launch(["submit", "stage1", "--preset", "tiny", "--parsable", "--no-preflight", "--arg",
                           f"out={run_dir}", "--arg", "steps=60", *TINY], env)
    for refused in (again, same_out):
        assert refused.returncode != 0 and refused.stdout == "", refused.stdout + refused.stderr
        assert f": error: run folder {run_dir} is in use by job {job2} (" in refused.stderr, refused.stderr
        assert len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    elsewhere = run_launch(["resume", job1, "--arg", f"out={tmp_path / 'elsewhere'}", "--parsable"], env)
    assert elsewhere.returncode != 0 and "a resume continues job" in elsewhere.stderr, elsewhere.stderr
    assert wait_for_state(job2, env, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=500) == "COMPLETED", \
        run_launch(["logs", job2, "--tail", "30"], env).stdout
    log = run_launch(["logs", job2], env).stdout
    assert "# resumed from" in log, log[-2000:]

    steps = [r["step"] for r in logged_step_records(run_dir / "metrics.jsonl")]
    assert sorted(set(steps)) == list(range(1, 41)), steps  # one run folder, both jobs' steps
    # the lr of every step is the README's schedule: the first job's cosine over 20 steps, then its final lr
    from train.stage1.train import Stage1Config, lr_lambda

    cfg = Stage1Config(steps=20)  # the tiny preset keeps the trainer's lr, warmup and min_lr_ratio
    lrs = {r["step"]: r["lr"] for r in logged_step_records(run_dir / "metrics.jsonl")}
    assert [lrs[s] for s in range(1, 41)] == pytest.approx([cfg.lr * lr_lambda(cfg)(s) for s in range(40)])
    assert not (Path(env["LAUNCH_HOME"]) / "runs" / "stage1" / job2 / "metrics.jsonl").exists()

    report = run_launch(["report", job2], env)
    assert report.returncode == 0, report.stderr
    assert f"{run_dir / 'metrics.jsonl'}: 40 steps (1..40)" in report.stderr
    assert all(Path(p).is_file() and Path(p).parent == run_dir / "plots" for p in report.stdout.split())

    export = run_launch(["export", job2, "--out", str(tmp_path / "exported")], env, timeout=300)
    assert export.returncode == 0, export.stderr
    from transformers import AutoConfig

    assert AutoConfig.from_pretrained(tmp_path / "exported", local_files_only=True).model_type
    assert "40" in (tmp_path / "exported" / "README.md").read_text()
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "exported").iterdir()}
    assert set(modes.values()) == {0o644}, modes  # model.safetensors like the rest

    status = run_launch(["status", job2], env).stdout
    # job2's trainer wrote the run folder's outcome.json (job1's folder): job1 still reads as it ended
    first_status = run_launch(["status", job1, "--json"], env)
    assert first_status.returncode == 0, first_status.stderr
    import json

    outcome = json.loads(first_status.stdout).get("outcome") or {}
    assert (outcome.get("state"), outcome.get("step")) == ("completed", 20), first_status.stdout
    assert f"run: {run_dir} (jobs {job1}, {job2})" in status, status
    assert "COMPLETED" in status.splitlines()[1]
    listing = run_launch(["list"], env).stdout
    assert f"(resumes {job1})" in next(ln for ln in listing.splitlines() if ln.startswith(job2))
    # the config.yaml of the run is the latest job's, with the new total
    import yaml

    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["job_id"] == job2 and config["args"]["steps"] == 40
