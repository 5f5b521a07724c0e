"""Distributed layout from the Slurm environment (parsed by submitit), and the 1-process case."""

from __future__ import annotations

import pytest
import torch

from train.common.distributed import init_distributed, slurm_layout


def _clear_slurm(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for key in list(os.environ):
        if key.startswith("SLURM_") or key in ("MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(key)


def test_layout_from_slurm_env(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    _clear_slurm(monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path))  # no scontrol: the first node's name is the address
    monkeypatch.setenv("SLURM_JOB_ID", "4321")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[07-08]")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    monkeypatch.setenv("SLURM_NTASKS", "16")
    monkeypatch.setenv("SLURM_PROCID", "11")
    monkeypatch.setenv("SLURM_LOCALID", "3")
    rank, world, local, addr, port = slurm_layout()
    assert (rank, world, local, addr) == (11, 16, 3, "gpu07")
    assert 20000 <= port < 32000
    monkeypatch.setenv("SLURM_PROCID", "0")
    assert slurm_layout()[4] == port  # every rank of the job agrees on the port


def test_rank_from_node_and_local_id_without_procid(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A task that did not come through srun has no SLURM_PROCID: Slurm's block layout gives
    rank = tasks on the nodes before it + its local id."""
    from train.common.distributed import _tasks_per_node, node_layout

    assert _tasks_per_node("2(x3),1") == [2, 2, 2, 1] and _tasks_per_node("8") == [8]
    with pytest.raises(ValueError, match="SLURM_TASKS_PER_NODE"):
        _tasks_per_node("2(x")
    _clear_slurm(monkeypatch)
    monkeypatch.setenv("PATH", str(tmp_path))
    for key, value in dict(SLURM_JOB_ID="77", SLURM_JOB_NODELIST="n[1-4]", SLURM_JOB_NUM_NODES="4",
                           SLURM_NTASKS="7", SLURM_TASKS_PER_NODE="2(x3),1", SLURM_NODEID="3",
                           SLURM_LOCALID="0").items():
        monkeypatch.setenv(key, value)
    assert slurm_layout()[:4] == (6, 7, 0, "n1")
    monkeypatch.setenv("SLURM_NODEID", "1")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    assert slurm_layout()[0] == 3 and node_layout() == (1, 4)
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.9")
    assert slurm_layout()[3] == "10.0.0.9"  # an explicit address wins


def test_single_process_needs_no_group(monkeypatch: pytest.MonkeyPatch) -> None:
    _clear_slurm(monkeypatch)
    info = init_distributed(torch.device("cpu"))
    assert (info.rank, info.world_size, info.initialized_here) == (0, 1, False)
    assert not torch.distributed.is_initialized()


def test_forced_one_rank_gloo_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed wants a process group even for one process: gloo on CPU."""
    from train.common.distributed import shutdown_distributed

    _clear_slurm(monkeypatch)
    import socket

    with socket.socket() as sock:  # a free port for the rendezvous
        sock.bind(("127.0.0.1", 0))
        monkeypatch.setenv("MASTER_PORT", str(sock.getsockname()[1]))
    info = init_distributed(torch.device("cpu"), force_group=True)
    try:
        assert info.initialized_here and info.backend == "gloo"
        t = torch.ones(2)
        torch.distributed.all_reduce(t)
        assert t.tolist() == [1.0, 1.0]
    finally:
        shutdown_distributed(info)
    assert not torch.distributed.is_initialized()


@pytest.mark.slow
def test_two_rank_ddp_training_on_gloo(tmp_path) -> None:
    """Two trainer processes laid out by a (faked, guard-off) Slurm env: gloo rendezvous, DDP,
    per-rank trainer state in one checkpoint."""
    import os
    import socket
    import subprocess
    import sys
    from pathlib import Path

    from tests.stage1_fixtures import FAST_ARGS, make_data

    data = make_data(tmp_path)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "run"
    code = ("import sys; from train.stage1.train import main; "
            f"sys.exit(main({[*FAST_ARGS, '--out', str(out), '--data-dir', str(data), '--steps', '2', '--ckpt-every', '2', '--deepspeed', 'off', '--num-workers', '0']!r}, guard=False))")
    base = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    base.update(PYTHONPATH=str(Path(__file__).resolve().parents[1]), SLURM_JOB_ID="99", SLURM_NTASKS="2",
                SLURM_JOB_NODELIST="localhost", SLURM_JOB_NUM_NODES="1", MASTER_PORT=str(port))
    procs = [subprocess.Popen([sys.executable, "-c", code], env={**base, "SLURM_PROCID": str(r), "SLURM_LOCALID": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in (0, 1)]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outputs
    assert "world=2" in outputs[0] and "step 2/2 " in outputs[0]
    assert "step" not in outputs[1]  # only rank 0 logs
    ckpt = out / "checkpoints" / "step_00000002"
    assert {p.name for p in ckpt.iterdir()} >= {"model.pt", "trainer_rank00000.pt", "trainer_rank00001.pt"}
    # Per-rank timings gathered from both ranks: the straggler signal of multi-GPU runs.
    import json

    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "step" in r and "loss" in r]
    assert len(steps) == 2
    for rec in steps:
        assert len(rec["rank_fwd_ms"]) == 2 and all(ms > 0 for ms in rec["rank_fwd_ms"])
        assert all(f <= c for f, c in zip(rec["rank_fwd_ms"], rec["rank_compute_ms"], strict=True))
        assert rec["fwd_spread"] >= 0
