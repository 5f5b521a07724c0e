"""bench/stage1_levers.py itself, at tiny size on the CPU (the H200 numbers come from the same code)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[1] / "bench" / "stage1_levers.py"


@pytest.mark.slow
def test_levers_bench_smoke(tmp_path, capsys, monkeypatch):
    spec = importlib.util.spec_from_file_location("stage1_levers", BENCH)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "stage1_levers", bench)  # its dataclasses look their module up
    spec.loader.exec_module(bench)
    argv = ["--cpu-smoke", "--out", str(tmp_path), "--variants", "eager-2,compiled-2,flat-4",
            "--warmup", "1", "--steps", "1", "--row-len", "128"]
    torch._dynamo.reset()  # graphs other tests compiled for these shapes would be reused, not counted
    assert bench.main(argv) == 0
    rows = {r["variant"]: r for r in map(json.loads, (tmp_path / "levers.jsonl").read_text().splitlines())}
    assert set(rows) == {"eager-2", "compiled-2", "flat-4"}
    assert not [r["error"] for r in rows.values() if "error" in r]
    # the same init and batches: compiled regions compute what eager does
    assert rows["compiled-2"]["first_loss"] == pytest.approx(rows["eager-2"]["first_loss"], abs=1e-5)
    assert rows["compiled-2"]["graphs_warmup"] > 0 and rows["eager-2"]["graphs_warmup"] == 0
    assert all(r["recompiles"] == 0 for r in rows.values())
    assert rows["flat-4"]["tokens_per_step"] == 4 * 128 and rows["flat-4"]["packing_eff"] >= 0.85  # whole documents: the stream ends padded
    for r in rows.values():
        assert r["useful_tok_s"] <= r["tok_s"] and r["mfu"] is None  # no MFU without a known peak (CPU)
    out = capsys.readouterr().out
    assert "uMFU" in out and "flat-4" in out
