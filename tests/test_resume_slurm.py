"""`launch resume`: a finished 20-step tiny stage-1 run (made once for the module, a pristine
copy kept) continued to 40 steps as a new job on the session cluster. The new job writes into the
first job's run folder; report, export and status of the new job follow the whole run. Copies of
the finished run folder (`cp -a`, its synthetic data inside) resume by their path: one trains on
from its own checkpoint, one whose newest checkpoint is damaged falls back to the one before."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO, run_launch, wait_for_state

from toolkit.metrics import logged_step_records

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

TINY = ["--arg", "export=off", "--arg", "row_len=64", "--arg", "batch_rows=1", "--arg", "synthetic_samples=60", "--arg", "ckpt_every=10"]
ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL"}


@dataclass(frozen=True)
class Finished:
    env: dict[str, str]
    job: str
    run_dir: Path  # the job's run folder (the first test resumes it in place)
    pristine: Path  # `cp -a` of it as the job left it, for the copies


@pytest.fixture(scope="module")
def finished(slurm_cluster, tmp_path_factory: pytest.TempPathFactory) -> Finished:
    tmp = tmp_path_factory.mktemp("resume")
    env = {**os.environ, **slurm_cluster.env(), "LAUNCH_HOME": str(tmp / "home"), "PYTHONPATH": str(REPO)}
    env.pop("LAUNCH_JOBS_PATH", None)
    first = run_launch(["submit", "stage1", "--preset", "tiny", "--parsable", "--no-preflight", "--arg", "steps=20",
                        *TINY], env)
    assert first.returncode == 0, first.stderr
    job1 = first.stdout.strip()
    assert wait_for_state(job1, env, ENDED, timeout=500) == "COMPLETED", \
        run_launch(["logs", job1, "--tail", "30"], env).stdout
    run_dir = Path(env["LAUNCH_HOME"]) / "runs" / "stage1" / job1
    subprocess.run(["cp", "-a", str(run_dir), str(tmp / "pristine")], check=True)
    return Finished(env, job1, run_dir, tmp / "pristine")


def test_resume_a_finished_run_to_40_steps(finished: Finished, tmp_path: Path) -> None:
    env, job1, run_dir = finished.env, finished.job, finished.run_dir

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
    assert wait_for_state(job2, env, ENDED, timeout=500) == "COMPLETED", \
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


def test_a_copied_run_folder_resumes_and_a_damaged_copy_falls_back(finished: Finished, tmp_path: Path) -> None:
    """Two `cp -a` copies of the finished run (checkpoints at steps 10 and 20, synthetic data
    inside), each `launch resume DIR --steps 22` at once. The intact copy resumes from its own
    step 20 on its own data (the same manifests at another path), not refused as another
    --data-dir, not restarted. The other's step-20 model.pt truncated: one line names the file
    and where the checkpoint went (kept byte for byte), the run trains on from step 10."""
    env = finished.env
    intact, damaged = (tmp_path / "copy").resolve(), (tmp_path / "damaged").resolve()
    for dest in (intact, damaged):
        subprocess.run(["cp", "-a", str(finished.pristine), str(dest)], check=True)
    newest = damaged / "checkpoints" / "step_00000020"
    model = newest / "model.pt"
    model.write_bytes(model.read_bytes()[: model.stat().st_size // 3])
    before = {p.relative_to(newest): p.read_bytes() for p in newest.rglob("*") if p.is_file()}

    jobs = {}
    for folder in (intact, damaged):
        sub = run_launch(["resume", str(folder), "--steps", "22", "--parsable", "--no-preflight"], env)
        assert sub.returncode == 0, sub.stderr
        jobs[folder] = sub.stdout.strip()
    for folder, job in jobs.items():
        assert wait_for_state(job, env, ENDED, timeout=500) == "COMPLETED", \
            run_launch(["logs", job, "--tail", "30"], env).stdout
        status = run_launch(["status", job], env).stdout
        assert f"run: {folder} (jobs {job})" in status, status  # the copy is its run, not job1's folder

    log = run_launch(["logs", jobs[intact]], env).stdout
    assert f"# --data-dir {intact / 'data'}: the same manifests (sha256) as checkpoint " \
           f"{intact / 'checkpoints' / 'step_00000020'}'s {finished.run_dir.resolve() / 'data'}; resuming on it" in log, log[-3000:]
    assert f"# resumed from {intact / 'checkpoints' / 'step_00000020'} at step 20" in log, log[-3000:]
    assert [r["step"] for r in logged_step_records(intact / "metrics.jsonl")] == list(range(1, 23))

    log = run_launch(["logs", jobs[damaged]], env).stdout
    named = [ln for ln in log.splitlines() if "step_00000020/model.pt" in ln]
    [aside] = (damaged / "checkpoints").glob("step_00000020.damaged-*")
    assert len(named) == 1 and named[0].startswith(f"# step_00000020 does not verify ({model} is corrupt") \
        and f"moved to {aside} (kept, never overwritten); resuming from step_00000010" in named[0], log[-3000:]
    assert {p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()} == before
    assert f"# resumed from {damaged / 'checkpoints' / 'step_00000010'} at step 10" in log, log[-3000:]
    steps = [r["step"] for r in logged_step_records(damaged / "metrics.jsonl")]
    assert steps == [*range(1, 21), *range(11, 23)], steps
    # each copy's config.yaml is its own resume's; the folder the copies came from got nothing of theirs
    import yaml

    for folder, job in jobs.items():
        assert yaml.safe_load((folder / "config.yaml").read_text())["job_id"] == job
    assert yaml.safe_load((finished.run_dir / "config.yaml").read_text())["job_id"] not in jobs.values()
