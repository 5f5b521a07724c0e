"""Step profiler: where did the step go, waiting for data or computing?

Usage, one step:
    prof.start_step()
    batch = next(it)               # data wait
    prof.data_ready()
    loss = train_step(batch)       # compute; it may call prof.forward_done() after the forward
    timing = prof.end_step(n_tokens)
CUDA work is asynchronous, so on a GPU the start and end of a step synchronise the device;
otherwise the compute time would leak into the next step's data wait. The forward mark is a CUDA
event instead (read at end_step), so it costs no extra synchronisation.

`rank_spread` gathers every rank's timing of one step. The forward pass of data parallelism
(DDP, ZeRO-2) has no collective in it, so per-rank forward times show a straggler that the
step time, equalised by the gradient all-reduce, hides.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class StepTiming:
    data_ms: float
    compute_ms: float
    tokens: int
    forward_ms: float | None = None  # data ready -> forward_done(), when the step marked it

    @property
    def step_ms(self) -> float:
        return self.data_ms + self.compute_ms

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.step_ms / 1000.0) if self.step_ms > 0 else 0.0


class StepProfiler:
    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self._t0 = self._t_data = 0.0
        self._t_fwd: float | None = None
        self._ev_data = self._ev_fwd = None
        self.total_tokens = 0
        self.total_s = 0.0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def start_step(self) -> None:
        self._sync()
        self._t0 = self._t_data = time.perf_counter()

    def data_ready(self) -> None:
        self._t_data = time.perf_counter()
        self._t_fwd, self._ev_fwd = None, None
        if self.device.type == "cuda":
            self._ev_data = torch.cuda.Event(enable_timing=True)
            self._ev_data.record()

    def forward_done(self) -> None:
        if self.device.type == "cuda":
            self._ev_fwd = torch.cuda.Event(enable_timing=True)
            self._ev_fwd.record()
        else:
            self._t_fwd = time.perf_counter()

    def end_step(self, tokens: int) -> StepTiming:
        self._sync()
        t_end = time.perf_counter()
        forward_ms = None
        if self._ev_fwd is not None and self._ev_data is not None:
            forward_ms = self._ev_data.elapsed_time(self._ev_fwd)
        elif self._t_fwd is not None:
            forward_ms = (self._t_fwd - self._t_data) * 1e3
        timing = StepTiming((self._t_data - self._t0) * 1e3, (t_end - self._t_data) * 1e3, tokens, forward_ms)
        self.total_tokens += tokens
        self.total_s += t_end - self._t0
        return timing

    @property
    def mean_tokens_per_s(self) -> float:
        return self.total_tokens / self.total_s if self.total_s > 0 else 0.0


def rank_spread(timing: StepTiming, device: torch.device) -> dict[str, Any]:
    """Every rank's data wait, forward and compute time of this step, and the forward spread.

    A collective: every rank must call it at the same step. `fwd_spread` is (slowest - fastest)
    forward over the median forward; near 0 means no straggler.
    """
    local = torch.tensor([timing.data_ms, timing.forward_ms or 0.0, timing.compute_ms],
                         dtype=torch.float64, device=device)
    gathered = [torch.zeros_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    data_ms, fwd_ms, compute_ms = (list(col) for col in zip(*(t.tolist() for t in gathered), strict=True))
    median_fwd = statistics.median(fwd_ms)
    return {"rank_data_ms": data_ms, "rank_fwd_ms": fwd_ms, "rank_compute_ms": compute_ms,
            "fwd_spread": (max(fwd_ms) - min(fwd_ms)) / median_fwd if median_fwd > 0 else 0.0}
