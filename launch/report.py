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
from pathlib import Path
from typing import Any

from launch.errors import LaunchError
from launch.fsutil import launch_home
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
    if "/" not in job_or_dir:
        found = sorted(launch_home().glob(f"runs/*/{job_or_dir}/metrics.jsonl"))
        if len(found) == 1:
            return found[0]
        if len(found) > 1:
            raise LaunchError(f"job id {job_or_dir} matches several runs: {', '.join(map(str, found))}; give the directory")
    raise LaunchError(
        f"no run found for {job_or_dir!r}: give a run directory, a metrics.jsonl, or a job id with "
        f"{launch_home()}/runs/*/{job_or_dir}/metrics.jsonl"
    )


def read_steps(metrics: Path) -> list[dict[str, Any]]:
    steps = step_records(metrics)
    if not steps:
        raise LaunchError(f"{metrics} has no step records yet")
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


def _has_data(steps: list[dict[str, Any]], key: str) -> bool:
    return any(isinstance(r.get(key), (int, float)) and math.isfinite(r[key]) for r in steps)


def write_plots(steps: list[dict[str, Any]], out_dir: Path, title: str, schema: Schema | None = None) -> list[Path]:
    """The schema's plots, each only when one of its series has data (no empty PNGs)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    schema = schema or SCHEMAS["stage1"]
    out_dir.mkdir(parents=True, exist_ok=True)
    x = [r["step"] for r in steps]
    written = []

    def save(fig: Any, name: str) -> None:
        path = out_dir / f"{name}.png"
        tmp = path.with_name(f".{path.name}.tmp")
        fig.savefig(tmp, dpi=100, format="png")
        plt.close(fig)
        tmp.replace(path)  # atomic: a viewer never sees half a PNG
        written.append(path)

    def series(key: str, scale: float = 1.0) -> list[float]:
        return [float(r[key]) * scale if isinstance(r.get(key), (int, float)) else float("nan") for r in steps]

    for plot in schema.plots:
        keys = [k for k in plot.keys if _has_data(steps, k)]
        if not keys:
            continue
        fig, ax = plt.subplots(figsize=(7, 4))
        for key in keys:
            ax.plot(x, series(key, plot.scale), lw=1.5, label=key)
        ax.set(xlabel="step", ylabel=plot.ylabel, title=f"{title}: {plot.ylabel}")
        if len(keys) > 1:
            ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        save(fig, plot.name)

    tasks = sorted({t for r in steps for t in (r.get("task_loss") or {})})
    if schema.per_task and tasks:
        fig, ax = plt.subplots(figsize=(7, 4))
        for task in tasks:
            ax.plot(x, [(r.get("task_loss") or {}).get(task, float("nan")) for r in steps], lw=1.2, label=task)
        ax.set(xlabel="step", ylabel="loss", title=f"{title}: loss per task")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
        save(fig, "task_loss")

    ranked = [r for r in steps if r.get("rank_fwd_ms")]
    if schema.per_rank and ranked:  # several ranks: each rank's forward time, where a straggler shows
        fig, ax = plt.subplots(figsize=(7, 4))
        n_ranks = max(len(r["rank_fwd_ms"]) for r in ranked)
        for rank in range(n_ranks):
            ax.plot([r["step"] for r in ranked],
                    [r["rank_fwd_ms"][rank] if rank < len(r["rank_fwd_ms"]) else float("nan") for r in ranked],
                    lw=1.0, label=f"rank {rank}")
        ax.set(xlabel="step", ylabel="forward ms", title=f"{title}: forward time per rank")
        if n_ranks <= 16:
            ax.legend(fontsize=7, ncol=2)
        ax.grid(alpha=0.3)
        save(fig, "rank_forward")
    return written


def run(args: argparse.Namespace) -> int:
    metrics = resolve_metrics(args.job)
    steps = read_steps(metrics)
    headers = header_records(metrics)
    header = headers[-1] if headers else None
    try:
        schema = schema_for(header)
    except ValueError as exc:
        raise LaunchError(f"{metrics}: {exc}") from None
    out_dir = Path(args.out) if args.out else metrics.parent / "plots"
    for path in write_plots(steps, out_dir, title=run_title(metrics, header), schema=schema):
        print(path)
    return 0
