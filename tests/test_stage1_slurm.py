"""stage1 through the real embedded Slurm: the guard lets a real allocation in, and a requeued
job (`scontrol requeue`, what submitit does on timeout/preemption) resumes at the same step with
the same next batch. And a run from a local Qwen3.5 checkpoint directory (tests/hf_fixtures.py):
its own tokenizer (a packed batch decodes back to its input text), with the vision tower through
its own image token ids; `launch export` then `from_pretrained`, equal logits; malformed 3D assets
reported as file:line."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from tests.conftest import REPO, run_launch, wait_for_state
from tests.hf_fixtures import document_logits, make_checkpoint
from toolkit.metrics import logged_step_records
from train.common.shapes import get_shape
from train.stage1.data import DataConfig, PackedBatches, build_batch, load_manifests
from train.stage1.model import build_model
from train.stage1.synthetic import generate_synthetic
from train.stage1.tokenizer import build_tokenizer
from train.stage1.train import batch_digest

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


@pytest.fixture()
def stage1_env(slurm_cluster, tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, **slurm_cluster.env(), "LAUNCH_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}
    env.pop("LAUNCH_JOBS_PATH", None)
    return env


def test_requeued_stage1_resumes_with_the_same_next_batch(stage1_env: dict[str, str]) -> None:
    sub = run_launch(["submit", "stage1", "--preset", "tiny", "--cpus-per-task", "2", "--no-preflight",
                      "--arg", "steps=8", "--arg", "row_len=128", "--arg", "batch_rows=1", "--arg", "ckpt_every=2",
                      "--arg", "synthetic_samples=100"], stage1_env)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.splitlines()[0].split()[-1]
    job_dir = Path(stage1_env["LAUNCH_HOME"]) / "runs" / "stage1" / job
    metrics = job_dir / "metrics.jsonl"

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not any(r["step"] >= 3 for r in logged_step_records(metrics)):
        time.sleep(1)
    assert any(r["step"] >= 3 for r in logged_step_records(metrics)), run_launch(["logs", job], stage1_env).stdout[-3000:]
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
    tok = build_tokenizer(get_shape("tiny"), None, vision=True)
    ds = PackedBatches(DataConfig(str(job_dir / "data"), row_len=128, batch_rows=1, seed=0), tok, rank=0)
    recs = [e for e in events if e["event"] == "step"]
    assert sorted({r["step"] for r in recs}) == list(range(1, 9))
    carry, want = [], {}  # one carry chain (one loader worker): each batch opens with the last one's buffer
    for k in range(8):
        batch = build_batch(ds.sampler, ds.tok, ds.cfg, k, carry)
        carry, want[k] = batch["carry_docs"], batch_digest(batch)
    for r in recs:
        assert r["batch_index"] == r["step"] - 1
        assert r["batch_digest"] == want[r["batch_index"]]
    summary = json.loads((job_dir / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["last_loss"] < summary["first_loss"]


def _submit_and_wait(env: dict[str, str], *args: str) -> tuple[str, Path, str]:
    sub = run_launch(["submit", "stage1", "--preset", "tiny", "--cpus-per-task", "2", "--no-preflight",
                      "--arg", "row_len=128", "--arg", "batch_rows=2", "--arg", "ckpt_every=2", *args], env)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.splitlines()[0].split()[-1]
    state = wait_for_state(job, env, {"COMPLETED", "FAILED", "CANCELLED"}, timeout=480)
    log = run_launch(["logs", job], env).stdout
    assert state == "COMPLETED", log[-3000:]
    return job, Path(env["LAUNCH_HOME"]) / "runs" / "stage1" / job, log


def _export_and_compare(env: dict[str, str], job: str, job_dir: Path, ckpt: Path, vision: bool, tasks,
                        data: Path) -> None:
    """`launch export JOB`, from_pretrained, and the logits of the trainer's last checkpoint."""
    out = run_launch(["export", job, "--out", str(job_dir / "exported")], env, timeout=300)
    assert out.returncode == 0, out.stderr
    export = Path(out.stdout.strip().splitlines()[-1])
    cls = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    loaded = cls.from_pretrained(export, local_files_only=True).eval()
    tok = build_tokenizer(get_shape("tiny"), ckpt, vision)
    trainer, _ = build_model("tiny", init_from=ckpt, vision=vision)
    last = (job_dir / "checkpoints" / "latest").read_text().strip()
    trainer.load_state_dict(torch.load(job_dir / "checkpoints" / last / "model.pt", weights_only=True))
    trainer.eval()
    # the last record of each task: the data set's first ones may be broken on purpose
    diff = max((document_logits(loaded, tok, data, t, -1) - document_logits(trainer, tok, data, t, -1)).abs().max().item()
               for t in tasks)
    print(f"launch export ({'vision' if vision else 'text'}): max abs logit diff vs the trainer {diff:.3g}")
    assert diff <= 1e-5


def test_stage1_from_a_local_checkpoint_with_its_tokenizer_then_export(stage1_env, tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt")
    # the job's data dir with two broken 3D assets: a wrong length and a code out of range
    data = tmp_path / "data"
    generate_synthetic(data, samples=60, seed=3)
    bad = []
    for (line_no, rec), arrays in zip(load_manifests(data).records["und"][:2], [
            {"ss": np.zeros(7, np.int16), "shape": np.zeros(10, np.int16), "tex": np.zeros(10, np.int16)},
            {"ss": np.zeros(8, np.int16), "shape": np.zeros(10, np.int16), "tex": np.full(10, 999)}], strict=True):
        np.savez(data / rec["tokens3d"], **arrays)
        bad.append(f"{data / 'und.jsonl'}:{line_no}: ")
    job, job_dir, log = _submit_and_wait(
        stage1_env, "--arg", f"init_from={ckpt}", "--arg", f"data_dir={data}", "--arg", "steps=4",
        "--arg", "max_bad_fraction=0.2", "--arg", "weights={\"und\": 4, \"replay_text\": 1, \"gen_txt\": 1}")
    header = json.loads((job_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert str(ckpt) in header["tokenizer"] and header["vision_params"] == 0
    malformed = [line for line in log.splitlines() if line.startswith("malformed record:")]
    assert any(bad[0] in m and "ss has 7 codes, the asset format wants 8" in m for m in malformed), malformed
    assert any(bad[1] in m and "tex codes out of range [0, 256)" in m for m in malformed), malformed

    # the job's batches decode back to their input text with the checkpoint's tokenizer
    tok = build_tokenizer(get_shape("tiny"), ckpt, vision=False)
    ds = PackedBatches(DataConfig(str(data), row_len=128, batch_rows=2, seed=0,
                                  weights={"und": 4, "replay_text": 1, "gen_txt": 1}), tok, rank=0)
    steps = [json.loads(line) for line in (job_dir / "metrics.jsonl").read_text().splitlines()]
    first = next(r for r in steps if r.get("event") == "step" and r["step"] == 1)
    batch = build_batch(ds.sampler, tok, ds.cfg, 0)
    assert first["batch_digest"] == batch_digest(batch)  # the very batch the job trained on
    texts = {rec["text"] for t in ("und", "replay_text", "gen_txt") for _, rec in load_manifests(data).records[t]}
    docs = [d for row in batch["input_ids"] for d in tok.decode(row.tolist()).split("<|endoftext|>") if d]
    bodies = [d.split("<|3d_end|>")[-1] if d.startswith("<|task_und|>") else d.split("|>", 1)[1].split("<|3d_start|>")[0]
              for d in docs]
    assert sum(b in texts for b in bodies) >= 2, docs
    _export_and_compare(stage1_env, job, job_dir, ckpt, vision=False, tasks=("und", "replay_text"), data=data)


def test_stage1_from_a_local_vision_checkpoint_uses_its_image_token_ids(stage1_env, tmp_path: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "ckpt", vision=True)
    job, job_dir, log = _submit_and_wait(
        stage1_env, "--arg", f"init_from={ckpt}", "--arg", "vision=on", "--arg", "steps=2",
        "--arg", "synthetic_samples=60", "--arg", "weights={\"gen_img\": 1, \"replay_img\": 1}")
    header = json.loads((job_dir / "metrics.jsonl").read_text().splitlines()[0])
    assert header["vision_params"] > 0 and str(ckpt) in header["tokenizer"]
    assert "Traceback" not in log
    config = json.loads((ckpt / "config.json").read_text())
    tok = build_tokenizer(get_shape("tiny"), ckpt, vision=True)
    assert tok.vision_ids["image_token_id"] == config["image_token_id"] == 12  # Qwen's order, not the stand-in's 5
    ds = PackedBatches(DataConfig(str(job_dir / "data"), row_len=128, batch_rows=2, seed=0,
                                  weights={"gen_img": 1, "replay_img": 1}), tok, rank=0)
    batch = build_batch(ds.sampler, tok, ds.cfg, 0)
    n_pad = int((batch["input_ids"] == 12).sum())
    assert n_pad == int(batch["image_grid_thw"].prod(-1).sum()) // 4 > 0
    _export_and_compare(stage1_env, job, job_dir, ckpt, vision=True, tasks=("gen_img", "replay_img"),
                        data=job_dir / "data")
