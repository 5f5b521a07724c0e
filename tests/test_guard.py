"""The Slurm-only guard: `python -m train.stage1` outside a real allocation is refused.

These run outside any Slurm job. The faked-SLURM_* case runs the real `scontrol` (Debian's
slurm-client) with an empty SLURM_CONF, so it fails fast and deterministically
whatever other clusters run on the machine; the lead's embedded-cluster tests cover a controller
that does not know the job. The job-state logic uses a stand-in scontrol script (no cluster
needed to produce PENDING/COMPLETED states on demand).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from train.common.slurm_guard import NotInSlurmAllocation, check_slurm_allocation

REPO = Path(__file__).resolve().parents[1]


def _run_stage1(tmp_path: Path, extra_env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(extra_env, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-m", "train.stage1", "--shape", "tiny", "--steps", "1", "--out", str(tmp_path / "run")],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
    )


def _assert_refused(proc: subprocess.CompletedProcess[str], tmp_path: Path) -> None:
    assert proc.returncode == 3, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("train.stage1: refusing to run outside a Slurm allocation: ")
    assert "keepalive GPU holders yield GPUs only to Slurm jobs" in lines[0]
    assert "launch submit" in lines[0]
    assert not (tmp_path / "run").exists()  # refused before touching anything


def test_direct_run_is_refused(tmp_path: Path) -> None:
    proc = _run_stage1(tmp_path, {})
    _assert_refused(proc, tmp_path)
    assert "no SLURM_JOB_ID" in proc.stderr


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="needs scontrol (slurm-client)")
def test_faked_job_id_is_refused(tmp_path: Path) -> None:
    no_cluster = tmp_path / "slurm.conf"
    no_cluster.write_text("")  # scontrol fails at once (a missing file it retries for 60 s)
    proc = _run_stage1(tmp_path, {"SLURM_JOB_ID": "123", "SLURM_STEP_ID": "0", "SLURM_JOB_NODELIST": "localhost",
                                  "SLURM_CONF": str(no_cluster)})
    _assert_refused(proc, tmp_path)
    assert "Slurm does not confirm job 123" in proc.stderr


def test_job_id_without_step_or_batch_is_refused() -> None:
    with pytest.raises(NotInSlurmAllocation, match="neither SLURM_STEP_ID nor SLURM_JOB_NODELIST"):
        check_slurm_allocation({"SLURM_JOB_ID": "1", "PATH": os.environ.get("PATH", "")})


def _fake_scontrol(tmp_path: Path, state: str) -> str:
    """A stand-in scontrol on PATH: lets the state logic be tested without a cluster."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "scontrol"
    script.write_text(f"#!/bin/sh\necho \"JobId=$3 JobName=x\"\necho \"   JobState={state} Reason=None\"\n")
    script.chmod(0o755)
    return f"{bindir}:/usr/bin:/bin"


@pytest.mark.parametrize("state,ok", [("RUNNING", True), ("PENDING", False), ("COMPLETED", False)])
def test_job_state_must_be_running(tmp_path: Path, state: str, ok: bool) -> None:
    env = {"SLURM_JOB_ID": "77", "SLURM_STEP_ID": "0", "PATH": _fake_scontrol(tmp_path, state)}
    if ok:
        assert check_slurm_allocation(env) == "77"
    else:
        with pytest.raises(NotInSlurmAllocation, match=f"Slurm job 77 is {state}, not RUNNING"):
            check_slurm_allocation(env)


def test_unknown_model_shape_is_one_line_exit_2(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = str(REPO)
    proc = subprocess.run([sys.executable, "-m", "train.stage1", "--shape", "huge"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip() == "train.stage1: error: unknown model shape 'huge'; valid shapes: tiny, qwen35-0.8b, qwen35-2b"
