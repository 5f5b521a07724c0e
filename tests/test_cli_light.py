"""Refusals and dry runs answer in about a second: `launch submit` vets a job's arguments with the
entrypoint's light `args` module (train.<job>.args: its config dataclass, parse and checks), so
neither torch nor transformers nor the trainer is imported there; they load only where a job runs
(and transformers where an `--init-from` config.json is checked). The oracle is `sys.modules` of a
fresh interpreter after each command, not a stopwatch (a loaded CI machine makes timings noise)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

from tests.conftest import REPO

HEAVY = ("torch", "transformers", "deepspeed", "train.stage1.train", "train.dflash.train", "train.extract.extract",
         "train.regen.regen")
COMMANDS = {
    # one refusal of each trainer's own parse, one of its own checks, and a dry run
    "stage1-unknown-arg": ["submit", "stage1", "--preset", "tiny", "--dry-run", "--arg", "bogus=1"],
    "stage1-bad-value": ["submit", "stage1", "--preset", "tiny", "--dry-run", "--arg", "lr=-1"],
    "stage1-image-tasks-text-only": ["submit", "stage1", "--preset", "tiny", "--dry-run", "--arg", "vision=off"],
    "stage1-dry-run": ["submit", "stage1", "--preset", "tiny", "--dry-run"],
    "dflash-bad-topology": ["submit", "dflash", "--preset", "tiny-online", "--dry-run", "--arg", "topology=3-0"],
    "dflash-dry-run": ["submit", "dflash", "--preset", "tiny", "--dry-run", "--arg", "data=/nonexistent"],
    "extract-bad-value": ["submit", "extract", "--preset", "tiny", "--dry-run", "--arg", "max_len=1"],
    "regen-no-target": ["submit", "regen", "--preset", "tiny", "--dry-run"],
    "status-no-slurm": ["status"],
}
PROBE = textwrap.dedent("""
    import contextlib, io, json, sys
    from launch.cli import main
    heavy, seen = json.loads(sys.argv[1]), {}
    for name, argv in json.loads(sys.argv[2]).items():
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                rc = main(argv)
            except SystemExit as exc:
                rc = exc.code
        seen[name] = {"rc": rc, "stderr": err.getvalue()[-300:], "heavy": [m for m in heavy if m in sys.modules]}
    print(json.dumps(seen))
""")


def test_refusals_and_dry_runs_import_no_torch_transformers_or_trainer(tmp_path):
    env = {**os.environ, "LAUNCH_HOME": str(tmp_path / "home"), "SLURM_CONF": str(tmp_path / "no-slurm.conf"),
           "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(HEAVY), json.dumps(COMMANDS)], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    seen = json.loads(out.stdout)
    for name, got in seen.items():
        # each one answered (refused, or a dry run against no Slurm) and loaded nothing heavy
        assert got["rc"] not in (None,), (name, got)
        assert got["heavy"] == [], f"{name}: imported {got['heavy']} ({got['stderr']!r})"
    assert seen["stage1-unknown-arg"]["rc"] == 2 and "unknown argument(s): --arg bogus=1" in seen["stage1-unknown-arg"]["stderr"]
    assert "--arg lr must be a positive number" in seen["stage1-bad-value"]["stderr"]
    assert "carry images but --arg vision=off" in seen["stage1-image-tasks-text-only"]["stderr"]
    assert "--arg topology must be 'k-m'" in seen["dflash-bad-topology"]["stderr"]
    assert "--arg max_len must be" in seen["extract-bad-value"]["stderr"]
    assert "regen: needs --arg init_from=" in seen["regen-no-target"]["stderr"]


def test_status_with_slurmctld_down_asks_scontrol_ping_not_squeue(tmp_path):
    """squeue retries a dead controller for ~18 s (MessageTimeout's default 10 s, then more);
    `scontrol ping` says DOWN at once, so status and list skip squeue and say so in one line.
    The oracle: a pass-through `squeue` first on PATH (it runs the real one) never runs."""
    import shutil

    import pytest

    real = shutil.which("squeue")
    if real is None or shutil.which("scontrol") is None:
        pytest.skip("no Slurm clients here")
    spy = tmp_path / "bin"
    spy.mkdir()
    (spy / "squeue").write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/squeue-ran\nexec {real} "$@"\n')
    (spy / "squeue").chmod(0o755)
    home = tmp_path / "home"
    home.mkdir()
    # the controller's port (9, discard) is closed here; MessageTimeout left at Slurm's default
    (tmp_path / "dead.conf").write_text("ClusterName=dead\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=9\n"
                                        "AuthType=auth/none\nCredType=cred/none\n"
                                        "NodeName=n1 NodeAddr=127.0.0.1 CPUs=1 State=UNKNOWN\nPartitionName=p Nodes=n1\n")
    (home / "jobs.jsonl").write_text(json.dumps({"job_id": "1", "name": "fixture", "preset": None, "folder": str(tmp_path / "runs" / "1"),
                                                 "submitted_at": 0.0, "slurm_conf": str(tmp_path / "dead.conf"), "argv": []}) + "\n")
    env = {**os.environ, "LAUNCH_HOME": str(home), "SLURM_CONF": str(tmp_path / "dead.conf"), "PYTHONPATH": str(REPO),
           "PATH": f"{spy}{os.pathsep}{os.environ['PATH']}"}
    for argv in (["status", "1"], ["list"]):
        out = subprocess.run([sys.executable, "-m", "launch", *argv], env=env, cwd=tmp_path, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode != 0 and "Slurm not reachable (Unable to contact slurm controller (Slurmctld(primary) at " \
            in out.stderr and "is DOWN))" in out.stderr, out.stderr
    assert not (tmp_path / "squeue-ran").exists()


def test_a_data_dir_absent_here_is_refused_for_the_embedded_cluster_and_named_for_another(tmp_path, capsys):
    """The embedded cluster's nodes are this machine: a path absent here can never be read by the
    job, so it is refused before queueing; on another cluster it may exist on the nodes only, and
    the submit goes on with a warning naming it (the corpus holds the present-but-wrong cases)."""
    import pytest

    from launch.errors import LaunchError
    from launch.jobspec import find_spec
    from launch.submit import check_entrypoint_args, check_input_paths

    for job, argv, flag in (("stage1", ["--data-dir", str(tmp_path / "nowhere")], "--arg data_dir="),
                            ("dflash", ["--data", str(tmp_path / "nowhere")], "--arg data=")):
        spec = find_spec(job)
        parsed = check_entrypoint_args(spec, argv)
        with pytest.raises(LaunchError, match=rf"{job}: {flag}\S+/nowhere does not exist, and the embedded "
                                              r"cluster's jobs run on this machine; nothing submitted"):
            check_input_paths(spec, parsed, embedded=True)
        check_input_paths(spec, parsed, embedded=False)
        assert f"warning: {flag}{tmp_path}/nowhere does not exist on this machine" in capsys.readouterr().err


def test_gpu_presets_on_stand_in_gpus_are_refused_with_the_real_reason():
    """Without the NVIDIA driver the embedded cluster's GPUs are stand-ins: a preset whose work needs
    a GPU (a 2B shape, a real target) is refused naming that, whatever the cluster's size, so a
    bigger `cluster up --gpus 8` is never the way; the CPU presets that use GPUs as a task count
    (DFlash tiny-online's 2-1) still go through, and nothing is refused where real GPUs are."""
    from launch.jobspec import find_spec
    from launch.submit import check_entrypoint_args, stand_in_refusal

    def refusal(name: str, preset: str, real_gpus: bool = False) -> str | None:
        spec = find_spec(name)
        job = spec.resolve(preset)
        return stand_in_refusal(spec, job, check_entrypoint_args(spec, job.argv(), job.resources.total_tasks), real_gpus)

    said = refusal("stage1", "qwen35-2b")
    assert said == ("--preset qwen35-2b needs real GPUs (model shape qwen35-2b), and this machine has no NVIDIA driver: "
                    "the embedded cluster's GPUs are stand-in devices that model Slurm's allocation only; here, use a CPU "
                    "preset (`launch submit stage1 --list-presets`: tiny), or submit to a GPU cluster")
    assert "cluster up" not in said
    assert "(the online target qwen35-2b)" in refusal("dflash", "online-6-1")
    assert "(the target qwen35-2b)" in refusal("extract", "qwen35-2b")
    assert refusal("stage1", "qwen35-2b", real_gpus=True) is None
    assert refusal("dflash", "tiny-online") is None and refusal("stage1", "tiny") is None
