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


@pytest.fixture
def own_kernel_caches(tmp_path, monkeypatch):
    """Kernel cache dirs of this test only: another process's compile must not read as ours."""
    for var in ("TRITON_CACHE_DIR", "TILELANG_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "CUTE_DSL_CACHE_DIR"):
        monkeypatch.setenv(var, str(tmp_path / var.lower()))


def test_progress_watch_eta_and_stall_causes(own_kernel_caches) -> None:
    """ETA = running median step time x steps left (the first, compiling step left out); a step
    over 2x the median (and >= 0.5 s over it) is a stall, its cause read from real counters: a
    torch.compile during the step is `compile`, a step that mostly waited for data is `data`."""
    from train.common.profiler import ProgressWatch, StepTiming

    watch = ProgressWatch(100, torch.device("cpu"))
    first = watch.observe(1, StepTiming(0.0, 30000.0, 1))
    assert first == {"steps_total": 100, "eta_s": 99 * 30.0}  # only the first step known: its time
    for step in range(2, 8):
        out = watch.observe(step, StepTiming(1.0, (900.0, 999.0, 1100.0)[step % 3], 1))
        assert "stall" not in out
    assert out["eta_s"] == pytest.approx(93 * 1.0) and out["steps_total"] == 100  # median of steps 2..7: 1 s
    fn = torch.compile(lambda x: x * 2 + 1, backend="eager")  # dynamo compiles: its counters move
    fn(torch.ones(3))
    assert watch.observe(8, StepTiming(1.0, 6000.0, 1))["stall"] == "compile"
    assert watch.observe(9, StepTiming(5000.0, 500.0, 1))["stall"] == "data"
    assert "stall" not in watch.observe(10, StepTiming(1.0, 1900.0, 1))  # 1.9x: not a stall
    assert watch.observe(11, StepTiming(1.0, 8000.0, 1))["stall"] == "unknown"


def test_stall_detector_on_the_issue_sequence(own_kernel_caches) -> None:
    """The stalls of a measured vision run (one H200, ~1.0 s median, images per step varying):
    the 3.4 s step that came with 8 images is flagged as `images`, the 1.9 s one is under 2x,
    every other step is quiet. The real detector with the real counters (nothing compiles here)."""
    from train.common.profiler import ProgressWatch, StepTiming

    seconds = [34.0, 1.02, 0.98, 1.0, 1.9, 1.01, 3.4, 0.99, 1.03, 1.0, 2.3, 1.0]
    images = [3, 4, 4, 5, 7, 4, 8, 3, 4, 4, 4, 5]
    data_ms = [0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 1250, 2]
    watch = ProgressWatch(len(seconds), torch.device("cpu"))
    stalls = {}
    for step, (s, n, d) in enumerate(zip(seconds, images, data_ms, strict=True), 1):
        out = watch.observe(step, StepTiming(float(d), 1000 * s - d, 1), {"images": n, "vision_tokens": 700 * n})
        if "stall" in out:
            stalls[step] = out["stall"]
    assert stalls == {7: "images", 11: "data"}


def test_stall_detector_ignores_cpu_noise_and_names_the_allocator(own_kernel_caches) -> None:
    """Tiny CPU steps (~40 ms) that triple on scheduling noise are no stall (the excess is under
    MIN_STALL_EXCESS_S); an allocator counter that moves during a slow step names `allocator`."""
    from train.common.profiler import MIN_STALL_EXCESS_S, ProgressWatch, StepTiming, stall_counters

    noisy = ProgressWatch(50, torch.device("cpu"))
    for step, ms in enumerate([900, 40, 42, 39, 130, 41, 38, 160, 40, 44, 120 + 1000 * MIN_STALL_EXCESS_S - 100], 1):
        assert "stall" not in noisy.observe(step, StepTiming(1.0, ms, 1)), step

    allocs = {"device_allocs": 0.0}
    watch = ProgressWatch(10, torch.device("cpu"), counters=lambda: {**stall_counters(torch.device("cpu")), **allocs})
    for step in range(1, 5):
        watch.observe(step, StepTiming(1.0, 1000.0, 1))
    allocs["device_allocs"] = 3.0  # cudaMalloc during the step: the reserve grew
    assert watch.observe(5, StepTiming(1.0, 2600.0, 1))["stall"] == "allocator"
