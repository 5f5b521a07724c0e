"""StepProfiler on CPU: the forward mark falls inside the compute time, and data wait is separate."""

from __future__ import annotations

import time

import torch

from train.common.profiler import StepProfiler


def test_forward_mark_splits_the_compute_time() -> None:
    prof = StepProfiler(torch.device("cpu"))
    prof.start_step()
    time.sleep(0.02)  # waiting for data
    prof.data_ready()
    time.sleep(0.03)  # forward
    prof.forward_done()
    time.sleep(0.05)  # backward + update
    timing = prof.end_step(tokens=1000)
    assert timing.data_ms >= 20 and timing.forward_ms is not None
    assert 30 <= timing.forward_ms < timing.compute_ms
    assert timing.compute_ms >= 80
    assert abs(timing.tokens_per_s - 1000 / (timing.step_ms / 1000)) < 1e-6


def test_a_step_without_the_mark_has_no_forward_time() -> None:
    prof = StepProfiler(torch.device("cpu"))
    prof.start_step()
    prof.data_ready()
    prof.forward_done()
    prof.end_step(tokens=1)
    prof.start_step()  # the next step's mark must not leak from the previous one
    prof.data_ready()
    assert prof.end_step(tokens=1).forward_ms is None
