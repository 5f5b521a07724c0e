"""Step profiler: where did the step go, waiting for data or computing?

Usage, one step:
    prof.start_step()
    batch = next(it)               # data wait
    prof.data_ready()
    loss = train_step(batch)       # compute
    timing = prof.end_step(n_tokens)
CUDA work is asynchronous, so on a GPU the boundaries synchronise the device; otherwise the
compute time would leak into the next step's data wait.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StepTiming:
    data_ms: float
    compute_ms: float
    tokens: int

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

    def end_step(self, tokens: int) -> StepTiming:
        self._sync()
        t_end = time.perf_counter()
        timing = StepTiming((self._t_data - self._t0) * 1e3, (t_end - self._t_data) * 1e3, tokens)
        self.total_tokens += tokens
        self.total_s += t_end - self._t0
        return timing

    @property
    def mean_tokens_per_s(self) -> float:
        return self.total_tokens / self.total_s if self.total_s > 0 else 0.0
