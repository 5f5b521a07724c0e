"""Multi-GPU runs of the real trainers on one host: stage-1 ZeRO-2 scaling, DFlash k-1 topologies.

On a GPU machine without Slurm, this script plays srun's part: one process per rank, each
with the variables srun gives a task (SLURM_JOB_ID, SLURM_NTASKS, SLURM_PROCID, SLURM_LOCALID,
SLURM_NODEID, SLURM_JOB_NODELIST, SLURM_JOB_NUM_NODES), calling the trainer's
`main(argv, guard=False)`. train.common.distributed reads that layout exactly as it does under
`launch submit`; only the Slurm guard is off. NVLink multicast stays off in every rank
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1): on shared
hosts it can take the GPUs out of service.

    python bench/multigpu.py stage1 --gpus 1,2 --steps 16 --skip 4 --jsonl out.jsonl
    python bench/multigpu.py dflash --topologies 1-1 --target qwen35-0.8b --steps 40 --skip 10
    python bench/multigpu.py dflash --topologies 1-1 --target qwen35-0.8b --drafter target --anchors 4,512

stage1: for each GPU count, the trainer on job preset --preset (qwen35-2b) with DeepSpeed ZeRO-2
(`--deepspeed on`, also on one GPU, so every row runs the same code) and uniform 8192-token rows,
no checkpoints. Over the steps after --skip: median tok/s of all ranks, tok/s per GPU, MFU (the
trainer's: torchtitan 6*N_matmul + full-attention term, 989 TFLOP/s), scaling efficiency against
the first GPU count, and the spread of the forward time across ranks (rank_spread in
train/common/profiler.py: (slowest - fastest) / median; the forward has no collective, so a
straggler shows there and not in the step time, which the gradient reduction equalises).

dflash: for each topology k-1 (k target ranks + 1 drafter rank), the online trainer. The drafter's
data wait (blocked in recv) says which side is the bottleneck: near 0 the drafter is saturated and
more targets add nothing; large, the targets are ("queue full" counts the targets' waits for the
drafter). From one run's timings it also projects where the drafter saturates:
k* = ceil(a target's median seconds to produce a batch / the drafter's median compute seconds a step),
a projection, where the machine has fewer GPUs than the topologies to measure. A target's time
includes waiting for sends the drafter has not taken yet, so it is the target's own time only
when the drafter waits (wait fraction well above 0); when the drafter never waits it is already
saturated and k* = 1. `--anchors 4,512` runs each topology once per anchor count (anchors per
sequence, clamped by the trainer to each row's response positions), side by side in one table.

Each run appends one JSON line to --jsonl; the table is printed at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launch.jobspec import find_spec  # noqa: E402
from toolkit.metrics import step_records  # noqa: E402

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def srun_env(ntasks: int, rank: int, job_id: int, port: int) -> dict[str, str]:
    """The environment srun gives task `rank` of a one-node step of `ntasks` tasks."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(NO_MULTICAST)
    env.update(
        SLURM_JOB_ID=str(job_id), SLURM_NTASKS=str(ntasks), SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank),
        SLURM_NODEID="0", SLURM_JOB_NODELIST="localhost", SLURM_JOB_NUM_NODES="1", MASTER_PORT=str(port),
        PYTHONPATH=os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]),
        PYTHONUNBUFFERED="1",
    )
    if "CUDA_VISIBLE_DEVICES" not in os.environ:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(ntasks))  # as Slurm's gres does
    return env


def run_ranks(job: str, argv: list[str], ntasks: int, logs: Path, timeout: float) -> list[str]:
    """Start `ntasks` ranks of `python -m train.<job>` (guard off); return each rank's output."""
    logs.mkdir(parents=True, exist_ok=True)
    port, job_id = free_port(), 900000 + ntasks
    procs, files = [], []
    for rank in range(ntasks):
        f = open(logs / f"rank{rank}.log", "w")  # noqa: SIM115 - closed below
        files.append(f)
        procs.append(subprocess.Popen([sys.executable, __file__, "_rank", job, json.dumps(argv)],
                                      env=srun_env(ntasks, rank, job_id, port), stdout=f, stderr=subprocess.STDOUT,
                                      start_new_session=True))
    t0, last_note = time.monotonic(), 0.0
    while any(p.poll() is None for p in procs):
        if time.monotonic() - t0 > timeout or any(p.poll() not in (None, 0) for p in procs):
            for p in procs:  # one rank failed or time is up: the others would wait forever in NCCL
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
            break
        if time.monotonic() - last_note > 30:
            last_note = time.monotonic()
            tail = (logs / "rank0.log").read_text(errors="replace").strip().splitlines()[-1:] or [""]
            print(f"    [{time.monotonic() - t0:5.0f}s] rank0: {tail[0][:150]}", flush=True)
        time.sleep(1)
    for p in procs:
        p.wait()
    for f in files:
        f.close()
    outputs = [(logs / f"rank{r}.log").read_text(errors="replace") for r in range(ntasks)]
    codes = [p.returncode for p in procs]
    if any(codes):
        bad = next(r for r, c in enumerate(codes) if c)
        raise RuntimeError(f"{job} with {ntasks} ranks: exit codes {codes}; rank {bad} ended with:\n"
                           + "\n".join(outputs[bad].strip().splitlines()[-25:]))
    return outputs


def timed_steps(metrics: Path, skip: int) -> list[dict[str, Any]]:
    steps = step_records(metrics)
    if len(steps) <= skip:
        raise RuntimeError(f"{metrics}: {len(steps)} steps logged, need more than --skip {skip}")
    return steps[skip:]


# ---------------------------------------------------------------------------------------------


def bench_stage1(a: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for n in [int(x) for x in a.gpus.split(",")]:
        out = Path(a.work) / f"stage1-{a.preset}-{n}gpu"
        # the job preset's args first (the model shape, its row length, lr, --vision off), then this
        # run's. 500 synthetic records of the shape's real asset format (5,824 codes for qwen35-2b):
        # how many distinct ones there are does not change a step's cost, and they are quick to make.
        argv = find_spec("stage1").resolve(a.preset).argv()
        argv += ["--steps", str(a.steps), "--deepspeed", a.deepspeed, "--out", str(out),
                 "--ckpt-every", "0", "--log-every", "1", "--synthetic-samples", "500"]
        if a.batch_rows:
            argv += ["--batch-rows", str(a.batch_rows)]
        if a.row_len:
            argv += ["--row-len", str(a.row_len)]
        argv += a.extra
        shutil.rmtree(out, ignore_errors=True)  # a killed earlier attempt would add its steps to metrics.jsonl
        print(f"== stage1 {a.preset} on {n} GPU(s): python -m train.stage1 {' '.join(argv)}", flush=True)
        t0 = time.monotonic()
        outputs = run_ranks("stage1", argv, n, out / "logs", a.timeout)
        every = step_records(out / "metrics.jsonl")
        steps = timed_steps(out / "metrics.jsonl", a.skip)
        header = next((ln for ln in outputs[0].splitlines() if "world=" in ln), "")
        kernels = next((ln.lstrip("# ") for ln in outputs[0].splitlines() if "gated-delta-rule=" in ln), "")
        spreads = [r["fwd_spread"] for r in steps if "fwd_spread" in r]
        tok_s = statistics.median(r["tok_s"] for r in steps)
        row = {
            "bench": "stage1", "preset": a.preset, "gpus": n,
            "vocab": int(m.group(1)) if (m := re.search(r"\bvocab=(\d+)", header)) else None, "deepspeed": "deepspeed=True" in header,
            "steps_timed": len(steps), "tok_s": tok_s, "tok_s_per_gpu": tok_s / n,
            # None where the device's peak is unknown (a CPU smoke run): no MFU rather than a wrong one
            "mfu": statistics.median(mfus) if (mfus := [r["mfu"] for r in steps if r.get("mfu") is not None]) else None,
            "mfu_useful": statistics.median(u) if (u := [r["mfu_useful"] for r in steps
                                                         if r.get("mfu_useful") is not None]) else None,
            "first_step_s": (every[0]["data_ms"] + every[0]["compute_ms"]) / 1000 if every else None,
            # process start -> end of step 1 (imports, build, kernel warm-up, step 1), rank 0
            "to_step1_s": every[0].get("since_start_s") if every else None,
            "kernel_compiles_step1": every[0].get("kernel_compiles") if every else None,
            "stalls": [[r["step"], r["stall"]] for r in every if r.get("stall")],
            "images_per_step": statistics.mean(r.get("images", 0) for r in steps),
            "vision_flops_share": statistics.median(r.get("vision_flops", 0) / max(1e-9, r["tok_s"] * (
                r["data_ms"] + r["compute_ms"]) / 1000 * fpt + r.get("vision_flops", 0)) for r in steps)
            if (fpt := float(m.group(1)) if (m := re.search(r"\bflops_per_token=([\d.e+]+)", header)) else 0) else None,
            "kernels": kernels,
            "step_ms": statistics.median(r["data_ms"] + r["compute_ms"] for r in steps),
            "fwd_ms": statistics.median(r["fwd_ms"] for r in steps) if steps[0].get("fwd_ms") else None,
            "fwd_spread_median": statistics.median(spreads) if spreads else None,
            "fwd_spread_max": max(spreads) if spreads else None,
            "step_max_over_median": max(r["data_ms"] + r["compute_ms"] for r in steps)
            / statistics.median(r["data_ms"] + r["compute_ms"] for r in steps),
            "peak_mem_gb": max(r["peak_mem_mb"] for r in steps) / 1024,
            "loss_first_last": [steps[0]["loss"], steps[-1]["loss"]], "wall_s": time.monotonic() - t0,
            "header": header.strip(),
        }
        rows.append(row)
        print(f"   {n} GPU: {tok_s:,.0f} tok/s, {_pct(row['mfu'])} MFU, {_pct(row['mfu_useful'])} uMFU, "
              f"first step {row['first_step_s']:.1f} s (ended {row['to_step1_s'] or 0:.0f} s after start, "
              f"compiles {row['kernel_compiles_step1']}), stalls {row['stalls']}, peak {row['peak_mem_gb']:.1f} GiB, "
              f"vocab {row['vocab']}, wall {row['wall_s']:.0f} s", flush=True)
    base = rows[0]["tok_s_per_gpu"] if rows else 1.0
    for row in rows:
        row["scaling_efficiency"] = row["tok_s_per_gpu"] / base
    return rows


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def print_stage1(rows: list[dict[str, Any]]) -> None:
    print("\n| GPUs | ZeRO-2 | tok/s | tok/s/GPU | MFU | uMFU | scaling eff. | step ms | fwd ms | fwd spread med/max "
          "| slowest step / median | peak GiB | first step s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
    for r in rows:
        spread = ("-" if r["fwd_spread_median"] is None
                  else f"{r['fwd_spread_median']:.1%} / {r['fwd_spread_max']:.1%}")
        fwd = "-" if r["fwd_ms"] is None else f"{r['fwd_ms']:.0f}"
        print(f"| {r['gpus']} | {'yes' if r['deepspeed'] else 'no'} | {r['tok_s']:,.0f} | {r['tok_s_per_gpu']:,.0f} "
              f"| {_pct(r['mfu'])} | {_pct(r.get('mfu_useful'))} | {r['scaling_efficiency']:.3f} | {r['step_ms']:.0f} "
              f"| {fwd} | {spread} | {r['step_max_over_median']:.2f} | {r['peak_mem_gb']:.1f} "
              f"| {r.get('first_step_s') or 0:.1f} |")


# ---------------------------------------------------------------------------------------------

TARGET_LINE = re.compile(r"target rank (\d+): sent (\d+) batches in ([\d.]+)s, queue full (\d+) times, "
                         r"median ([\d.]+)s to produce one")


def bench_dflash(a: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for topo, anchors in [(t, n) for t in a.topologies.split(",") for n in a.anchors.split(",")]:
        k = int(topo.split("-")[0])
        out = Path(a.work) / f"dflash-{topo}-a{anchors}"
        argv = ["--mode", "online", "--topology", topo, "--preset", a.target, "--drafter", a.drafter,
                "--steps", str(a.steps), "--token-budget", str(a.token_budget), "--max-len", str(a.max_len),
                "--synthetic-samples", str(a.samples), "--out", str(out), "--ckpt-every", str(10**9),
                "--queue-depth", str(a.queue_depth), "--anchors", anchors, *a.extra]
        shutil.rmtree(out, ignore_errors=True)
        print(f"== dflash {topo}, {anchors} anchors: python -m train.dflash {' '.join(argv)}", flush=True)
        t0 = time.monotonic()
        outputs = run_ranks("dflash", argv, k + 1, out / "logs", a.timeout)
        steps = timed_steps(out / "metrics.jsonl", a.skip)
        targets = [m.groups() for text in outputs[:k] for m in [TARGET_LINE.search(text)] if m]
        if len(targets) != k:
            raise RuntimeError(f"dflash {topo}: {len(targets)} of {k} target ranks reported their timing")
        wait = sum(r["data_ms"] for r in steps)
        compute = sum(r["compute_ms"] for r in steps)
        drafter_compute_s = statistics.median(r["compute_ms"] for r in steps) / 1000
        produce_s = statistics.median(float(t[4]) for t in targets)
        row = {
            "bench": "dflash", "topology": topo, "target": a.target, "drafter": a.drafter, "steps_timed": len(steps),
            "anchors": int(anchors), "blocks_per_step": statistics.median(r.get("anchors", 0) for r in steps),
            "tau": statistics.median(r["tau"] for r in steps) if "tau" in steps[0] else None,
            "drafter_tok_s": statistics.median(r["tok_s"] for r in steps),
            "drafter_step_ms": statistics.median(r["data_ms"] + r["compute_ms"] for r in steps),
            "drafter_compute_ms": drafter_compute_s * 1000, "drafter_wait_fraction": wait / max(wait + compute, 1e-9),
            "target_queue_full": sum(int(t[3]) for t in targets), "target_produce_s": produce_s,
            # k targets hand the drafter a batch every produce_s / k: it saturates once that is
            # shorter than its own compute time.
            "k_saturation_projected": (max(1, math.ceil(produce_s / drafter_compute_s))
                                       if wait / max(wait + compute, 1e-9) > 0.05 else 1),
            "loss_first_last": [steps[0]["loss"], steps[-1]["loss"]], "wall_s": time.monotonic() - t0,
        }
        rows.append(row)
        print(f"   {topo}, {anchors} anchors: drafter {row['drafter_tok_s']:,.0f} tok/s, "
              f"waiting {row['drafter_wait_fraction']:.0%}", flush=True)
    return rows


def print_dflash(rows: list[dict[str, Any]]) -> None:
    base = {r["topology"]: r["drafter_tok_s"] for r in reversed(rows)}  # each topology's first anchor count
    print("\n| topology | anchors/seq | blocks/step | drafter tok/s | vs first | drafter step ms | drafter compute ms "
          "| drafter waiting | queue full | target s/batch | projected saturation k |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['topology']} | {r.get('anchors', '-')} | {r.get('blocks_per_step', 0):,.0f} | "
              f"{r['drafter_tok_s']:,.0f} | {r['drafter_tok_s'] / base[r['topology']]:.2f} | {r['drafter_step_ms']:.0f} | "
              f"{r['drafter_compute_ms']:.0f} | {r['drafter_wait_fraction']:.0%} | {r['target_queue_full']} | {r['target_produce_s']:.3f} | "
              f"{r['k_saturation_projected']} |")


# ---------------------------------------------------------------------------------------------


def rank_main(job: str, argv_json: str) -> int:
    import importlib

    main = importlib.import_module(f"train.{job}.train").main
    return main(json.loads(argv_json), guard=False)


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "_rank":
        return rank_main(sys.argv[2], sys.argv[3])
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="bench", required=True)
    s1 = sub.add_parser("stage1")
    s1.add_argument("--gpus", default="1,2", help="GPU counts, comma-separated; the first is the scaling base")
    s1.add_argument("--preset", default="qwen35-2b", help="stage1 job preset (launch/jobs/stage1.yaml)")
    s1.add_argument("--steps", type=int, default=16)
    s1.add_argument("--batch-rows", type=int, default=None)
    s1.add_argument("--row-len", type=int, default=None)
    s1.add_argument("--deepspeed", choices=("on", "off", "auto"), default="on")
    df = sub.add_parser("dflash")
    df.add_argument("--topologies", default="1-1", help="k-1 topologies, comma-separated")
    df.add_argument("--target", default="qwen35-0.8b")
    df.add_argument("--drafter", default="tiny")
    df.add_argument("--anchors", default="4", help="anchors per sequence, comma-separated: one run each")
    df.add_argument("--steps", type=int, default=40)
    df.add_argument("--token-budget", type=int, default=16384)
    df.add_argument("--max-len", type=int, default=4096)
    df.add_argument("--samples", type=int, default=400)
    df.add_argument("--queue-depth", type=int, default=4)
    for sp in (s1, df):
        sp.add_argument("--skip", type=int, default=4, help="first steps left out (compile, autotune)")
        sp.add_argument("--work", default="/tmp/multigpu-bench")
        sp.add_argument("--timeout", type=float, default=540, help="seconds per run")
        sp.add_argument("--jsonl", default=None)
        sp.add_argument("extra", nargs="*", help="more trainer arguments, after --")
    a = p.parse_args()
    rows = bench_stage1(a) if a.bench == "stage1" else bench_dflash(a)
    if a.jsonl:
        with open(a.jsonl, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    (print_stage1 if a.bench == "stage1" else print_dflash)(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
