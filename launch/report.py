"""`launch report JOB_OR_DIR`: PNG plots of a run's loss, per-task loss, tok/s and MFU.

Reads the trainer's `metrics.jsonl` (one JSON record per step; a resumed run appends, the last
record of a step wins). JOB_OR_DIR is a run directory, a metrics.jsonl file, or a job id whose
run lies under $LAUNCH_HOME/runs/*/<id>/. matplotlib is imported only here, with the Agg
backend, so this works on a login node without a display.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from launch.errors import LaunchError
from launch.fsutil import launch_home
from toolkit.metrics import step_records

PLOTS = ("loss", "task_loss", "tok_s", "mfu")  # plus rank_forward for runs of several ranks


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


def write_plots(steps: list[dict[str, Any]], out_dir: Path, title: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
        return [float(r[key]) * scale if r.get(key) is not None else float("nan") for r in steps]

    for name, key, scale, ylabel in (
        ("loss", "loss", 1.0, "loss"),
        ("tok_s", "tok_s", 1.0, "tokens/s"),
        ("mfu", "mfu", 100.0, "MFU (%)"),
    ):
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot(x, series(key, scale), lw=1.5)
        ax.set(xlabel="step", ylabel=ylabel, title=f"{title}: {ylabel}")
        ax.grid(alpha=0.3)
        save(fig, name)

    fig, ax = plt.subplots(figsize=(7, 4))
    tasks = sorted({t for r in steps for t in r.get("task_loss", {})})
    for task in tasks:
        ax.plot(x, [r.get("task_loss", {}).get(task, float("nan")) for r in steps], lw=1.2, label=task)
    ax.set(xlabel="step", ylabel="loss", title=f"{title}: loss per task")
    if tasks:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    save(fig, "task_loss")

    ranked = [r for r in steps if r.get("rank_fwd_ms")]
    if ranked:  # several ranks: each rank's forward time, where a straggler shows
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
    out_dir = Path(args.out) if args.out else metrics.parent / "plots"
    for path in write_plots(steps, out_dir, title=metrics.parent.name):
        print(path)
    return 0
