"""`--topology auto` (launch submit dflash --arg topology=auto): the k-m split chosen from
measured times. The choice against hand-computed rates; the real probe (the trainer's own target
batch and drafter step) on a tiny random target on the CPU, its one-screen reasoning and plan.json."""

from __future__ import annotations

import json

import pytest

from train.dflash import train as dflash_train
from train.dflash.plan import Probe, choose, report


def probe(target_s: float, drafter_s: float, gpus: int = 8) -> Probe:
    return Probe(target_s=target_s, drafter_s=drafter_s, samples_per_batch=10.0, tokens_per_batch=20000.0,
                 bytes_per_token=4 + 1 + 6 * 2048 * 2, total_samples=1000, total_tokens=2_000_000, gpus=gpus)


def test_k_and_m_from_the_measured_times():
    """target 0.9 s, drafter 0.3 s per batch, 10 samples each: k targets and m drafters go through
    min(k / 0.9, m / 0.3) batches/s. On 8 GPUs 6-2 balances them (66.7 samples/s; 3-1 on 4 GPUs
    gives half). A slower target (2.9 s) wants 9.67 targets per drafter: 7-1, bound by the targets.
    A drafter-bound probe (target 0.1 s, drafter 1.0 s) gets 1-7: more than one drafter rank."""
    plan = choose(probe(0.9, 0.3))
    assert (plan.k, plan.m) == (6, 2) and plan.samples_s == pytest.approx(6 / 0.9 * 10) and plan.bound == "both"
    assert {n: (k, m) for n, k, m, _ in plan.rates}[4] == (3, 1)
    assert {n: r for n, _, _, r in plan.rates}[4] == pytest.approx(3 / 0.9 * 10)
    assert plan.offline_disk_bytes == (5 + 6 * 2048 * 2) * 2_000_000
    assert plan.offline_extract_s == pytest.approx(100 * 0.9 / 8)
    slow = choose(probe(2.9, 0.3))
    assert (slow.k, slow.m) == (7, 1) and slow.bound == "targets" and slow.samples_s == pytest.approx(7 / 2.9 * 10)
    bound = choose(probe(0.1, 1.0))
    assert (bound.k, bound.m) == (1, 7) and bound.m > 1 and bound.samples_s == pytest.approx(7 / 1.0 * 10)
    assert bound.bound == "drafters"
    lines = report(probe(0.1, 1.0), bound)
    assert len(lines) <= 24 and "topology=1-7 --gpus-per-node 8" in lines[-1]
    assert any("<- chosen" in ln and "1-7" in ln for ln in lines)
    with pytest.raises(ValueError, match="at least 2 GPUs"):
        choose(probe(1, 1, gpus=1))


def test_topology_auto_probes_the_tiny_target_on_cpu_and_prints_its_plan(tmp_path, capsys):
    out = tmp_path / "plan"
    args = ["--mode", "online", "--topology", "auto", "--plan-gpus", "8", "--preset", "tiny", "--layers", "1,2",
            "--synthetic-samples", "24", "--token-budget", "256", "--max-len", "128", "--block-size", "4",
            "--anchors", "8", "--out", str(out)]
    assert dflash_train.main(args, guard=False) == 0
    printed = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("# ") and "truncated" not in ln]
    saved = json.loads((out / "plan.json").read_text())
    p, plan = Probe(**saved["probe"]), saved["plan"]
    assert p.target_s > 0 and p.drafter_s > 0 and p.gpus == 8 and p.total_samples == 24
    assert (choose(p).k, choose(p).m) == (plan["k"], plan["m"]) and 2 <= plan["k"] + plan["m"] <= 8
    assert printed == report(p, choose(p)) and len(printed) <= 24
    assert f"topology={plan['k']}-{plan['m']}" in printed[-1]
    # the launcher's pre-submit check accepts auto on any node of >= 2 GPUs, and refuses 1
    cfg = dflash_train.parse_args(["--mode", "online", "--topology", "auto"])
    dflash_train.check_tasks(cfg, 8)
    with pytest.raises(ValueError, match=">= 2 tasks"):
        dflash_train.check_tasks(cfg, 1)


@pytest.mark.slow
def test_two_targets_feed_two_data_parallel_drafters_on_gloo(tmp_path):
    """topology 2-2: four processes laid out by a (faked, guard-off) Slurm env on gloo, the tiny
    random target on ranks 0-1, two drafters on ranks 2-3 each training on its own stream batch
    (batch i: target i % 2, drafter 2 + i % 2) with their gradients all-reduced. The loss falls,
    and the two drafters end with equal weights (summary.json, gathered over their group)."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "run"
    steps = 16
    args = ["--mode", "online", "--topology", "2-2", "--preset", "tiny", "--layers", "1,2", "--synthetic-samples",
            "48", "--steps", str(steps), "--token-budget", "256", "--max-len", "128", "--block-size", "4",
            "--anchors", "32", "--lr", "5e-3", "--warmup", "2", "--out", str(out)]
    code = f"import sys; from train.dflash.train import main; sys.exit(main({args!r}, guard=False))"
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    base.update(PYTHONPATH=str(Path(__file__).resolve().parents[1]), SLURM_JOB_ID="98", SLURM_NTASKS="4",
                SLURM_JOB_NODELIST="localhost", SLURM_JOB_NUM_NODES="1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(4)]
    outputs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outputs
    assert all("sent 16 batches" in outputs[r] for r in (0, 1)), outputs[:2]  # 16 steps x 2 drafters / 2 targets
    recs = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("event") == "step"]
    losses = [r["loss"] for r in recs]
    assert len(losses) == steps and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3 - 0.5, losses
    summary = json.loads((out / "summary.json").read_text())
    assert summary["drafter_ranks"] == 2 and summary["drafter_ranks_equal"] is True
