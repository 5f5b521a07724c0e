"""Faults against the real stage-1 trainer: a missing `latest` pointer, a changed model shape,
a non-finite loss, SIGTERM, SIGKILL during a checkpoint write. Each ends in one line (or a resume)
and loses no checkpoint."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.stage1_fixtures import FAST_ARGS, make_data, run, step_records
from train.common.checkpoint import CheckpointError
from train.common.distributed import DistInfo
from train.common.stepper import Stepper

REPO = Path(__file__).resolve().parents[1]


def _trainer(out: Path, data: Path, steps: int, *extra: str) -> subprocess.Popen[str]:
    argv = [*FAST_ARGS, "--out", str(out), "--data-dir", str(data), "--steps", str(steps), *extra]
    code = f"import sys; from train.stage1.train import main; sys.exit(main({argv!r}, guard=False))"
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**env, "PYTHONPATH": str(REPO)})


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("fault-data"))


def test_missing_latest_resumes_from_the_newest_valid_checkpoint(tmp_path: Path, data: Path, capsys) -> None:
    out = tmp_path / "run"
    assert run(out, data, 4, "--ckpt-every", "2") == 0
    ckpts = out / "checkpoints"
    (ckpts / "latest").unlink()
    capsys.readouterr()
    assert run(out, data, 6, "--ckpt-every", "2") == 0
    log = capsys.readouterr().out
    assert f"# resumed from {ckpts / 'step_00000004'} at step 4, next batch 4" in log
    recs = step_records(out)
    assert [r["step"] for r in recs] == [1, 2, 3, 4, 5, 6]  # resumed at 5: nothing retrained, nothing lost
    assert (ckpts / "latest").read_text().strip() == "step_00000006"

    # The same run dir with another model shape: one line, the checkpoints untouched.
    before = sorted(p.name for p in ckpts.iterdir())
    assert run(out, data, 8, "--vision", "off") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "was written with --vision on, this run has off" in err[0], err
    assert sorted(p.name for p in ckpts.iterdir()) == before
    outcome = json.loads((out / "outcome.json").read_text())
    assert outcome["state"] == "failed" and "--vision" in outcome["error"]


def test_a_checkpoint_of_another_shape_is_one_line_not_a_traceback(tmp_path: Path) -> None:
    one = DistInfo(0, 1, 0, "127.0.0.1", 0, "gloo", False)

    def stepper(width: int) -> Stepper:
        model = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Linear(width, 2))
        return Stepper.create(model, model, lr=1e-3, weight_decay=0.0, grad_clip=1.0, lr_lambda=lambda s: 1.0,
                              device=torch.device("cpu"), dist=one)

    (tmp_path / "ck").mkdir()
    stepper(8).save(tmp_path / "ck", is_main=True)
    with pytest.raises(CheckpointError) as exc:
        stepper(16).load(tmp_path / "ck")
    msg = str(exc.value)
    assert "\n" not in msg and "does not fit this model" in msg and "size mismatch for 0.weight" in msg


@pytest.mark.slow
def test_non_finite_loss_stops_the_run_naming_the_step_and_the_checkpoint(tmp_path: Path, data: Path) -> None:
    out = tmp_path / "run"
    proc = _trainer(out, data, 30, "--lr", "1e6", "--warmup", "1", "--ckpt-every", "1")
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 1, stderr[-2000:]
    err = stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train.stage1: error: step "), err
    outcome = json.loads((out / "outcome.json").read_text())
    assert outcome["state"] == "failed" and outcome["step"] < 30
    step = outcome["step"]
    assert f"step {step}: " in err[0] and ("nan" in err[0] or "inf" in err[0]) and "--max-bad-steps" in err[0]
    last_good = out / "checkpoints" / f"step_{step - 1:08d}"
    if step > 1:  # the checkpoint named is the one before the bad step, and it verifies
        assert f"last good checkpoint: {last_good}" in err[0]
        assert (out / "checkpoints" / "latest").read_text().strip() == last_good.name
    assert not (out / "checkpoints" / f"step_{step:08d}").exists()  # the bad step was never saved


@pytest.mark.slow
def test_sigterm_stops_at_the_current_step_with_an_outcome(tmp_path: Path, data: Path) -> None:
    out = tmp_path / "run"
    proc = _trainer(out, data, 10_000, "--ckpt-every", "0")
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (out / "metrics.jsonl").exists() or not step_records(out):
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    outcome = json.loads((out / "outcome.json").read_text())
    assert outcome["state"] == "cancelled" and outcome["step"] >= 1
    assert stderr.strip().splitlines()[-1] == f"train.stage1: cancelled at step {outcome['step']} (SIGTERM)"


def test_parser_from_the_config_dataclass() -> None:
    """Each field is one flag with the field's default; bad values are one-line ConfigErrors."""
    from train.common.config import ConfigError
    from train.stage1.train import Stage1Config, parse_args

    assert parse_args([]) == Stage1Config()
    cfg = parse_args(["--steps", "7", "--vision", "off", "--restart", "--weights", '{"und": 2}'])
    assert (cfg.steps, cfg.vision, cfg.restart, cfg.weights) == (7, False, True, {"und": 2.0})
    for bad, words in ((["--steps", "x"], "--steps"), (["--vision", "maybe"], "on or off"),
                       (["--weights", "[1]"], "JSON object"), (["--bogus", "1"], "--bogus")):
        with pytest.raises(ConfigError, match=words) as exc:
            parse_args(bad)
        assert "\n" not in str(exc.value)


def test_a_non_finite_step_is_not_applied_and_max_bad_steps_bounds_the_skips(tmp_path: Path) -> None:
    from toolkit.metrics import SCHEMAS
    from train.common.metrics import MetricsLogger
    from train.common.runtime import NonFiniteStep, Runtime

    one = DistInfo(0, 1, 0, "127.0.0.1", 0, "gloo", False)
    model = torch.nn.Linear(3, 1)
    stepper = Stepper.create(model, model, lr=0.1, weight_decay=0.0, grad_clip=1.0, lr_lambda=lambda s: 1.0,
                             device=torch.device("cpu"), dist=one)
    rt = Runtime("t", SCHEMAS["stage1"], torch.device("cpu"), one, tmp_path,
                 MetricsLogger(tmp_path, SCHEMAS["stage1"], enabled=False), is_logger=True, max_bad_steps=1)
    before = model.weight.detach().clone()
    loss = model(torch.full((2, 3), float("nan"))).sum()
    stepper.backward(loss)
    norm, skipped = stepper.step(loss)
    assert skipped and torch.equal(model.weight, before) and model.weight.grad is None
    rt.step = 5
    assert rt.check_finite(float(loss.detach()), norm, skipped) is False  # the one bad step allowed
    good = model(torch.ones(2, 3)).sum()
    stepper.backward(good)
    norm, skipped = stepper.step(good)
    assert not skipped and not torch.equal(model.weight, before)
    assert rt.check_finite(float(good.detach()), norm, skipped) is True
    rt.step, rt.last_checkpoint = 9, tmp_path / "step_00000008"
    with pytest.raises(NonFiniteStep, match=r"step 9: loss nan.*last good checkpoint: .*step_00000008"):
        rt.check_finite(float("nan"), float("nan"), True)


def _kill_during_a_checkpoint_write(proc: subprocess.Popen[str], checkpoints: Path, min_step: int,
                                    timeout: float = 300) -> str:
    """SIGKILL the trainer the moment a checkpoint of step >= min_step is being written (its
    .tmp-step_* directory exists); return that directory's name. Killed, not asked: no cleanup runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            writing = [e.name for e in os.scandir(checkpoints)
                       if e.name.startswith(".tmp-step_") and int(e.name[len(".tmp-step_"):]) >= min_step]
        except FileNotFoundError:
            writing = []
        if writing:
            proc.send_signal(signal.SIGKILL)
            proc.communicate(timeout=60)
            return writing[0]
        time.sleep(0.0005)
    proc.kill()
    raise AssertionError(f"no checkpoint write seen (rc {proc.poll()}): {proc.communicate()[1][-2000:]}")


@pytest.mark.slow
def test_sigkill_during_a_checkpoint_write_recomputes_only_the_steps_since_the_last_one(
        tmp_path: Path, data: Path) -> None:
    """kill -9 while step N's checkpoint is half written: the rerun resumes from the newest
    complete checkpoint, recomputes only the steps after it, on the same batches, with bitwise-equal
    losses to a run that was never killed; no checkpoint is lost."""
    steps = 8
    # All three runs are child processes: the same torch thread count in each (this process's
    # may differ), so bitwise equality is a fair demand.
    straight = tmp_path / "straight"
    proc = _trainer(straight, data, steps, "--ckpt-every", "0")
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-2000:]
    out = tmp_path / "killed"
    killed_at = _kill_during_a_checkpoint_write(_trainer(out, data, steps, "--ckpt-every", "1", "--keep-checkpoints",
                                                         "100"), out / "checkpoints", min_step=3)
    half_written = int(killed_at.removeprefix(".tmp-step_"))
    assert 3 <= half_written <= steps
    complete = sorted(p.name for p in (out / "checkpoints").glob("step_*"))
    # What was complete survives (a checkpoint past the kill would mean the kill came too late).
    assert complete == [f"step_{s:08d}" for s in range(1, half_written)], (killed_at, complete)
    logged_before = len((out / "metrics.jsonl").read_text().splitlines())

    proc = _trainer(out, data, steps, "--ckpt-every", "1", "--keep-checkpoints", "100")
    _, stderr = proc.communicate(timeout=600)
    assert proc.returncode == 0, stderr[-2000:]
    lines = (out / "metrics.jsonl").read_text().splitlines()[logged_before:]
    rerun = [r for r in map(json.loads, lines) if r.get("event") == "step"]
    assert [r["step"] for r in rerun] == list(range(half_written, steps + 1))  # only what the kill lost
    want = {r["step"]: r for r in step_records(straight)}
    for got in rerun:
        ref = want[got["step"]]
        assert (got["batch_index"], got["batch_digest"]) == (ref["batch_index"], ref["batch_digest"])
        assert got["loss"] == ref["loss"], (got["step"], got["loss"], ref["loss"])  # bitwise, not approximately
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == [
        f"step_{s:08d}" for s in range(1, steps + 1)]
    assert not list((out / "checkpoints").glob(".tmp-step_*"))  # the half-written one was cleaned up


FULL_FS_CHILD = r"""
import json, os, subprocess, sys
mnt, data, logs, keep = map(__import__("pathlib").Path, sys.argv[1:5])
argv = json.loads(sys.argv[5])
subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256m", "tmpfs", str(mnt)], check=True)
out = mnt / "run"

def trainer(name, steps):
    code = ("import sys; from train.stage1.train import main; "
            f"sys.exit(main({[*argv, '--out', str(out), '--data-dir', str(data), '--steps', str(steps)]!r}, guard=False))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    (logs / f"{name}.json").write_text(json.dumps({"rc": p.returncode, "out": p.stdout, "err": p.stderr}))

def fill(leave):
    st = os.statvfs(mnt)
    with open(mnt / "filler", "ab") as f:
        f.write(b"\0" * max(0, st.f_bavail * st.f_frsize - leave))

trainer("first", 2)                      # checkpoint at step 2
fill(64 << 10)                           # room for a few metrics lines, not for a checkpoint
trainer("checkpoint_full", 4)
fill(0)                                  # not even a metrics line
trainer("metrics_full", 4)
(mnt / "filler").unlink()
trainer("after", 4)                      # space again: the same argv resumes and finishes
subprocess.run(["cp", "-a", str(out), str(keep)], check=True)
"""


@pytest.mark.slow
def test_a_full_file_system_during_a_checkpoint_or_a_metrics_write_is_one_line_and_loses_nothing(
        tmp_path: Path, data: Path) -> None:
    """The run dir on a small tmpfs (its own mount namespace: real ENOSPC from the kernel). A full
    disk at the step-4 checkpoint, then at a metrics write: each run stops with one line naming
    ENOSPC; the step-2 checkpoint and the metrics already written stay whole, and once there is
    space the same command resumes from step 2 and finishes."""
    if os.geteuid() != 0 or subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("needs root and mount namespaces (unshare -m)")
    (tmp_path / "mnt").mkdir()
    (tmp_path / "logs").mkdir()
    argv = [*FAST_ARGS, "--num-workers", "0", "--ckpt-every", "2", "--export", "off"]
    child = subprocess.run(
        ["unshare", "-m", "--propagation", "private", sys.executable, "-c", FULL_FS_CHILD, str(tmp_path / "mnt"),
         str(data), str(tmp_path / "logs"), str(tmp_path / "kept"), json.dumps(argv)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"})
    assert child.returncode == 0, child.stderr
    runs = {name: json.loads((tmp_path / "logs" / f"{name}.json").read_text())
            for name in ("first", "checkpoint_full", "metrics_full", "after")}
    assert runs["first"]["rc"] == 0 and runs["after"]["rc"] == 0, runs
    for name in ("checkpoint_full", "metrics_full"):
        err = [ln for ln in runs[name]["err"].splitlines() if ln.strip()]
        assert runs[name]["rc"] == 1 and len(err) == 1, (name, runs[name])
        assert "No space left on device" in err[0] and "Traceback" not in runs[name]["err"], (name, err)
    kept = tmp_path / "kept"
    assert "# resumed from" in runs["after"]["out"] and "step_00000002 at step 2" in runs["after"]["out"]
    assert [r["step"] for r in step_records(kept)][-2:] == [3, 4]
    assert 1 in [r["step"] for r in step_records(kept)] and 2 in [r["step"] for r in step_records(kept)]
    assert (kept / "checkpoints" / "latest").read_text().strip() == "step_00000004"
    from train.common.checkpoint import verify
    verify(kept / "checkpoints" / "step_00000004")
    verify(kept / "checkpoints" / "step_00000002")
