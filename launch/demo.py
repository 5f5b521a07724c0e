"""`make demo`: embedded Slurm up, then `launch submit stage1 --preset tiny --follow`, then a summary."""

from __future__ import annotations

import json
import sys
import time

from launch import registry
from launch.cli import main as launch_main
from launch.cluster.embedded import EmbeddedCluster
from launch.errors import LaunchError
from toolkit.metrics import SCHEMAS


def run_demo(preset: str = "tiny") -> int:
    t0 = time.monotonic()
    cluster = EmbeddedCluster()
    print(f"== 1/3 embedded Slurm cluster ({cluster.state_dir})", flush=True)
    try:
        started = cluster.up(progress=lambda msg: print(f"   {msg}", flush=True))
    except LaunchError as exc:
        print(f"demo: error: {exc}", file=sys.stderr)
        return 2
    print("   started" if started else "   already up; reusing it", flush=True)

    print(f"== 2/3 launch submit stage1 --preset {preset} --follow", flush=True)
    # The follow's own summary and next: line come first; the demo's summary adds what it checked.
    code = launch_main(["submit", "stage1", "--preset", preset, "--follow"])
    rec = registry.all_jobs()[-1] if registry.all_jobs() else None
    if code != 0 or rec is None:
        print(f"demo: the stage1 job did not complete (exit {code}); see `launch logs "
              f"{rec.job_id if rec else '<job>'}`", file=sys.stderr)
        return 1

    print("== 3/3 summary", flush=True)
    summary_path = rec.run_folder / "summary.json"
    try:
        summary = json.loads(summary_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        print(f"demo: error: no readable summary at {summary_path} ({exc})", file=sys.stderr)
        return 1
    first, last = summary["first_loss"], summary["last_loss"]
    tok_s = summary.get(SCHEMAS["stage1"].throughput) or 0.0
    print(f"   job          {rec.job_id} (preset {preset}) on {cluster.slurm_conf}")
    print(f"   steps        {summary['steps']}")
    print(f"   loss         {first:.3f} -> {last:.3f}")
    print(f"   tokens/s     {tok_s:,.0f} (all ranks, padding included)")
    print(f"   logs         {rec.stdout}")
    print(f"   metrics      {summary.get('metrics', rec.run_folder / 'metrics.jsonl')}")
    print(f"   wall time    {time.monotonic() - t0:.0f} s")
    print("   launch       in a new shell: `. .venv/bin/activate` (or once: `make install-cli`, a link in ~/.local/bin)")
    print(f"next: launch status {rec.job_id}   |   launch report {rec.job_id}   |   launch cluster down")
    if not last < first:
        print(f"demo: error: the loss did not go down ({first:.3f} -> {last:.3f})", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(run_demo())
