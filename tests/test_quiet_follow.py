"""What a follow shows by default (launch/quiet.py), judged against the real producers of the
chatter: the doctor's own table renderer, tqdm's own bars, submitit's own log format. And, on the
session cluster, a follow of the tiny stage-1 on CPU: at most 10 lines before the first step, the
summary and a `next:` line at the end, `logs --tail 3` ending in step lines."""

from __future__ import annotations

import io
import logging
import os
import re
from pathlib import Path

import pytest
from conftest import REPO, RUN_CWD, run_launch

from launch.doctor.results import CheckResult, Status, render_table
from launch.jobs_cli import elapsed_words, format_seconds
from launch.quiet import QuietFilter, short_header


def _rows(*statuses: Status) -> list[CheckResult]:
    return [CheckResult(f"check.{n}", s, "found " + "x" * 90, "fix it" if s in (Status.WARN, Status.FAIL) else "")
            for n, s in enumerate(statuses)]


def test_a_passing_preflight_is_one_line() -> None:
    table = render_table(_rows(Status.PASS, Status.SKIP, Status.PASS)).splitlines()
    assert len(table) > 5  # the oracle's table wraps long cells: several lines a row
    out = QuietFilter().feed([*table, "step     1 | loss 8.0"])
    assert out == ["[launch] preflight: 3 checks, none failed or warned (the table is in the log)",
                   "step     1 | loss 8.0"]


def test_a_warning_row_is_shown_whole_with_the_header() -> None:
    table = render_table(_rows(Status.PASS, Status.WARN, Status.SKIP)).splitlines()
    out = QuietFilter().feed(table)
    row = next(i for i, ln in enumerate(table) if ln.startswith("check.1 "))
    end = next(i for i in range(row + 1, len(table)) if not table[i].startswith(" "))
    assert end - row >= 2  # the oracle wrapped the WARN row: its continuation lines must come too
    assert out == [table[0], *table[row:end], "3 checks: 0 FAIL, 1 WARN"]


def test_submitit_info_and_progress_bars_stay_in_the_log() -> None:
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    handler.setFormatter(logging.Formatter("%(name)s %(levelname)s (%(asctime)s) - %(message)s"))  # submitit's format
    log = logging.getLogger("submitit")
    log.addHandler(handler)
    try:
        log.setLevel(logging.INFO)
        log.info("Starting with JobEnvironment(job_id=1)")
        log.warning("Bypassing signal SIGCONT")
        log.error("Submitted job triggered an exception")
        log.error("Could not dump error: disk full")
    finally:
        log.removeHandler(handler)
    from tqdm import tqdm

    bars = io.StringIO()
    for _ in tqdm(range(3), desc="Writing model shards", file=bars):
        pass
    lines = [*buf.getvalue().splitlines(), *bars.getvalue().rstrip("\n").split("\n"), "# done: {\"steps\": 3}",
             "[launch] running train.stage1 --steps 3"]
    lines += ["srun: error: node1: task 0: Exited with exit code 1"]
    out = QuietFilter().feed(lines)
    # submitit's ERROR lines stay, but for its echo of the exception (the traceback's last line
    # says it, and so does the launcher's closing line) and srun's exit-code line
    assert out == [buf.getvalue().splitlines()[3]]
    assert out[0].startswith("submitit ERROR") and out[0].endswith("Could not dump error: disk full")


def test_setup_comments_before_the_first_step_are_cut_to_the_header() -> None:
    header = ("# trainer=stage1 shape=tiny params=5160600 vocab=5120 tokenizer=byte-level stand-in (random init) "
              "device=cpu world=1 deepspeed=False row_len=256 start_step=0 steps=60 mfu_peak=n/a (cpu: peak unknown)")
    lines = [header, "# MFU (torchtitan): flops/token = ...", "# kernels[cpu]: gated-delta-rule=reference",
             "# resumed from /runs/1/checkpoints/step_20 at step 20", "step 1 | loss 8", "# checkpoint at step 1"]
    out = QuietFilter().feed(lines)
    assert out == ["# trainer=stage1 shape=tiny params=5.2M device=cpu world=1 steps=60",
                   "# resumed from /runs/1/checkpoints/step_20 at step 20", "step 1 | loss 8", "# checkpoint at step 1"]
    assert short_header(header.replace("start_step=0", "start_step=20")).endswith("start_step=20 steps=60")


def test_task_prefixes_survive() -> None:
    out = QuietFilter().feed(["[task 1] submitit INFO (x) - hello", "[task 1] srun: got SIGCONT", "[task 1] step 2 | loss 1"])
    assert out == ["[task 1] step 2 | loss 1"]


def test_elapsed_has_one_form_running_or_ended() -> None:
    # squeue while running, sacct once ended: the same duration reads the same
    assert elapsed_words("2:03") == elapsed_words("00:02:03") == "2:03"
    assert elapsed_words("1-00:00:05") == format_seconds(86405) == "1-00:00:05"
    assert elapsed_words("01:00:00") == "1:00:00"


@pytest.mark.slurm
@pytest.mark.slow
def test_follow_of_tiny_stage1_is_short_before_the_first_step(slurm_cluster, tmp_path: Path) -> None:
    env = {**os.environ, **slurm_cluster.env(), "LAUNCH_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}
    env.pop("LAUNCH_JOBS_PATH", None)
    out = run_launch(["submit", "stage1", "--preset", "tiny", "--follow", "--arg", "steps=3", "--arg", "row_len=128",
                      "--arg", "batch_rows=1", "--arg", "synthetic_samples=60"], env, timeout=400)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    lines = out.stdout.splitlines()
    first_step = next(i for i, ln in enumerate(lines) if ln.startswith("step "))
    assert first_step <= 10, "\n".join(lines[:first_step])
    assert any(ln.startswith("[launch] preflight: ") for ln in lines[:first_step])
    assert not any(ln.startswith(("submitit INFO", "# done:")) or "\r" in ln for ln in lines)
    job = lines[0].split()[-1]
    assert lines[-1].startswith("next: ") and f"launch report {job}" in lines[-1]
    assert any(ln.strip().startswith("loss ") and "->" in ln for ln in lines)
    tail = run_launch(["logs", job, "--tail", "3", "--stderr"], env).stdout
    out_tail = run_launch(["logs", job, "--tail", "3"], env).stdout.split("<==\n")[1].splitlines()[:3]
    assert [ln.split()[:2] for ln in out_tail] == [["step", "1/3"], ["step", "2/3"], ["step", "3/3"]], out_tail
    # every step line of the follow: at most 120 characters, `step n/N` and an ETA
    step_lines = [ln for ln in lines if ln.startswith("step ")]
    assert len(step_lines) == 3 and all(len(ln) <= 120 and re.search(r" eta \S+", ln) for ln in step_lines), step_lines
    assert "submitit INFO" not in tail
    verbose = run_launch(["logs", job, "--verbose"], env).stdout
    assert "submitit INFO" in verbose and "# done: " in verbose
    status = run_launch(["status", job], env).stdout
    config = Path(env["LAUNCH_HOME"]) / "runs" / "stage1" / job / "config.yaml"
    assert f"config: {config}" in status and "argv: --shape tiny" in status, status


def test_a_fixed_topology_on_the_demo_cluster_is_told_how_to_grow_it(tmp_path: Path, monkeypatch) -> None:
    from launch import feasibility
    from launch.cluster.embedded import EmbeddedCluster
    from launch.jobspec import find_spec
    from launch.submit import too_big_advice

    monkeypatch.setenv("LAUNCH_HOME", str(tmp_path))
    demo = feasibility.parse_sinfo("vm|debug*|2|15000|(null)|infinite\n")  # what `make demo` starts on 2 cores
    spec = find_spec("dflash")
    job = spec.resolve("tiny-online")
    embedded = {"SLURM_CONF": str(EmbeddedCluster().slurm_conf)}
    said = feasibility.check(job.resources, demo, "dflash (preset tiny-online)",
                             too_big_advice(spec, job, demo, embedded))
    assert said.endswith("`launch cluster down && launch cluster up --gpus 3 --cpus 4`"), said
    assert "task count at 3" in said and "--gpus-per-node" not in said
    # another Slurm is not restarted from here: no such hint
    other = too_big_advice(spec, job, demo, {"SLURM_CONF": "/etc/slurm/slurm.conf"})
    assert "cluster up" not in other
    # a job whose task count is free may ask for fewer GPUs
    stage1 = find_spec("stage1")
    big = stage1.resolve("qwen35-2b")
    assert too_big_advice(stage1, big, demo, {}) == feasibility.ASK_LESS


def test_a_reader_that_leaves_early_gets_no_traceback(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    home, folder = tmp_path / "home", tmp_path / "runs" / "1"
    folder.mkdir(parents=True)
    home.mkdir()
    (folder / "1_0_log.out").write_text("".join(f"step {n} | loss 1.0\n" for n in range(1, 200_001)))
    (home / "jobs.jsonl").write_text(json.dumps({"job_id": "1", "name": "fixture", "preset": None, "folder": str(folder),
                                                 "submitted_at": 0.0, "slurm_conf": None, "argv": []}) + "\n")
    env = {**os.environ, "LAUNCH_HOME": str(home), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "launch", "logs", "1"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=RUN_CWD)
    assert proc.stdout.readline().startswith(b"==> ")  # `| head -1`
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 141 and err == "", err


def test_task_loss_curves_join_the_steps_each_task_has(tmp_path: Path, monkeypatch) -> None:
    import math

    import matplotlib
    from matplotlib.axes import Axes

    from launch.report import TASK_WORDS, write_plots
    from toolkit.metrics import SCHEMAS

    matplotlib.use("Agg")
    drawn: dict[str, tuple[list, list]] = {}
    real_plot = Axes.plot

    def spy(self, xs, ys, *a, **k):  # noqa: ANN001, ANN202 - records what matplotlib is asked to draw
        task = {TASK_WORDS["und"]: "und", TASK_WORDS["gen_txt"]: "gen_txt"}.get(k.get("label"))  # legends in words
        if task:
            drawn[task] = (list(xs), list(ys))
        return real_plot(self, xs, ys, *a, **k)

    monkeypatch.setattr(Axes, "plot", spy)
    # gen_txt only in every third batch, as a sampled task mix gives it
    steps = [{"step": s, "loss": 5.0, "task_loss": {"und": 1.0 / s, **({"gen_txt": 2.0} if s % 3 == 0 else {})}}
             for s in range(1, 10)]
    written = write_plots(steps, tmp_path, "t", SCHEMAS["stage1"])
    assert tmp_path / "task_loss.png" in written
    assert drawn["gen_txt"] == ([3, 6, 9], [2.0, 2.0, 2.0])  # joined, no NaN gaps
    assert drawn["und"][0] == list(range(1, 10)) and not any(math.isnan(v) for v in drawn["und"][1])


def test_arg_job_id_is_that_jobs_run_folder(tmp_path: Path, monkeypatch) -> None:
    from launch import registry
    from launch.errors import LaunchError
    from launch.submit import job_output

    monkeypatch.setenv("LAUNCH_HOME", str(tmp_path))
    first = registry.JobRecord("7", "extract", "tiny", str(tmp_path / "runs/extract/7"), 0.0, None, [])
    resumed = registry.JobRecord("9", "extract", "tiny", str(tmp_path / "runs/extract/9"), 1.0, None, [],
                                 run_dir=first.folder, resumes="7")
    registry.record(first)
    registry.record(resumed)
    assert job_output("job:7", "--arg data") == first.folder
    assert job_output("job:9", "--arg data") == first.folder  # a resumed job's output is its run's
    assert job_output("/data/x", "--arg data") == "/data/x"
    assert job_output("job:7/data.jsonl", "--arg data") == f"{first.folder}/data.jsonl"
    with pytest.raises(LaunchError, match="stays inside"):
        job_output("job:7/../../etc", "--arg data")
    assert [j.job_id for j in registry.jobs_of_run(Path(first.folder))] == ["7", "9"]


@pytest.mark.slurm
def test_doctor_on_cluster_suggests_only_its_own_options(launch_env) -> None:
    # 8 GPUs a node on the session cluster's 4: refused before anything is queued
    out = run_launch(["doctor", "--on-cluster", "--job", "stage1", "--preset", "qwen35-2b"], launch_env)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "check a smaller --preset" in out.stderr and "--gpus-per-node" not in out.stderr, out.stderr
    # and every option named there is one `launch doctor` accepts
    import re

    help_text = run_launch(["doctor", "--help"], launch_env).stdout
    for option in re.findall(r"--[a-z-]+", out.stderr):
        assert option in help_text, option


def test_a_requeued_attempt_is_quiet_again_and_the_heartbeat_says_where_it_is(tmp_path: Path) -> None:
    import json

    from launch.jobs_cli import progress_words, summary_lines
    from launch.registry import JobRecord

    first = ["[launch] running train.stage1 --steps 60", "# kernels[cpu]: x", "step 59 | loss 1"]
    again = ["[launch] running train.stage1 --steps 60", "# resumed from ck/step_50 at step 50", "# kernels[cpu]: x",
             "# packing: rows", "step 51 | loss 2"]
    assert QuietFilter().feed(first + again) == ["step 59 | loss 1", "# resumed from ck/step_50 at step 50",
                                                 "step 51 | loss 2"]
    # metrics after a requeue at step 59 resumed from 50: the last line is where the run is now
    (tmp_path / "metrics.jsonl").write_text("".join(
        json.dumps({"event": "step", "step": s, "loss": 1.0, **extra}) + "\n"
        for s, extra in [(58, {}), (59, {}), (51, {"steps_total": 60, "eta_s": 100.4, "stall": "data wait 3 s"})]))
    rec = JobRecord("5", "stage1", "tiny", str(tmp_path), 0.0, None, [])
    assert progress_words(rec) == "step 51/60, ETA 1:40, stalled: data wait 3 s"
    (tmp_path / "summary.json").write_text(json.dumps({"steps": 60, "first_loss": 8.5, "last_loss": 1.38,
                                                       "tok_s_all_ranks": 42.1}))
    assert summary_lines(rec)[:3] == ["  steps     60", "  loss      8.500 -> 1.380",
                                      "  tokens/s  42 (all ranks, padding included)"]


def test_the_next_line_after_each_pipeline_step_names_the_pipeline_s_next_step():
    """regen -> extract -> dflash -> export: after each, the next job with the arguments that name
    this one (a report or `resume --steps` means nothing there); stage 1 keeps report/resume."""
    from launch.jobs_cli import next_line
    from launch.registry import JobRecord

    def rec(name: str, preset: str | None, argv: list[str]) -> JobRecord:
        return JobRecord(job_id="7", name=name, preset=preset, folder="/r/7", submitted_at=0.0, slurm_conf=None, argv=argv)

    assert next_line(rec("regen", "tiny", ["--init-from", "/t/my model", "--data", "/t/chat.jsonl"]), True) == \
        "launch submit extract --preset tiny --arg init_from='/t/my model' --arg data=job:7/data.jsonl   |   launch status 7"
    assert next_line(rec("regen", "gpu", []), True).startswith(
        "launch submit extract --arg init_from=<target> --arg data=job:7/data.jsonl")
    assert next_line(rec("extract", "tiny", []), True) == "launch submit dflash --preset tiny --arg data=job:7   |   launch status 7"
    assert next_line(rec("dflash", "tiny", []), True) == "launch export 7   |   launch status 7"
    assert next_line(rec("stage1", "tiny", []), True) == "launch report 7   |   launch status 7   |   launch resume 7 --steps N"


def test_the_step_line_legend_stays_in_the_follow_and_the_default_logs() -> None:
    """The `# step line:` legend says what the compact line's fields are: it is kept before the
    first step, where the other set-up comments are cut (38.9)."""
    from launch.quiet import QuietFilter

    legend = "# step line: step n/N, loss, acc1 (first slot's accuracy), tau, real tok/s, compute+data ms, eta"
    shown = QuietFilter().feed(["# trainer=dflash mode=offline steps=3", "# kernels[cpu]: loss logits", legend,
                                "step 1/3 loss 9.000 acc1 0.000 tau 1.00 950 tok/s 12+3ms eta 2s"])
    assert shown == ["# trainer=dflash mode=offline steps=3", legend,
                     "step 1/3 loss 9.000 acc1 0.000 tau 1.00 950 tok/s 12+3ms eta 2s"]
