"""Atomic, verifiable checkpoints.

Layout under `root`:
    step_00000050/            one checkpoint: any files the trainer writes, plus
        MANIFEST.json         sha256 and size of every other file, written last
    latest                    name of the newest whole checkpoint, replaced atomically
    .tmp-step_00000050/       a checkpoint being written (never read; cleaned up on the next save)

A checkpoint becomes visible only by renaming its finished temp directory, and `latest` moves
only after that rename. On load every file is checked against the manifest, so a truncated or
altered file is reported (one line, naming it) instead of being trained from.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from toolkit.fsutil import atomic_write_text, fsync_path, sha256_file

MANIFEST = "MANIFEST.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted; the message is one line naming the file."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    def __init__(self, root: str | os.PathLike[str], keep: int = 2) -> None:
        self.root = Path(root)
        self.keep = keep

    def save(
        self,
        step: int,
        write: Callable[[Path], None],
        is_main: bool = True,
        barrier: Callable[[], None] = lambda: None,
    ) -> Path:
        """Every rank calls save; `write(tmp_dir)` writes this rank's files into the temp dir.

        The main rank then writes the manifest, fsyncs, renames, and moves `latest`.
        """
        name = step_dir_name(step)
        tmp = self.root / f".tmp-{name}"
        final = self.root / name
        if is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".tmp-step_*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
        barrier()
        write(tmp)
        barrier()
        if is_main:
            files = {}
            for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
                fsync_path(path)
                files[str(path.relative_to(tmp))] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
            manifest = {"step": step, "files": files}
            atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1))
            for sub in sorted({p for p in tmp.rglob("*") if p.is_dir()}, reverse=True):
                fsync_path(sub)
            if final.exists():  # same step saved again (e.g. final save right after a periodic one)
                shutil.rmtree(final)
            os.replace(tmp, final)
            fsync_path(self.root)
            atomic_write_text(self.root / LATEST, name + "\n")
            self._prune(keep_name=name)
        barrier()
        return final

    def _prune(self, keep_name: str) -> None:
        done = sorted(p for p in self.root.glob("step_*") if p.is_dir())
        for old in done[: max(0, len(done) - self.keep)]:
            if old.name != keep_name:
                shutil.rmtree(old, ignore_errors=True)

    def latest(self) -> Path | None:
        """The verified newest checkpoint, None if there is none; CheckpointError if it is damaged."""
        pointer = self.root / LATEST
        if not pointer.exists():
            return None
        name = pointer.read_text().strip()
        path = self.root / name
        if not name or not path.is_dir():
            raise CheckpointError(f"{pointer} names {name!r}, which is not a checkpoint directory")
        verify(path)
        return path


def verify(path: Path) -> dict[str, Any]:
    """Check every file of a checkpoint against its manifest; return the manifest."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path} is missing: checkpoint {path} is partial; delete it to start over")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{manifest_path} is unreadable ({exc}); delete checkpoint {path}") from None
    for rel, meta in files.items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{f} is missing from checkpoint {path} (listed in its manifest)")
        if f.stat().st_size != meta["bytes"] or sha256_file(f) != meta["sha256"]:
            raise CheckpointError(f"{f} is corrupt (size/sha256 differ from {MANIFEST}); delete checkpoint {path}")
    return manifest
