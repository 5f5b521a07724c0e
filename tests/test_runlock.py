"""One trainer per run folder (toolkit.runlock), and a run's history kept across its jobs.

The launcher's side against a real queue (a resume or a second `--out` while a job of the run is
queued or running) is tests/test_resume_slurm.py's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.stage1_fixtures import FAST_ARGS, make_data
from toolkit import runlock

REPO = Path(__file__).resolve().parents[1]
HOLD = ("import sys, time; from toolkit import runlock; runlock.acquire(sys.argv[1], job='4242'); "
        "print('held', flush=True); time.sleep(120)")


@pytest.fixture
def held(tmp_path: Path):
    """A run folder whose lock another process (as a trainer of job 4242) holds."""
    run = tmp_path / "run"
    run.mkdir()
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(run)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        yield run, child
    finally:
        child.kill()
        child.wait()


def test_a_second_trainer_on_a_held_run_folder_is_refused_and_writes_nothing(held, tmp_path: Path, capsys) -> None:
    from train.stage1.train import main

    run, child = held
    (run / "metrics.jsonl").write_text('{"event": "step", "step": 3}\n')
    (run / "outcome.json").write_text('{"state": "completed", "step": 3}\n')
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    data = make_data(tmp_path)
    capsys.readouterr()
    rc = main([*FAST_ARGS, "--out", str(run), "--data-dir", str(data), "--steps", "1"], guard=False)
    err = capsys.readouterr().err.strip()
    assert rc != 0
    assert err == (f"train.stage1: error: run folder {run} is in use by job 4242 (pid {child.pid} on {os.uname().nodename}): "
                   "one trainer writes a run folder at a time; wait for it to end (or cancel it), or give another --out")
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before  # no metrics, outcome or checkpoint written
    assert runlock.holder(run) == f"job 4242 (pid {child.pid} on {os.uname().nodename})"


def test_the_lock_never_goes_stale_a_killed_holder_frees_it(held) -> None:
    run, child = held
    assert runlock.holder(run) is not None
    child.send_signal(signal.SIGKILL)
    child.wait()
    deadline = time.monotonic() + 5
    while runlock.holder(run) is not None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert runlock.holder(run) is None
    fd = runlock.acquire(run, job="7")
    try:
        assert json.loads((run / runlock.LOCK).read_text())["job"] == "7"
        assert (run / runlock.LOCK).stat().st_mode & 0o777 == 0o600
    finally:
        runlock.release(fd)


def test_a_later_jobs_outcome_in_the_run_folder_leaves_the_first_jobs_status(tmp_path: Path, monkeypatch) -> None:
    """Job 11 ran in its folder (completed at step 20, as its main task recorded); job 12 resumed
    the run and its trainer wrote the run folder's outcome.json (failed at step 0): job 11 still
    reads completed at step 20, job 12's own outcome is its own."""
    from launch.jobs_cli import job_outcome
    from launch.registry import JobRecord
    from toolkit.outcome import read_outcome, write_outcome

    first = tmp_path / "11"
    first.mkdir()
    monkeypatch.setenv("SLURM_JOB_ID", "11")
    write_outcome(first, "completed", 20)
    (first / "outcome.task0.json").write_text(json.dumps({"state": "completed", "step": 20, "error": None,
                                                          "task": 0, "time": 1.0}))
    monkeypatch.setenv("SLURM_JOB_ID", "12")
    write_outcome(first, "failed", 0, "boom")  # job 12's trainer, --out the first job's folder
    rec = JobRecord(job_id="11", name="stage1", preset=None, folder=str(first), submitted_at=0.0, slurm_conf=None,
                    argv=[])
    assert (job_outcome(rec, "COMPLETED") or {}).get("state") == "completed"
    assert (job_outcome(rec, "COMPLETED") or {}).get("step") == 20
    assert read_outcome(first, job="12")["state"] == "failed"  # the writer's own view


def test_an_export_over_an_earlier_one_keeps_the_users_files(tmp_path: Path, monkeypatch, capsys) -> None:
    """`launch export` twice into one --out, the user's NOTES.md and eval/ added in between: the
    second export replaces the model files and keeps the user's byte for byte."""
    from launch.cli import main
    from tests.badinputs.checkpoint_cases import finished_run

    run = finished_run(tmp_path)
    monkeypatch.setenv("LAUNCH_HOME", str(tmp_path / "home"))
    dest = tmp_path / "dest"
    assert main(["export", str(run), "--job", "stage1", "--step", "1", "--out", str(dest)]) == 0
    (dest / "NOTES.md").write_text("my notes\n")
    (dest / "eval").mkdir()
    (dest / "eval" / "eval.json").write_text('{"acc": 0.5}\n')
    first_readme = (dest / "README.md").read_text()
    assert main(["export", str(run), "--job", "stage1", "--out", str(dest)]) == 0
    assert (dest / "NOTES.md").read_text() == "my notes\n"
    assert (dest / "eval" / "eval.json").read_text() == '{"acc": 0.5}\n'
    assert (dest / "README.md").read_text() != first_readme and "step_00000002" in (dest / "README.md").read_text()
    assert (dest / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".old-", ".tmp-"))]


EXPORT_FULL_CHILD = r"""
import os, subprocess, sys
mnt, run = sys.argv[1:3]
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", mnt], check=True)
dest = os.path.join(mnt, "export")
os.mkdir(dest)
open(os.path.join(dest, "NOTES.md"), "w").write("mine\n")
with open(os.path.join(mnt, "filler"), "wb") as f:   # leave 1 MiB: the model's 20 MiB cannot fit
    st = os.statvfs(mnt)
    f.write(b"\0" * (st.f_bavail * st.f_frsize - (1 << 20)))
from launch.cli import main
rc = main(["export", run, "--job", "stage1", "--out", os.path.join(mnt, "new")])
print("RC", rc, sorted(os.listdir(mnt)), open(os.path.join(dest, "NOTES.md")).read().strip(), flush=True)
"""


@pytest.mark.slow
def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing_behind(tmp_path: Path) -> None:
    """`launch export` onto a small tmpfs (real ENOSPC, in its own mount namespace) that is full:
    one line naming the free space, no temp directory left, the user's files untouched."""
    from tests.badinputs.checkpoint_cases import finished_run

    if os.geteuid() != 0 or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs root and mount namespaces (unshare -m)")
    run = finished_run(tmp_path)
    (tmp_path / "mnt").mkdir()
    child = subprocess.run(["unshare", "-m", "--propagation", "private", sys.executable, "-c", EXPORT_FULL_CHILD,
                            str(tmp_path / "mnt"), str(run)], capture_output=True, text=True, timeout=600,
                           env={**os.environ, "PYTHONPATH": str(REPO), "LAUNCH_HOME": str(tmp_path / "home")})
    assert "RC 2 ['export', 'filler'] mine" in child.stdout, child.stdout + child.stderr
    err = [ln for ln in child.stderr.splitlines() if ln.strip() and "it/s]" not in ln]
    assert len(err) == 1 and "Traceback" not in child.stderr, child.stderr
    assert "No space left on device" in err[0] and "nothing written" in err[0], err


def test_a_removed_or_fifo_lock_file_neither_frees_the_folder_nor_hangs(held, tmp_path: Path) -> None:
    """The lock is the run directory's own: `.run.lock` removed under a holder does not let a second
    trainer in, and a FIFO put in its place answers at once (never opened for reading); once the
    holder is gone, the FIFO is replaced by the new holder's file."""
    run, child = held
    signal.signal(signal.SIGALRM, lambda *_: pytest.fail("the run-folder lock hung on a FIFO"))
    signal.alarm(30)
    try:
        (run / runlock.LOCK).unlink()
        assert runlock.holder(run) == "another trainer"
        with pytest.raises(runlock.RunFolderBusy, match=f"run folder {run} is in use by another trainer"):
            runlock.acquire(run, job="7")
        os.mkfifo(run / runlock.LOCK)
        assert runlock.holder(run) == "another trainer"
        with pytest.raises(runlock.RunFolderBusy):
            runlock.acquire(run, job="7")
        child.kill()
        child.wait()
        assert runlock.holder(run) is None
        mine = runlock.acquire(run, job="7")
    finally:
        signal.alarm(0)
    try:
        assert json.loads((run / runlock.LOCK).read_text())["job"] == "7"
    finally:
        runlock.release(mine)


def test_a_run_folder_replaced_under_its_trainer_stops_it_before_the_next_write(tmp_path: Path) -> None:
    """check_held, asked before every checkpoint: the lock file removed while the directory's lock
    holds is put back (holder names the trainer again); the folder renamed away and a new one made
    in its place (which another trainer could lock) is one line, RunFolderLost."""
    run = tmp_path / "run"
    run.mkdir()
    held = runlock.acquire(run, job="7")
    try:
        (run / runlock.LOCK).unlink()
        runlock.check_held(held)
        assert json.loads((run / runlock.LOCK).read_text())["job"] == "7"
        run.rename(tmp_path / "run.old")
        run.mkdir()
        with pytest.raises(runlock.RunFolderLost, match=f"run folder {run} was replaced while this trainer held it"):
            runlock.check_held(held)
    finally:
        runlock.release(held)
