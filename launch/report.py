"""`launch report JOB_OR_DIR`: PNG plots of a run, as its trainer's schema names them.

stage-1: loss, per-task loss, tok/s, MFU (where the GPU's peak is known), forward time per rank;
DFlash: loss, accuracy, tok/s; extraction: samples/s, tok/s. A plot is drawn only when one of its
series has data, and each title names the job, the preset and the job id.

Reads the trainer's `metrics.jsonl` (one JSON record per step; a resumed run appends, the last
record of a step wins). JOB_OR_DIR is a run directory, a metrics.jsonl file, or a job id whose
run lies under $LAUNCH_HOME/runs/*/<id>/. matplotlib is imported only here, with the Agg
backend, so this works on a login node without a display.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from launch.errors import LaunchError
from launch.fsutil import launch_home
from launch.registry import JOB_ID_RE
from toolkit.metrics import SCHEMAS, Schema, header_records, schema_for, step_records


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", metavar="JOB_OR_DIR", help="job id, run directory, or metrics.jsonl")
    parser.add_argument("--out", default=None, help="directory for the PNGs (default: <run dir>/plots)")


def resolve_metrics(job_or_dir: str) -> Path:
    path = Path(job_or_dir).expanduser()
    if path.is_file():
        return path
    if (path / "metrics.jsonl").is_file():
        return path / "metrics.jsonl"
    if path.is_dir():
        raise LaunchError(f"{path} has no metrics.jsonl; the trainer writes it in its run directory once it starts")
    if JOB_ID_RE.fullmatch(job_or_dir):  # a job id, never a pattern: `report '*'` must not pick a run
        run = _registered_run(job_or_dir)  # a resumed job's run lies in the folder of the job it continued
        if run is not None and (run / "metrics.jsonl").is_file():
            return run / "metrics.jsonl"
        found = sorted(launch_home().glob(f"runs/*/{job_or_dir}/metrics.jsonl"))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise LaunchError(f"job id {job_or_dir} matches several runs: {', '.join(map(str, found))}; give the directory")
    raise LaunchError(
        f"no run found for {job_or_dir!r}: give a run directory, a metrics.jsonl, or a job id with "
        f"{launch_home()}/runs/*/{job_or_dir}/metrics.jsonl"
    )


def _registered_run(job_id: str) -> Path | None:
    from launch import registry

    try:
        rec = next((j for j in reversed(registry.all_jobs()) if j.job_id == job_id), None)
    except (LaunchError, OSError, ValueError, TypeError):
        return None
    return rec.run_folder if rec is not None else None


def read_steps(metrics: Path, bad: list[str] | None = None) -> list[dict[str, Any]]:
    """The step records; each line that is not one is named in `bad` ("line N: why")."""
    bad = [] if bad is None else bad
    try:
        steps = step_records(metrics, bad)
    except OSError as exc:
        raise LaunchError(f"cannot read {metrics} ({exc.strerror})") from None
    if not steps:
        skipped = f" ({len(bad)} unreadable line(s): {', '.join(bad[:2])})" if bad else ""
        raise LaunchError(f"{metrics} has no step records yet{skipped}")
    return steps


def run_title(metrics: Path, header: dict[str, Any] | None) -> str:
    """`<job> <preset> <id>`: the launcher's record of the job when it has one, else what the run says."""
    run_dir = metrics.parent
    job, preset, job_id = (header or {}).get("trainer"), None, run_dir.name
    try:
        from launch import registry

        rec = next((j for j in reversed(registry.all_jobs()) if j.job_id == job_id), None)
    except (LaunchError, OSError, ValueError, TypeError):
        rec = None
    if rec is not None:
        job, preset = rec.name, rec.preset
    elif run_dir.parent.parent.name == "runs":  # $LAUNCH_HOME/runs/<job>/<id>
        job = run_dir.parent.name
    preset = preset or (header or {}).get("preset") or (header or {}).get("shape")  # stage-1 names its model shape
    return " ".join(str(x) for x in (job, preset, job_id) if x)


def _number(x: Any) -> float | None:
    """A finite number of a record, or None (absent, null, NaN, inf, text, true/false)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


def _has_data(steps: list[dict[str, Any]], key: str) -> bool:
    return any(_number(r.get(key)) is not None for r in steps)


def _task_losses(record: dict[str, Any]) -> dict[str, float]:
    losses = record.get("task_loss")
    if not isinstance(losses, dict):
        return {}
    return {str(t): v for t, v in ((t, _number(v)) for t, v in losses.items()) if v is not None}


def malformed_fields(steps: list[dict[str, Any]]) -> list[str]:
    """'step N: task_loss ...' for each per-task or per-rank field that is not what trainers log
    (its non-numbers are left out of the plot; the rest of the record is drawn)."""
    def numbers(xs: Any) -> bool:  # NaN is a number here: a skipped non-finite step logs it
        return all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in xs)

    bad = []
    for r in steps:
        losses, times = r.get("task_loss"), r.get("rank_fwd_ms")
        if losses is not None and not (isinstance(losses, dict) and numbers(losses.values())):
            bad.append(f"step {r['step']}: task_loss is not a mapping of task to loss")
        if times is not None and not (isinstance(times, list) and numbers(times)):
            bad.append(f"step {r['step']}: rank_fwd_ms is not a list of times")
    return bad


def _rank_times(record: dict[str, Any]) -> list[float]:
    times = record.get("rank_fwd_ms")
    if not isinstance(times, list) or not all(_number(t) is not None for t in times):
        return []
    return [float(t) for t in times]


# What each series is, in the legend (the metrics.jsonl field names are for scripts).
SERIES_WORDS = {
    "loss": "training loss", "tok_s": "tokens/s, padding included", "real_tok_s": "tokens/s, real tokens only",
    "mfu": "MFU, all tokens", "mfu_useful": "MFU, real tokens only", "ce": "cross-entropy on the block",
    "kl": "KL(target || drafter)", "acc": "accuracy, every slot of the block", "acc1": "accuracy, first slot",
    "target_agree": "agreement with the target's argmax", "tau": "tau: accepted tokens per block",
    "samples_per_s": "samples/s", "rank_fwd_ms": "forward ms",
}
TASK_WORDS = {
    "gen_img": "image -> 3D (gen_img)", "gen_txt": "text -> 3D (gen_txt)", "und": "3D -> text (und)",
    "replay_img": "image + text replay (replay_img)", "replay_text": "text replay (replay_text)",
}


def resume_steps(headers: list[dict[str, Any]]) -> list[int]:
    """The steps a run started again from (a resume or a requeue): each later header's start_step."""
    return sorted({h["start_step"] for h in headers if isinstance(h.get("start_step"), int)
                   and not isinstance(h.get("start_step"), bool) and h["start_step"] > 0})


def write_plots(steps: list[dict[str, Any]], out_dir: Path, title: str, schema: Schema | None = None,
                resumes: list[int] | None = None) -> list[Path]:
    """The schema's plots, each only when one of its series has data (no empty PNGs); each series
    named in words, a dashed line where the run was resumed. Each PNG's Description text chunk
    says the same in words (what a reader without the image, or a test, reads)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schema = schema or SCHEMAS["stage1"]
    x = [r["step"] for r in steps]
    written = []

    resumes = [r for r in (resumes or []) if x and min(x) <= r <= max(x)]

    def finish(ax: Any, legend: bool = True, **legend_kw: Any) -> None:
        # Steps and shards are counted: whole-number ticks, named for what the x axis counts.
        from matplotlib.ticker import MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(schema.first_label)
        for k, step in enumerate(resumes):
            ax.axvline(step, color="0.4", ls="--", lw=1.0, label="resumed here" if k == 0 else None)
        if legend and ax.get_legend_handles_labels()[1]:
            ax.legend(**{"fontsize": 8, **legend_kw})
        ax.grid(alpha=0.3)

    def save(fig: Any, name: str) -> None:
        path = out_dir / f"{name}.png"
        tmp = path.with_name(f".{path.name}.tmp")
        ax = fig.axes[0]
        fig.canvas.draw()  # the ticks as drawn
        ticks = [t.get_text() for t in ax.get_xticklabels() if t.get_text()]
        said = [ax.get_title(), f"x axis: {ax.get_xlabel()}, ticks {' '.join(ticks)}",
                *[f"series: {line.get_label()}" for line in ax.get_lines()
                                 if not line.get_label().startswith("_") and line.get_label() != "resumed here"],
                *[f"resumed at step {r}" for r in resumes]]
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            fig.savefig(tmp, dpi=100, format="png", metadata={"Description": "; ".join(said)})
            tmp.replace(path)  # atomic: a viewer never sees half a PNG
        except OSError as exc:
            if tmp.parent.is_dir():
                tmp.unlink(missing_ok=True)
            raise LaunchError(f"cannot write {path} ({exc.strerror}); give another --out directory") from None
        finally:
            plt.close(fig)
        written.append(path)

    def series(key: str, scale: float = 1.0) -> list[float]:
        return [v * scale if (v := _number(r.get(key))) is not None else float("nan") for r in steps]

    for plot in schema.plots:
        keys = [k for k in plot.keys if _has_data(steps, k)]
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for key in keys:
            ax.plot(x, series(key, plot.scale), lw=1.5, label=SERIES_WORDS.get(key, key))
        ax.set(ylabel=plot.ylabel, title=f"{title}: {plot.ylabel}")
        finish(ax)
        save(fig, plot.name)

    task_losses = [_task_losses(r) for r in steps]
    tasks = sorted({t for losses in task_losses for t in losses})
    if schema.per_task and tasks:
        fig, ax = plt.subplots(figsize=(7, 4))
        for task in tasks:
            # A task is absent from the steps whose batch had none of it: drawn through the steps
            # it has (NaN gaps would cut each curve into fragments, or isolated dots).
            points = [(step, losses[task]) for step, losses in zip(x, task_losses, strict=True) if task in losses]
            ax.plot([p[0] for p in points], [p[1] for p in points], lw=1.2, marker=".", ms=3,
                    label=TASK_WORDS.get(task, task))
        ax.set(ylabel="loss", title=f"{title}: loss per task")
        finish(ax)
        save(fig, "task_loss")

    ranked = [(r["step"], times) for r in steps if (times := _rank_times(r))]
    if schema.per_rank and ranked:  # several ranks: each rank's forward time, where a straggler shows
        fig, ax = plt.subplots(figsize=(7, 4))
        n_ranks = max(len(times) for _, times in ranked)
        for rank in range(n_ranks):
            ax.plot([step for step, _ in ranked],
                    [times[rank] if rank < len(times) else float("nan") for _, times in ranked],
                    lw=1.0, label=f"rank {rank}")
        ax.set(ylabel="forward ms", title=f"{title}: forward time per rank")
        finish(ax, legend=n_ranks <= 16, fontsize=7, ncol=2)
        save(fig, "rank_forward")
    return written


def run(args: argparse.Namespace) -> int:
    metrics = resolve_metrics(args.job)
    bad: list[str] = []
    steps = read_steps(metrics, bad)
    headers = header_records(metrics)
    header = headers[-1] if headers else None
    try:
        schema = schema_for(header)
    except ValueError as exc:
        raise LaunchError(f"{metrics}: {exc}") from None
    if args.out is not None and not args.out.strip():
        raise LaunchError("--out is empty; give a directory for the PNGs (default: <run dir>/plots)")
    out_dir = Path(args.out) if args.out else metrics.parent / "plots"
    if out_dir.exists() and not out_dir.is_dir():
        raise LaunchError(f"{out_dir} is not a directory; give another --out")
    bad += malformed_fields(steps)
    if bad:  # the good records are drawn; the others are named, never silently dropped
        more = f", and {len(bad) - 2} more" if len(bad) > 2 else ""
        print(f"launch report: warning: {metrics}: skipped {', '.join(bad[:2])}{more}", file=sys.stderr)
    written = write_plots(steps, out_dir, title=run_title(metrics, header), schema=schema,
                          resumes=resume_steps(headers))
    if not written:  # an empty plot is no report
        keys = sorted({k for plot in schema.plots for k in plot.keys})
        raise LaunchError(f"{metrics}: none of its {len(steps)} step record(s) has a finite value for "
                          f"{', '.join(keys)} (what a {schema.trainer} run logs); nothing drawn")
    numbers = sorted({r["step"] for r in steps if isinstance(r.get("step"), int)})
    if numbers:  # which run was read: a resumed job's report covers every job of its run
        print(f"launch report: {metrics}: {len(numbers)} steps ({numbers[0]}..{numbers[-1]})", file=sys.stderr)
    for path in written:
        print(path)
    return 0
