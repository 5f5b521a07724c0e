"""Per-step metrics: one readable stdout line, one jsonl record, optional TensorBoard/wandb.

`metrics.jsonl` is appended and flushed every step, so `launch logs`/`launch report` see a
live run and a killed run loses at most the line being written. A resumed run appends to the
same file; readers keep the last record of each step. The trainer's schema
(toolkit.metrics.SCHEMAS) fixes the console columns; the header names the trainer, so
`launch report` draws that trainer's plots.
"""

from __future__ import annotations

import errno
import json
import math
import os
import resource
import sys
import threading
from pathlib import Path
from typing import Any, TextIO

import torch

from toolkit.metrics import Schema, step_line
from train.common.config import SINKS, ConfigError, require_sink  # noqa: F401 - re-exported
from train.common.mfu import convention as mfu_convention


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated CUDA memory on GPU; peak resident set size of this process on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    # ru_maxrss is KiB on Linux.
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def compile_counts() -> tuple[int, int]:
    """(graphs compiled, recompiles) from torch.compile's counters; (0, 0) without compile."""
    if "torch._dynamo" not in sys.modules:
        return 0, 0
    from torch._dynamo.utils import counters

    return int(counters["stats"].get("unique_graphs", 0)), int(sum(counters["recompiles"].values()))




def _quiet_full_disk_in_threads() -> None:
    """TensorBoard writes from a thread of its own: a full disk there would print a traceback
    of that thread, while the main thread's write (or TensorBoard's own flush) raises the same
    error and the trainer says it in one line. Other thread errors print as before."""
    previous = threading.excepthook
    if getattr(previous, "quiet_full_disk", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if isinstance(args.exc_value, OSError) and args.exc_value.errno in (errno.ENOSPC, errno.EDQUOT):
            return
        previous(args)

    hook.quiet_full_disk = True  # type: ignore[attr-defined]
    threading.excepthook = hook

class MetricsLogger:
    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        schema: Schema,
        tasks: tuple[str, ...] = (),
        enabled: bool = True,
        stream: TextIO | None = None,
        tensorboard: bool = False,
        wandb_project: str | None = None,
    ) -> None:
        """tensorboard: event files in <out_dir>/tb; wandb_project: a wandb run in out_dir (offline
        with WANDB_MODE=offline). Each is off unless asked for, and an error when asked for without
        its package."""
        self.schema = schema
        self.tasks = tasks
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self.path = Path(out_dir) / "metrics.jsonl"
        self._file: TextIO | None = None
        self._tb: Any = None
        self._wandb: Any = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", buffering=1)
        if tensorboard:
            require_sink("tensorboard")
            from torch.utils.tensorboard import SummaryWriter

            _quiet_full_disk_in_threads()
            try:
                self._tb = SummaryWriter(str(Path(out_dir) / "tb"))
            except OSError as exc:
                raise OSError(exc.errno, exc.strerror, str(Path(out_dir) / "tb")) from exc
        if wandb_project:
            require_sink("wandb")
            import wandb

            self._wandb = wandb.init(project=wandb_project, dir=str(out_dir), resume="allow")

    def print(self, line: str) -> None:
        if self.enabled:
            print(line, file=self.stream, flush=True)

    def header(self, info: dict[str, Any]) -> None:
        """Log the run's facts once (the trainer's name first; the MFU convention where it logs MFU)."""
        info = {"trainer": self.schema.trainer, **info}
        if "mfu" in self.schema.fields:
            info["mfu_convention"] = mfu_convention()
        self.print("# " + " ".join(f"{k}={v}" for k, v in info.items() if k != "mfu_convention"))
        if "mfu_convention" in info:
            self.print(f"# {info['mfu_convention']}")
        if self._file:
            self._write(json.dumps({"event": "header", **info}))

    def log_step(self, record: dict[str, Any]) -> None:
        """One step: the schema's fields (absent ones null in the jsonl); extra keys pass through."""
        if not self.enabled:
            return
        record = {**dict.fromkeys(self.schema.fields), **record}
        self.print(step_line(self.schema, record, self.tasks))
        assert self._file is not None
        self._write(json.dumps({"event": "step", **_finite_or_none(record)}))
        scalars = {k: v for k, v in record.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step"}
        scalars.update({f"task_loss/{t}": v for t, v in (record.get("task_loss") or {}).items()})
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, record["step"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=record["step"])

    def event(self, name: str, **fields: Any) -> None:
        """A non-step record (e.g. a skipped non-finite step), kept in the jsonl."""
        if self._file:
            self._write(json.dumps({"event": name, **_finite_or_none(fields)}))

    def _write(self, line: str) -> None:
        assert self._file is not None
        try:
            self._file.write(line + "\n")
            self._file.flush()
        except OSError as exc:  # a full disk: named, so the one-line error says which file
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc

    def close(self) -> None:
        if self._file:
            try:
                self._file.close()
            except OSError:
                pass  # the failed write was already raised (and said); the lines before it are whole
            self._file = None
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def _finite_or_none(record: dict[str, Any]) -> dict[str, Any]:
    """NaN/inf as null: json.dumps would write NaN, which strict JSON readers refuse."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
