"""The runtime the trainers share: device and ranks from the Slurm layout, the metrics logger,
checkpoint wiring, non-finite step policy, SIGTERM, and the summary.json / outcome.json at the end.

A trainer reads as

    with Runtime.start("train.x", SCHEMAS["x"], cfg.out) as rt:
        state = setup(cfg, rt)            # model, data, Stepper, rt.resume(...)
        while rt.step < cfg.steps:
            step(state, rt)               # one batch; rt.step += 1; rt.check_finite(...)
        finish(state, rt)                 # rt.finish(summary)

Leaving the `with` writes outcome.json (completed / failed with the one-line error / cancelled
at step N) and shuts the process group down; an exception then reaches the entrypoint, which
prints it as one line.
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from toolkit.fsutil import atomic_write_text
from toolkit.metrics import Schema
from toolkit.outcome import run_kind, write_outcome
from toolkit.runlock import Held, RunFolderBusy, RunFolderLost, acquire, check_held, release
from train.common.checkpoint import CheckpointManager
from train.common.config import ConfigError
from train.common.distributed import DistInfo, init_distributed, shutdown_distributed
from train.common.metrics import MetricsLogger


def _lock_run_folder(out_dir: Path, dist_info: DistInfo, logger_rank: int, trainer: str) -> Held | None:
    """The logging rank takes the run folder's lock (toolkit.runlock) and checks the folder is not
    another trainer's run (toolkit.outcome.run_kind); every rank learns whether it could, so a
    refused job ends at once on all of them with the same line."""
    fd, error = None, None
    if dist_info.rank == logger_rank:
        try:
            fd = acquire(out_dir)
            kind = run_kind(out_dir)
            if kind is not None and kind != trainer:
                error = (f"--out {out_dir} holds a {kind} run (its outcome.json / metrics.jsonl); a run folder "
                         f"belongs to one trainer, and this {trainer} run would replace its summary, outcome and "
                         "metrics: give another --out")
        except RunFolderBusy as exc:
            error = str(exc)
        except OSError as exc:
            error = f"--out {out_dir}: cannot lock the run folder ({exc.strerror or exc})"
    if dist_info.world_size > 1 and torch.distributed.is_initialized():
        shared = [error]
        torch.distributed.broadcast_object_list(shared, src=logger_rank)
        error = shared[0]
    if error:
        release(fd)
        shutdown_distributed(dist_info)
        raise ConfigError(error)
    return fd


class Cancelled(Exception):
    """SIGTERM (scancel, a preemption): the run stops where it is; outcome.json says at which step."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(f"cancelled at step {step} ({signal.Signals(signum).name})")
        self.signum = signum


class NonFiniteStep(RuntimeError):
    """A non-finite loss or gradient norm beyond what --max-bad-steps allows."""


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@dataclass
class Runtime:
    name: str
    schema: Schema
    device: torch.device
    dist: DistInfo
    out: Path
    log: MetricsLogger
    is_logger: bool  # the rank that logs and writes summary/outcome (rank 0; DFlash: the drafter)
    max_bad_steps: int = 0
    step: int = 0
    bad_steps: int = 0
    ckpts: CheckpointManager | None = None
    last_checkpoint: Path | None = None
    extra_outcome: dict[str, Any] = field(default_factory=dict)
    lock: Held | None = None  # the run folder's lock, on the logger rank (toolkit.runlock)
    logger_rank: int = 0

    @classmethod
    @contextmanager
    def start(cls, name: str, schema: Schema, out: str | os.PathLike[str], *, tasks: tuple[str, ...] = (),
              force_group: bool = False, log_rank: int | None = 0, max_bad_steps: int = 0,
              tensorboard: bool = False, wandb_project: str | None = None) -> Iterator[Runtime]:
        """log_rank=None: the last rank logs (DFlash's drafter)."""
        out_dir = Path(out)
        if out_dir.exists() and not out_dir.is_dir():
            raise ConfigError(f"--out {out}: a file, not a directory; give the run's directory")
        try:  # before anything starts: a run directory that cannot be made is a bad --out
            out_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ConfigError(f"--out {out_dir}: cannot create the run directory ({exc.strerror})") from None
        device = pick_device()
        dist_info = init_distributed(device, force_group=force_group)
        if device.type == "cuda":
            device = torch.device("cuda", dist_info.local_rank)
        logger_rank = dist_info.world_size - 1 if log_rank is None else log_rank
        is_logger = dist_info.rank == logger_rank
        # One trainer per run folder, before anything is written in it (metrics, checkpoints,
        # outcome.json): a refused run leaves the holder's files as they are.
        lock = _lock_run_folder(out_dir, dist_info, logger_rank, schema.trainer)
        try:
            log = MetricsLogger(out_dir, schema, tasks, enabled=is_logger, tensorboard=tensorboard,
                                wandb_project=wandb_project)
        except BaseException:
            release(lock)
            raise
        rt = cls(name, schema, device, dist_info, out_dir, log, is_logger, max_bad_steps, lock=lock,
                 logger_rank=logger_rank)
        previous = rt._catch_sigterm()
        try:
            yield rt
        except Cancelled as exc:
            rt._outcome("cancelled", str(exc))
            raise
        except BaseException as exc:
            rt._outcome("failed", (str(exc).strip().splitlines() or [type(exc).__name__])[0], always=True)
            raise
        else:
            rt._outcome("completed")
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
            log.close()
            release(lock)
            shutdown_distributed(dist_info)

    # --- ranks

    def barrier(self) -> None:
        if self.dist.world_size > 1 or self.dist.initialized_here:
            torch.distributed.barrier()

    def print(self, line: str) -> None:
        self.log.print(line)

    # --- checkpoints

    def checkpoints(self, keep: int = 2, restart: bool = False) -> tuple[CheckpointManager, Path | None]:
        """The run's CheckpointManager and the checkpoint to resume from (None: from scratch).

        restart: existing checkpoints are moved aside first (by the main rank), never deleted.
        """
        self.ckpts = CheckpointManager(self.out / "checkpoints", keep=keep, report=self.print)
        if restart:
            if self.dist.is_main:
                aside = self.ckpts.restart()
                if aside is not None:
                    self.print(f"# --restart: the earlier checkpoints are kept in {aside}")
            self.barrier()
        latest = self.ckpts.resume(is_main=self.dist.is_main)
        self.last_checkpoint = latest
        self.barrier()  # every rank has found its start before any rank may write a newer checkpoint
        return self.ckpts, latest

    def save(self, write: Any, barrier: bool = True) -> Path:
        """Checkpoint the current step: `write(tmp_dir)` on every rank (barrier=False: the logger rank alone)."""
        assert self.ckpts is not None, "call rt.checkpoints() first"
        self._check_lock(barrier)
        if barrier:
            path = self.ckpts.save(self.step, write, is_main=self.dist.is_main, barrier=self.barrier)
        else:
            path = self.ckpts.save(self.step, write, is_main=True)
        self.last_checkpoint = path
        return path

    def _check_lock(self, collective: bool) -> None:
        """The run folder is still the one this run locked (toolkit.runlock.check_held), asked
        before each checkpoint by the rank holding it; with `collective`, every rank learns the
        answer, so all stop together, before any writes."""
        error = None
        if self.lock is not None:
            try:
                check_held(self.lock)
            except (RunFolderLost, RunFolderBusy, OSError) as exc:
                error = str(exc)
        if collective and self.dist.world_size > 1 and torch.distributed.is_initialized():
            shared = [error]
            torch.distributed.broadcast_object_list(shared, src=self.logger_rank)
            error = shared[0]
        if error:
            raise RunFolderLost(error)

    # --- the step policy

    def check_finite(self, loss: float | None, grad_norm: float | None, skipped: bool) -> bool:
        """True when the step was good. A non-finite loss or grad norm counts as a bad step; past
        --max-bad-steps (or when the update could not be skipped) the run stops with one line."""
        values = {"loss": loss, "grad norm": grad_norm}
        bad = {k: v for k, v in values.items() if v is not None and not math.isfinite(v)}
        if not bad:
            return True
        self.bad_steps += 1
        what = ", ".join(f"{k} {v}" for k, v in bad.items())
        if skipped and self.bad_steps <= self.max_bad_steps:
            self.print(f"# step {self.step}: {what}; update skipped ({self.bad_steps} of {self.max_bad_steps} "
                       "allowed by --max-bad-steps)")
            self.log.event("skipped_step", step=self.step, loss=loss, grad_norm=grad_norm)
            return False
        last = f"last good checkpoint: {self.last_checkpoint}" if self.last_checkpoint else "no checkpoint written yet"
        raise NonFiniteStep(f"step {self.step}: {what}; stopped ({last}). Lower --lr, or let "
                            "--max-bad-steps N skip a few bad steps")

    # --- the end

    def finish(self, summary: dict[str, Any]) -> None:
        """summary.json (atomic, by the logging rank) and the `# done:` line."""
        if self.is_logger:
            atomic_write_text(self.out / "summary.json", json.dumps(summary, indent=1) + "\n")
            self.print(f"# done: {json.dumps(summary)}")

    def _outcome(self, state: str, error: str | None = None, always: bool = False) -> None:
        # The logging rank always writes it; another rank only for its own failure (its error is
        # the one that explains the run's end).
        if not (self.is_logger or always):
            return
        try:
            write_outcome(self.out, state, self.step, error, trainer=self.schema.trainer)
        except OSError as exc:  # the outcome must never hide the run's own error
            print(f"{self.name}: could not write {self.out}/outcome.json: {exc}", flush=True)

    def _catch_sigterm(self) -> Any:
        """SIGTERM raises Cancelled in the main thread (Python runs handlers between bytecodes).
        submitit's own handler only logs SIGTERM; its USR2 handler (timeout: requeue) stays."""
        if threading.current_thread() is not threading.main_thread():
            return None

        def handler(signum: int, _frame: Any) -> None:
            raise Cancelled(signum, self.step)

        return signal.signal(signal.SIGTERM, handler)
