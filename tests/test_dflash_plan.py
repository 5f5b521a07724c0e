"""`--topology auto` (launch submit dflash --arg topology=auto): k for the k-1 split chosen from
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


def test_k_is_where_the_drafter_stops_keeping_up():
    """target 0.9 s, drafter 0.3 s per batch: k targets give min(k / 0.9, 1 / 0.3) batches/s, 10
    samples each; k = 3 reaches the drafter's 33.3 samples/s, more adds nothing. A slower target
    (2.9 s) wants 9.67 targets, the node gives 7: all of them, bound by the targets."""
    plan = choose(probe(0.9, 0.3))
    assert plan.k == 3 and plan.samples_s == pytest.approx(10 / 0.3) and plan.bound == "drafter"
    assert dict(plan.rates)[2] == pytest.approx(2 / 0.9 * 10)
    assert plan.offline_disk_bytes == (5 + 6 * 2048 * 2) * 2_000_000
    assert plan.offline_extract_s == pytest.approx(100 * 0.9 / 8)
    slow = choose(probe(2.9, 0.3))
    assert slow.k == 7 and slow.bound == "targets" and slow.samples_s == pytest.approx(7 / 2.9 * 10)
    lines = report(probe(0.9, 0.3), plan)
    assert len(lines) <= 24 and "topology=3-1 --gpus-per-node 4" in lines[-1]
    assert any("<- chosen" in ln and ln.split("|")[0].strip(" #") == "3" for ln in lines)
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
    assert choose(p).k == plan["k"] and 1 <= plan["k"] <= 7
    assert printed == report(p, choose(p)) and len(printed) <= 24
    assert f"topology={plan['k']}-1" in printed[-1]
    # the launcher's pre-submit check accepts auto on any node of >= 2 GPUs, and refuses 1
    cfg = dflash_train.parse_args(["--mode", "online", "--topology", "auto"])
    dflash_train.check_tasks(cfg, 8)
    with pytest.raises(ValueError, match=">= 2 tasks"):
        dflash_train.check_tasks(cfg, 1)
