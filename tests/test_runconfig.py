"""The run's resolved config.yaml (launch/runconfig.py): written by the job's main task before the
entrypoint starts, read back with YAML's own loader and compared with what the trainer's own
parser resolves from the same command line."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from launch import runconfig
from launch.jobspec import find_spec
from launch.runner import EntrypointRun


def test_config_yaml_is_every_resolved_argument_the_resources_and_versions(tmp_path: Path, monkeypatch) -> None:
    spec = find_spec("stage1")
    job = spec.resolve("tiny")
    run_dir = tmp_path / "run"
    argv = job.argv(["--out", str(run_dir), "--steps", "7"])
    monkeypatch.setenv("LAUNCH_JOB_DIR", str(tmp_path / "job"))
    monkeypatch.setenv("SLURM_JOB_ID", "4242")
    meta = {"job": spec.name, "preset": job.preset, "spec": str(spec.source), "resources": dataclasses.asdict(job.resources)}
    EntrypointRun(spec.entrypoint, argv, spec.name, meta=meta).write_config(task=0)

    path = run_dir / "config.yaml"  # next to the checkpoints: the trainer's --out, not the job folder
    assert path.is_file() and not (tmp_path / "job" / "config.yaml").exists()
    back = yaml.safe_load(path.read_text())
    from train.stage1.train import parse_args

    oracle = dataclasses.asdict(parse_args(argv))
    assert set(back["args"]) == set(oracle)  # every argument, defaults included
    assert back["args"]["steps"] == 7 and back["args"]["shape"] == oracle["shape"] == "tiny"
    assert {k: back["args"][k] for k in oracle} == runconfig.plain(oracle)
    assert back["resources"] == dataclasses.asdict(job.resources)
    assert back["job"] == "stage1" and back["preset"] == "tiny" and back["job_id"] == "4242"
    assert back["argv"] == argv and back["spec"] == str(spec.source)
    import torch

    assert back["versions"]["torch"] == torch.__version__
    assert runconfig.read(run_dir) == back
    lines = runconfig.summary(back)
    assert lines[0].startswith("resources: 1 node(s) x 0 GPU") and any(f"torch {torch.__version__}" in ln for ln in lines)


def test_a_worker_task_writes_none_and_a_bad_argv_is_one_line(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.setenv("LAUNCH_JOB_DIR", str(tmp_path))
    EntrypointRun("train.stage1", ["--steps", "1"], "stage1", main_task=0).write_config(task=1)
    assert not (tmp_path / "config.yaml").exists()
    EntrypointRun("train.stage1", ["--no-such-flag"], "stage1").write_config(task=0)
    err = capsys.readouterr().err.strip().splitlines()
    assert not (tmp_path / "config.yaml").exists()
    assert err[-1].startswith("[launch] config.yaml not written: "), err
