"""Shared helpers for the stage-1 trainer tests: a tiny synthetic dataset and a short run."""

from __future__ import annotations

import json
from pathlib import Path

from train.stage1.synthetic import generate_synthetic
from train.stage1.train import main

# Small enough for the shared 2-core CI machine: 1 row of 128 tokens a step.
FAST_ARGS = ["--shape", "tiny", "--batch-rows", "1", "--row-len", "128", "--num-workers", "1", "--lr", "3e-3",
             "--warmup", "3"]


def make_data(root: Path) -> Path:
    data = root / "data"
    if not (data / "gen_img.jsonl").exists():
        generate_synthetic(data, samples=100, seed=0)
    return data


def run(out: Path, data: Path, steps: int, *extra: str) -> int:
    return main([*FAST_ARGS, "--out", str(out), "--data-dir", str(data), "--steps", str(steps), *extra], guard=False)


def step_records(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("event") == "step"]
