"""`launch report`: PNGs from a metrics.jsonl, by directory or by job id; bad input is one line."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _metrics(run_dir: Path, n: int = 12) -> None:
    run_dir.mkdir(parents=True)
    lines = [json.dumps({"event": "header", "preset": "tiny"})]
    for s in range(1, n + 1):
        lines.append(json.dumps({
            "event": "step", "step": s, "loss": 8.0 / s, "task_loss": {"und": 8.0 / s, "gen_img": 9.0 / s},
            "tok_s": 1000 + s, "mfu": 1e-6 * s, "data_ms": 1.0, "compute_ms": 100.0,
        }))
    lines.append('{"event": "step", "step": 13, "lo')  # torn last line of a killed run
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _valid_png(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        (crc,) = struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])
        assert zlib.crc32(kind + body) == crc, kind
        chunks.append(kind)
        pos += 12 + length
    assert chunks[0] == b"IHDR" and chunks[-1] == b"IEND" and b"IDAT" in chunks
    return struct.unpack(">II", data[16:24])


def _launch(args: list[str], home: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "LAUNCH_HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "launch", "report", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_report_from_directory(tmp_path: Path) -> None:
    from launch.report import read_steps, write_plots

    run_dir = tmp_path / "run"
    _metrics(run_dir)
    steps = read_steps(run_dir / "metrics.jsonl")
    assert [s["step"] for s in steps] == list(range(1, 13))
    paths = write_plots(steps, run_dir / "plots", "run")
    assert sorted(p.name for p in paths) == ["loss.png", "mfu.png", "task_loss.png", "tok_s.png"]
    for p in paths:
        width, height = _valid_png(p)
        assert width > 100 and height > 100


def test_report_plots_forward_time_per_rank_for_multi_rank_runs(tmp_path: Path) -> None:
    from launch.report import read_steps, write_plots

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    recs = [{"event": "step", "step": s, "loss": 1.0, "tok_s": 1.0, "mfu": 0.1,
             "rank_fwd_ms": [200.0 + s, 205.0, 230.0], "fwd_spread": 0.14} for s in range(1, 6)]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    paths = write_plots(read_steps(run_dir / "metrics.jsonl"), run_dir / "plots", "run")
    assert "rank_forward.png" in {p.name for p in paths}
    _valid_png(run_dir / "plots" / "rank_forward.png")


def test_report_cli_by_job_id_and_errors(tmp_path: Path) -> None:
    home = tmp_path / "home"
    _metrics(home / "runs" / "stage1" / "4242")
    proc = _launch(["4242", "--out", str(tmp_path / "png")], home)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout.split()) == 4
    _valid_png(tmp_path / "png" / "loss.png")

    missing = _launch(["999"], home)
    assert missing.returncode == 2
    assert missing.stderr.startswith("launch report: error: no run found for '999'")
    assert len(missing.stderr.strip().splitlines()) == 1


def test_dflash_report_plots_its_own_series_and_no_empty_plot(tmp_path: Path) -> None:
    """A DFlash run's metrics: loss, accuracy and tok/s plots, no stage-1 MFU or per-task plot."""
    from launch.report import run_title, write_plots
    from toolkit.metrics import SCHEMAS, header_records, schema_for, step_records

    run_dir = tmp_path / "runs" / "dflash" / "77"
    run_dir.mkdir(parents=True)
    recs = [{"event": "header", "trainer": "dflash", "mode": "offline"}]
    recs += [{"event": "step", "step": s, "loss": 9.0 / s, "ce": 9.0 / s, "acc": 0.01 * s, "tok_s": 500.0 + s,
              "data_ms": 1.0, "compute_ms": 20.0, "kl": None} for s in range(1, 9)]
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    metrics = run_dir / "metrics.jsonl"
    schema = schema_for(header_records(metrics)[-1])
    assert schema is SCHEMAS["dflash"]
    paths = write_plots(step_records(metrics), run_dir / "plots", "t", schema)
    assert sorted(p.name for p in paths) == ["acc.png", "loss.png", "tok_s.png"]
    for p in paths:
        _valid_png(p)
    assert run_title(metrics, header_records(metrics)[-1]) == "dflash 77"


def test_cpu_stage1_report_has_no_mfu_plot(tmp_path: Path) -> None:
    from launch.report import write_plots

    recs = [{"event": "step", "step": s, "loss": 1.0 / s, "tok_s": 10.0, "mfu": None, "mfu_useful": None,
             "task_loss": {"und": 1.0}} for s in range(1, 4)]
    paths = write_plots(recs, tmp_path / "plots", "stage1 tiny 1")
    assert sorted(p.name for p in paths) == ["loss.png", "task_loss.png", "tok_s.png"]


def test_report_title_names_job_preset_and_id_from_the_registry(tmp_path: Path, monkeypatch) -> None:
    from launch import registry
    from launch.report import run_title

    monkeypatch.setenv("LAUNCH_HOME", str(tmp_path / "home"))
    registry.record(registry.JobRecord(job_id="4242", name="stage1", preset="tiny", folder=str(tmp_path),
                                       submitted_at=0.0, slurm_conf=None, argv=[]))
    metrics = tmp_path / "home" / "runs" / "stage1" / "4242" / "metrics.jsonl"
    assert run_title(metrics, {"trainer": "stage1", "preset": "tiny"}) == "stage1 tiny 4242"


def test_step_line_columns_are_fixed() -> None:
    """Every step line of a trainer has the same fields in the same place: `-` for an absent
    task, `n/a` for MFU without a known peak; stage-1's compact line stays within 120 characters
    whatever the values (the task losses lose a digit first, then memory, tok/s and the task losses go)."""
    from toolkit.metrics import LINE_MAX, SCHEMAS, format_eta, step_line

    tasks = ("gen_img", "gen_txt", "und")
    a = step_line(SCHEMAS["stage1"], {"step": 3, "steps_total": 40, "loss": 2.0, "task_loss": {"und": 2.0},
                                      "tok_s": 10.0, "mfu_useful": None, "data_ms": 1.0, "compute_ms": 2.0,
                                      "peak_mem_mb": 5.0 * 1024, "eta_s": 3700.0}, tasks)
    b = step_line(SCHEMAS["stage1"], {"step": 40, "steps_total": 40, "loss": 1.5,
                                      "task_loss": {"gen_img": 1.0, "gen_txt": 2.0}, "tok_s": 33087.0,
                                      "mfu_useful": 0.25, "data_ms": 1.0, "compute_ms": 2.0, "peak_mem_mb": 5.0 * 1024,
                                      "eta_s": 0.0}, tasks)
    assert a == "step 3/40 loss 2.000 (gi - gt - un 2.00) 10 tok/s uMFU n/a 2+1ms 5.0G eta 1h01m"
    assert b == "step 40/40 loss 1.500 (gi 1.00 gt 2.00 un -) 33.1k tok/s uMFU 25.0% 2+1ms 5.0G eta 0s"
    five = ("gen_img", "gen_txt", "und", "replay_img", "replay_text")
    worst = {"step": 123456, "steps_total": 123456, "loss": 123.456, "task_loss": dict.fromkeys(five, 123.4),
             "tok_s": 123456789.0, "mfu_useful": 0.999, "data_ms": 123456.0, "compute_ms": 1234567.0,
             "peak_mem_mb": 999999.0, "eta_s": 1e9, "stall": "compile+allocator+data"}
    line = step_line(SCHEMAS["stage1"], worst, five)
    assert len(line) <= LINE_MAX and line.startswith("step 123456/123456 ") and " eta 999d" in line
    assert line.endswith(" STALL(compile+allocator+data)")
    assert [format_eta(s) for s in (5, 725, 19920, 400000, None)] == ["5s", "12m05s", "5h32m", "4d15h", "-"]
    # DFlash's compact line (38.9): n/N, acc1, tau and an ETA, the same fields at every step
    assert step_line(SCHEMAS["dflash"], {"step": 1, "loss": 3.0}) == "step 1 loss 3.000 acc1 - tau - - tok/s - eta -"
    assert step_line(SCHEMAS["dflash"], {"step": 12, "steps_total": 30, "loss": 2.5, "acc1": 0.4123, "tau": 1.834,
                                         "tok_s": 33087.0, "data_ms": 3.0, "compute_ms": 950.0, "eta_s": 65.0}) == \
        "step 12/30 loss 2.500 acc1 0.412 tau 1.83 33.1k tok/s 950+3ms eta 1m05s"
    worst = {"step": 123456, "steps_total": 123456, "loss": 123.456, "acc1": 1.0, "tau": 16.0, "tok_s": 1e9,
             "data_ms": 1e6, "compute_ms": 1e7, "eta_s": 1e9, "stall": "compile+allocator+data"}
    assert len(step_line(SCHEMAS["dflash"], worst)) <= LINE_MAX


def test_report_legends_are_words_and_a_resume_is_marked(tmp_path: Path) -> None:
    """Every series is named in words (not its metrics.jsonl field), and the step a resume (or a
    requeue) started from is marked on every plot; each PNG's Description chunk says both."""
    from PIL import Image

    run_dir = tmp_path / "run"
    _metrics(run_dir)
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    # the resumed job's header comes before its steps 7.., as the trainer writes it
    lines.insert(7, json.dumps({"event": "header", "preset": "tiny", "start_step": 6}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    out = _launch([str(run_dir)], tmp_path / "home")
    assert out.returncode == 0, out.stderr
    said = {Path(p).stem: Image.open(p).text["Description"] for p in out.stdout.split()}
    assert set(said) == {"loss", "tok_s", "mfu", "task_loss"}
    assert "series: training loss" in said["loss"] and "series: tokens/s, padding included" in said["tok_s"]
    assert "series: MFU, all tokens" in said["mfu"]
    assert "series: image -> 3D (gen_img)" in said["task_loss"] and "series: 3D -> text (und)" in said["task_loss"]
    assert all("resumed at step 6" in text for text in said.values()), said
    assert not any(f"series: {raw}" in text for text in said.values() for raw in ("loss;", "tok_s", "mfu", "und;"))


def test_an_extractions_plots_count_shards_in_whole_numbers(tmp_path: Path) -> None:
    """An extraction's records are shards: the x axis says so and its ticks are whole numbers
    (two shards once drew ticks at 1.5). The PNG's Description chunk says what is drawn."""
    from PIL import Image

    from launch.report import write_plots
    from toolkit.metrics import SCHEMAS

    steps = [{"event": "step", "step": s, "samples": 64, "samples_per_s": 30.0 + s, "tok_s": 9000.0 + s,
              "mib": 12.0, "location": "local"} for s in (1, 2)]
    paths = write_plots(steps, tmp_path / "plots", "extract", SCHEMAS["extract"])
    assert paths
    for p in paths:
        said = Image.open(p).text["Description"]
        axis = next(part for part in said.split("; ") if part.startswith("x axis: "))
        label, ticks = axis.removeprefix("x axis: ").split(", ticks ")
        assert label == "shard", said
        assert ticks.split() and all(t.lstrip("−-").isdigit() for t in ticks.split()), said
