"""The optional metrics sinks: TensorBoard event files read back with TensorBoard's own reader;
a sink asked for without its package is a one-line error before the run (never a silent no-op).
wandb is not installed here (not a cheap package), so only its refusal is tested."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from toolkit.metrics import SCHEMAS
from train.common.config import ConfigError
from train.common.metrics import MetricsLogger


def test_tensorboard_event_files_hold_what_was_logged(tmp_path: Path, capsys) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLogger(tmp_path, SCHEMAS["stage1"], tasks=("und",), tensorboard=True)
    records = [{"step": s, "loss": 8.0 / s, "tok_s": 100.0 * s, "task_loss": {"und": 7.0 / s}} for s in (1, 2, 3)]
    for record in records:
        log.log_step(record)
    log.close()
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert {"loss", "tok_s", "task_loss/und"} <= set(events.Tags()["scalars"])
    for tag, key in (("loss", "loss"), ("tok_s", "tok_s")):
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert got == [(r["step"], pytest.approx(r[key])) for r in records]
    assert [e.value for e in events.Scalars("task_loss/und")] == pytest.approx([7.0, 3.5, 7.0 / 3])


def test_tensorboard_is_off_unless_asked(tmp_path: Path) -> None:
    log = MetricsLogger(tmp_path, SCHEMAS["stage1"])
    log.log_step({"step": 1, "loss": 1.0})
    log.close()
    assert not (tmp_path / "tb").exists()


def test_a_sink_without_its_package_is_one_line_at_parse_time(monkeypatch) -> None:
    from train.stage1.train import parse_args

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # what an environment without it imports
    with pytest.raises(ConfigError) as info:
        parse_args(["--tensorboard"])
    assert str(info.value) == ("--tensorboard needs the tensorboard package, which is not installed here "
                               "(pip install 'gpu-train-toolkit[metrics]')")
    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(ConfigError, match=r"^--wandb-project needs the wandb package, which is not installed here"):
            parse_args(["--wandb-project", "demo"])
    assert parse_args([]).tensorboard is False
