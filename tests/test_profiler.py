"""StepProfiler on CPU: the forward mark falls inside the compute time, and data wait is separate."""

from __future__ import annotations

import time

import pytest
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


def test_progress_watch_eta_and_stall_causes() -> None:
    """ETA = running median step time x steps left (the first, compiling step left out); a step
    over 3x the median is a stall, its cause read from real counters: a torch.compile during the
    step is `compile`, a step that mostly waited for data is `data`."""
    from train.common.profiler import ProgressWatch, StepTiming

    watch = ProgressWatch(100, torch.device("cpu"))
    first = watch.observe(1, StepTiming(0.0, 5000.0, 1))
    assert first == {"steps_total": 100, "eta_s": 99 * 5.0}  # only the first step known: its time
    for step in range(2, 8):
        out = watch.observe(step, StepTiming(1.0, (8.0, 9.0, 12.0)[step % 3], 1))
        assert "stall" not in out
    assert out["eta_s"] == pytest.approx(93 * 0.010) and out["steps_total"] == 100  # median of steps 2..7: 10 ms
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager")  # dynamo compiles: its counters move
    fn(torch.ones(3))
    assert watch.observe(8, StepTiming(1.0, 60.0, 1))["stall"] == "compile"
    assert watch.observe(9, StepTiming(50.0, 5.0, 1))["stall"] == "data"
    assert "stall" not in watch.observe(10, StepTiming(1.0, 25.0, 1))  # 2.5x: not a stall
    assert watch.observe(11, StepTiming(1.0, 80.0, 1))["stall"] == "unknown"
