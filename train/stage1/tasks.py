"""Stage-1 tasks, mixture weights and the data directory's first check: what `launch submit`
needs to vet the arguments, without torch (train.stage1.data, which reads the data, re-exports
these names)."""

from __future__ import annotations

import math
import os
from pathlib import Path

TASKS: tuple[str, ...] = ("gen_img", "gen_txt", "und", "replay_img", "replay_text")
REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "gen_img": ("id", "image", "tokens3d"),
    "gen_txt": ("id", "text", "tokens3d"),
    "und": ("id", "tokens3d", "text"),
    "replay_img": ("id", "image", "text"),
    "replay_text": ("id", "text"),
}
# Sample counts of the reference run (1.35M samples), used as default mixture weights.
REFERENCE_COUNTS: dict[str, int] = {
    "gen_img": 294_000, "gen_txt": 293_000, "und": 293_000, "replay_img": 320_000, "replay_text": 150_000,
}
IMAGE_TASKS = ("gen_img", "replay_img")

class DataError(RuntimeError):
    """Data that cannot be trained on; message is one line saying what and where."""


def check_data_dir(root: str | os.PathLike[str]) -> Path:
    """DataError unless `root` is a directory holding at least one task manifest."""
    root = Path(root)
    if not root.exists():
        raise DataError(f"data directory {root} does not exist")
    if not root.is_dir():
        raise DataError(f"data directory {root} is not a directory")
    if not any((root / f"{task}.jsonl").is_file() for task in TASKS):
        raise DataError(f"no stage-1 manifests in {root} (expected one or more of "
                        f"{', '.join(t + '.jsonl' for t in TASKS)})")
    return root


def image_tasks_weighted(weights: dict[str, float] | None) -> list[str]:
    """The image tasks with positive weight in ``weights`` (None: the default mixture, all of them)."""
    weights = REFERENCE_COUNTS if weights is None else weights
    return [t for t in IMAGE_TASKS if weights.get(t, 0) > 0]


def check_weights(weights: dict[str, float]) -> None:
    """DataError (one line) unless the mixture weights name known tasks, are finite, >= 0, sum > 0."""
    unknown = sorted(set(weights) - set(TASKS))
    if unknown:
        raise DataError(f"unknown task(s) {', '.join(unknown)}; known: {', '.join(TASKS)}")
    bad = [f"{t} {w}" for t, w in weights.items() if w < 0 or not math.isfinite(w)]
    if bad:
        raise DataError(f"mixture weights must be finite and >= 0, got {', '.join(bad)}")
    if sum(weights.values()) <= 0:
        raise DataError("mixture weights sum to 0; give at least one task a positive weight")
