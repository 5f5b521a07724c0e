"""Per-step metrics: one readable stdout line, one jsonl record, optional TensorBoard/wandb.

`metrics.jsonl` is appended and flushed every step, so `launch logs`/`launch report` see a
live run and a killed run loses at most the line being written. A resumed run appends to the
same file; readers keep the last record of each step.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
from pathlib import Path
from typing import Any, TextIO

import torch

DEFAULT_MFU_CONVENTION = (
    "MFU = achieved model FLOP/s / peak; model FLOPs per token = 6*N_matmul + full-attention term "
    "(torchtitan convention); peak 989 TFLOP/s bf16 dense per H100/H200 GPU"
)


def mfu_convention() -> str:
    """The MFU convention text from train.common.mfu if it states one, else ours."""
    try:
        from train.common import mfu as mfu_module
    except ImportError:
        return DEFAULT_MFU_CONVENTION
    convention = getattr(mfu_module, "convention", None)
    return convention() if callable(convention) else DEFAULT_MFU_CONVENTION


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


def _fmt(x: float | None, spec: str) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


class MetricsLogger:
    def __init__(
        self,
        out_dir: str | os.PathLike[str],
        enabled: bool = True,
        stream: TextIO | None = None,
        tensorboard: bool = True,
        wandb_project: str | None = None,
    ) -> None:
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
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(out_dir) / "tb"))
            except ImportError:
                pass  # optional: only when tensorboard is installed
        if wandb_project:
            try:
                import wandb

                self._wandb = wandb.init(project=wandb_project, dir=str(out_dir), resume="allow")
            except ImportError:
                self.print(f"wandb requested ({wandb_project}) but not installed; skipping it")

    def print(self, line: str) -> None:
        if self.enabled:
            print(line, file=self.stream, flush=True)

    def header(self, info: dict[str, Any]) -> None:
        """Log the run's facts once, MFU convention included."""
        self.print("# " + " ".join(f"{k}={v}" for k, v in info.items()))
        self.print(f"# {mfu_convention()}")
        if self._file:
            self._file.write(json.dumps({"event": "header", **info, "mfu_convention": mfu_convention()}) + "\n")
            self._file.flush()

    def log_step(self, record: dict[str, Any], line_extra: str = "") -> None:
        """record: step, loss, task_loss{task: loss}, tok_s, mfu, data_ms, compute_ms, peak_mem_mb,
        compiles, recompiles, lr (extra keys pass through to the jsonl). line_extra: a trainer's own
        fields, appended to the printed line."""
        if not self.enabled:
            return
        tasks = " ".join(f"{t}={_fmt(v, '.3f')}" for t, v in sorted(record.get("task_loss", {}).items()))
        mfu = record.get("mfu")
        self.print(
            f"step {record['step']:>5} | loss {_fmt(record['loss'], '.4f')} | {tasks} | "
            f"tok/s {_fmt(record.get('tok_s'), '.0f')} | MFU {_fmt(None if mfu is None else 100 * mfu, '.3g')}% | "
            f"data {_fmt(record.get('data_ms'), '.1f')} ms | compute {_fmt(record.get('compute_ms'), '.1f')} ms | "
            f"peak mem {_fmt(record.get('peak_mem_mb'), '.0f')} MB | recompiles {record.get('recompiles', 0)}"
            + (f" | {line_extra}" if line_extra else "")
        )
        assert self._file is not None
        self._file.write(json.dumps({"event": "step", **record}) + "\n")
        self._file.flush()
        scalars = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}
        scalars.update({f"task_loss/{t}": v for t, v in record.get("task_loss", {}).items()})
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, record["step"])
        if self._wandb is not None:
            self._wandb.log(scalars, step=record["step"])

    def close(self) -> None:
        if self._file:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
