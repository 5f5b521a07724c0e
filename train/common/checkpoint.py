"""Atomic, verifiable checkpoints.

Layout under `root`:
    step_00000050/            one checkpoint: any files the trainer writes, plus
        MANIFEST.json         sha256 and size of every other file, written last
    latest                    name of the newest whole checkpoint, replaced atomically
    .tmp-step_00000050/       a checkpoint being written (never read; cleaned up on the next save)

A checkpoint becomes visible only by renaming its finished temp directory, and `latest` moves
only after that rename. On load every file is checked against the manifest, so a truncated or
altered file is reported (one line, naming it) instead of being trained from. Resume takes the
newest checkpoint that verifies, whatever `latest` says (a missing or dangling pointer loses
nothing); each manifest names its lineage, and pruning deletes only the run's own lineage.
A newer checkpoint that does not verify is moved aside on resume (`step_00000006.damaged-<time>`,
its files untouched, for whoever wants to recover them), so the resumed run never writes over
it nor prunes it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import pickle
import random
import re
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from toolkit.fsutil import atomic_write_text, disk_full, fsync_path, sha256_file

MANIFEST = "MANIFEST.json"
LATEST = "latest"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be trusted; the message is one line naming the file."""


def _safe_globals() -> list[Any]:
    """The only classes a checkpoint of ours holds besides tensors and plain data: numpy's RNG
    state (an ndarray of uint32), and DeepSpeed's ZeRO bookkeeping in its optimizer files (named
    only when DeepSpeed is already loaded: only its checkpoints need them)."""
    out: list[Any] = [np.ndarray, np.dtype, type(np.dtype(np.uint32)),
                      getattr(np, "_core", getattr(np, "core", None)).multiarray._reconstruct]
    if "deepspeed" in sys.modules:
        from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
        from deepspeed.runtime.zero.config import ZeroStageEnum
        from deepspeed.utils.tensor_fragment import fragment_address
        out += [ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler]
    return out


def _refusal(path: Path | str, exc: pickle.UnpicklingError) -> CheckpointError:
    """torch's weights-only refusal as one line: the file and what it tried to build."""
    text = str(exc)
    named = re.search(r"GLOBAL ([\w.]+)", text) or re.search(r"got <class '([\w.]+)'>", text)
    other = re.search(r"Unsupported operand \d+|WeightsUnpickler error: ([^\n]{1,120})", text)
    what = (f"it names {named.group(1)}" if named else other.group(0).removeprefix("WeightsUnpickler error: ")
            if other else "not torch's format")
    return CheckpointError(f"{path} holds pickled objects that are not tensors or plain data ({what}): refused, "
                           "nothing in it was run; a checkpoint this toolkit writes never holds one (was the file "
                           "put there by someone else?)")


@contextlib.contextmanager
def only_weights(path: Path | str) -> Iterator[None]:
    """Every torch.load inside (DeepSpeed's too, which passes weights_only=False) unpickles tensors
    and plain data only, plus `_safe_globals()`: a crafted file in a run folder never runs code as
    the user. A refusal is one CheckpointError naming `path`."""
    before = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"  # torch reads it at each call, over the argument
    try:
        with torch.serialization.safe_globals(_safe_globals()):
            yield
    except pickle.UnpicklingError as exc:
        raise _refusal(path, exc) from None
    finally:
        if before is None:
            os.environ.pop("TORCH_FORCE_WEIGHTS_ONLY_LOAD", None)
        else:
            os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = before


def load_state(path: Path | str, map_location: Any = "cpu") -> Any:
    """torch.load of a checkpoint file, weights-only (see `only_weights`)."""
    with only_weights(path):
        return torch.load(path, map_location=map_location, weights_only=True)


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
    """Saves and finds checkpoints of one lineage: a run from scratch starts a lineage, a resumed
    run continues the lineage of the checkpoint it resumed from. Pruning deletes only older
    checkpoints of the same lineage, so a run never deletes what another run wrote."""

    def __init__(self, root: str | os.PathLike[str], keep: int = 2, report: Callable[[str], None] = print) -> None:
        self.root = Path(root)
        self.keep = keep
        self.report = report
        self.lineage = uuid.uuid4().hex  # replaced by the resumed checkpoint's in resume()

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
        try:
            write(tmp)
        except (OSError, RuntimeError) as exc:  # torch.save reports a full disk as a RuntimeError
            raise self._write_failed(name, tmp, exc) from exc
        barrier()
        if is_main:
            try:
                return self._commit(step, name, tmp, final, barrier)
            except OSError as exc:
                raise self._write_failed(name, tmp, exc) from exc
        barrier()
        return final

    def _write_failed(self, name: str, tmp: Path, exc: BaseException) -> BaseException:
        """A full (or failing) disk while a checkpoint is written: the partial one goes (it is
        never read, and its space lets outcome.json be written), the earlier ones stay."""
        try:  # measured before the partial checkpoint goes: its deletion frees the space it filled
            st = os.statvfs(self.root)
            free = st.f_bavail * st.f_frsize
        except OSError:
            free = -1
        shutil.rmtree(tmp, ignore_errors=True)
        full = disk_full(exc) or 0 <= free < (1 << 20)
        if not full and not isinstance(exc, OSError):
            return exc  # not a storage problem: the trainer's own error, unchanged
        kept = [p.name for p in self.step_dirs()]
        why = os.strerror(errno.ENOSPC) if full else (getattr(exc, "strerror", None) or str(exc))
        room = f"{free >> 20} MiB" if free >= 1 << 20 else f"{max(free, 0) >> 10} KiB"
        return CheckpointError(f"cannot write checkpoint {name} in {self.root}: {why} ({room} free); "
                               f"nothing else was touched (checkpoints kept: {', '.join(kept) or 'none'})")

    def _commit(self, step: int, name: str, tmp: Path, final: Path, barrier: Callable[[], None]) -> Path:
        """The main rank: manifest, fsync, rename, `latest`, prune."""
        files = {}
        for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
            fsync_path(path)
            files[str(path.relative_to(tmp))] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
        manifest = {"step": step, "lineage": self.lineage, "files": files}
        atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1))
        for sub in sorted({p for p in tmp.rglob("*") if p.is_dir()}, reverse=True):
            fsync_path(sub)
        if final.exists():
            if _lineage(final) == self.lineage and _verifies(final):
                shutil.rmtree(final)  # same step saved again (final save after a periodic one)
            elif _lineage(final) == self.lineage:  # ours but damaged: kept, as on resume
                aside = self._set_aside(final)
                self.report(f"# {final.name} does not verify; kept as {aside}")
            else:  # not ours (another run's, or damaged): kept under another name
                aside = _free_name(final, "replaced")
                os.replace(final, aside)
                self.report(f"# {final.name} was not written by this run; kept as {aside.name}")
        os.replace(tmp, final)
        fsync_path(self.root)
        atomic_write_text(self.root / LATEST, name + "\n")
        self._prune(keep_name=name)
        barrier()
        return final

    def _prune(self, keep_name: str) -> None:
        mine = [p for p in self.step_dirs() if _lineage(p) == self.lineage]
        for old in mine[: max(0, len(mine) - self.keep)]:
            if old.name != keep_name:
                shutil.rmtree(old, ignore_errors=True)

    def step_dirs(self) -> list[Path]:
        """Checkpoint directories, oldest step first."""
        return sorted(p for p in self.root.glob("step_*") if p.is_dir() and p.name[5:].isdigit())

    def _set_aside(self, path: Path) -> Path:
        base = f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}"
        aside, n = path.with_name(base), 1
        while aside.exists():
            n += 1
            aside = path.with_name(f"{base}-{n}")
        os.replace(path, aside)
        fsync_path(self.root)
        return aside

    def latest(self, say_skipped: bool = True) -> Path | None:
        """The newest checkpoint that verifies, whatever `latest` says; None when there is none at all.

        A newer checkpoint that does not verify is reported (unless `say_skipped` is False: resume
        says it once, with where it went) and passed over. When checkpoints exist but none verifies,
        CheckpointError: a run never starts from scratch over them by itself.
        """
        if self.root.exists() and not self.root.is_dir():
            raise CheckpointError(f"{self.root} is not a directory: checkpoints cannot be kept there (move it away)")
        dirs = self.step_dirs()
        problems: list[CheckpointError] = []
        for path in reversed(dirs):
            try:
                verify(path)
            except CheckpointError as exc:
                problems.append(exc)
                continue
            for exc in problems if say_skipped else ():
                self.report(f"# skipping a newer checkpoint that does not verify: {exc}")
            pointer = self.root / LATEST
            named = pointer.read_text(errors="replace").strip() if pointer.is_file() else None
            if named != path.name:
                self.report(f"# {pointer} names {named!r}; resuming from {path.name}, the newest that verifies")
            return path
        if problems:
            older = f" (nor do {', '.join(p.name for p in dirs[-2::-1])})" if len(dirs) > 1 else ""
            raise CheckpointError(f"{problems[0]}; no checkpoint in {self.root} verifies{older} "
                                  "(--restart starts over and keeps them aside)")
        return None

    def resume(self, is_main: bool = True) -> Path | None:
        """latest(), and continue its lineage. The main rank moves every newer checkpoint that
        does not verify aside (never deleted: the run would otherwise write its step anew over
        it) and says where it went."""
        path = self.latest(say_skipped=not is_main)
        if path is not None:
            self.lineage = _lineage(path) or self.lineage
            if is_main:
                for damaged in [d for d in self.step_dirs() if d.name > path.name]:
                    try:
                        verify(damaged)
                        continue  # appeared since latest() looked (another writer): not ours to move
                    except CheckpointError as exc:
                        why = str(exc)
                    aside = self._set_aside(damaged)
                    self.report(f"# {damaged.name} does not verify ({why.split(';')[0]}); moved to {aside} "
                                f"(kept, never overwritten); resuming from {path.name}")
        return path

    def restart(self) -> Path | None:
        """Start over: move every existing checkpoint aside (nothing is deleted); return where."""
        if not self.root.exists() or not (self.step_dirs() or (self.root / LATEST).exists()):
            return None
        aside = _free_name(self.root, "restarted")
        os.replace(self.root, aside)
        return aside


def _lineage(path: Path) -> str | None:
    try:
        return json.loads((path / MANIFEST).read_text()).get("lineage")
    except (OSError, ValueError, AttributeError):
        return None


def _free_name(path: Path, why: str) -> Path:
    n = 1
    while (candidate := path.with_name(f"{path.name}.{why}-{n}")).exists():
        n += 1
    return candidate


def _verifies(path: Path) -> bool:
    try:
        verify(path)
    except CheckpointError:
        return False
    return True


def verify(path: Path) -> dict[str, Any]:
    """Check every file of a checkpoint against its manifest; return the manifest."""
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise CheckpointError(f"{manifest_path} is missing: checkpoint {path} is partial; delete it to start over")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = {str(rel): (int(meta["bytes"]), str(meta["sha256"])) for rel, meta in manifest["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:  # ValueError: bad JSON or not UTF-8
        raise CheckpointError(f"{manifest_path} is unreadable ({exc}); delete checkpoint {path}") from None
    for rel, (size, sha256) in files.items():
        f = path / rel
        if not f.is_file():
            raise CheckpointError(f"{f} is missing from checkpoint {path} (listed in its manifest)")
        if f.stat().st_size != size or sha256_file(f) != sha256:
            raise CheckpointError(f"{f} is corrupt (size/sha256 differ from {MANIFEST}); delete checkpoint {path}")
    return manifest
