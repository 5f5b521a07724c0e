"""The tiny stage-1 run on CPU (guard off: this tests the loop, not the Slurm entry)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from tests.stage1_fixtures import make_data, run, step_records
from train.stage1 import model as stage1_model
from train.stage1.data import TASKS

STEP_FIELDS = {"step", "loss", "task_loss", "tok_s", "real_tok_s", "mfu", "mfu_useful", "data_ms", "compute_ms",
               "peak_mem_mb", "compiles", "recompiles", "lr", "grad_norm", "packing_efficiency", "batch_index",
               "batch_digest", "steps_total", "eta_s"}


def test_tiny_run_learns_and_logs(tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    # gen_img/replay_img images go through the vision tower: count its forward calls and images.
    vision_calls: list[int] = []
    real_build = stage1_model.build_model

    def build(*args, **kwargs):
        model, spec = real_build(*args, **kwargs)
        if kwargs.get("vision"):
            model.model.visual.register_forward_hook(
                lambda m, args, kw, out: vision_calls.append(len(kw["grid_thw"])), with_kwargs=True)
        return model, spec

    monkeypatch.setattr(stage1_model, "build_model", build)
    out = tmp_path / "run"
    assert run(out, make_data(tmp_path), 20, "--ckpt-every", "10", "--profile-step", "3") == 0
    stdout = capsys.readouterr().out
    # --profile-step: that one step under torch.profiler, its time by family and its top ops
    profile = stdout[stdout.index("# profile of step 3: "):].splitlines()
    assert float(profile[0].split(": ")[1].split(" ms")[0]) > 0 and profile[1] == "| family | ms | share |"
    assert any(line.startswith("| `aten::") for line in profile) and stdout.count("# profile of step") == 1
    # most steps hold images: ~0.93 images a step in the long run (185 in 200 batches of these
    # draws); the first 20 are noisier (the carry-over buffer delays a drawn document a few steps)
    assert len(vision_calls) >= 10 and sum(vision_calls) >= 12, vision_calls

    header, *_ = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert header["event"] == "header" and "torchtitan" in header["mfu_convention"]
    # the vision budget, derived on the CPU from the host's memory, bounds the demo too
    assert header["kernel_archive"].startswith("none looked for")
    assert "# kernel compiles by the end of step 1: triton " in stdout  # (caches shared with other processes here)
    assert "vision tokens" in header["vision_budget"] and "host memory (cpu)" in header["vision_budget"]
    assert "# MFU (torchtitan)" in stdout and "kernels[cpu]" in stdout
    assert "# compile: off" in stdout and "# packing: rows" in stdout  # the CPU demo never compiles

    recs = step_records(out)
    assert [r["step"] for r in recs] == list(range(1, 21))
    # nothing compiles during the run (dynamo's counters are per process: earlier tests may have)
    assert len({(r["compiles"], r["recompiles"]) for r in recs}) == 1
    for r in recs:
        assert STEP_FIELDS <= set(r), STEP_FIELDS - set(r)
        assert r["data_ms"] >= 0 and r["compute_ms"] > 0 and 0 < r["real_tok_s"] <= r["tok_s"]
        assert r["mfu"] is None and r["mfu_useful"] is None  # no known peak on a CPU: no MFU
        assert r["grad_norm"] > 0
        assert set(r["task_loss"]) <= set(TASKS)
        assert r["vision_tokens"] == 4 * r["images"] and r["budget_waits"] == 0  # tiny images: 4 tokens each
        assert (r["vision_fwd_ms"] > 0) == (r["images"] > 0) and r["vision_mfu"] is None  # no peak on a CPU
    assert set().union(*(r["task_loss"] for r in recs)) == set(TASKS)  # every task was trained on
    first = statistics.mean(r["loss"] for r in recs[:3])
    last = statistics.mean(r["loss"] for r in recs[-3:])
    assert last < first - 1.0, (first, last)
    # the lr the step used: step 1 runs at the warmup's first value (lr / warmup), not the next one's
    assert [r["lr"] for r in recs[:3]] == pytest.approx([1e-3, 2e-3, 3e-3])
    assert "# mixture: gen_img 0.218 (images: tower), gen_txt 0.217" in stdout and "replay_img 0.237 (images: tower)" in stdout
    assert all(r["steps_total"] == 20 for r in recs) and recs[-1]["eta_s"] == 0
    # 10 steps left at the median of this process's steps 2-10 (its first compiles): the same
    # steps the ETA saw, so the check holds on a loaded machine, where steps with images and
    # steps without them differ the most
    median = statistics.median(r["data_ms"] + r["compute_ms"] for r in recs[1:10]) / 1000
    assert recs[9]["eta_s"] == pytest.approx(10 * median, rel=1e-6)
    # one compact line a step: `step n/N`, every task's loss by its short name, the ETA, <= 120 chars
    lines = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(lines) == 20 and all(len(line) <= 120 for line in lines)
    assert lines[0].startswith("step 1/20 loss ") and " uMFU n/a " in lines[0]
    assert all(all(f" {t} " in line or f"({t} " in line for t in ("gi", "gt", "un", "ri", "rt")) for line in lines)
    assert lines[-1].endswith("eta 0s") and all(" eta " in line for line in lines)

    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["first_loss"] == recs[0]["loss"]
    assert summary["last_loss"] == recs[-1]["loss"] and summary["tok_s_all_ranks"] > 0
    assert not any("tok_s" in k for k in summary if k != "tok_s_all_ranks")  # one throughput figure
    assert Path(summary["out_dir"]) == out.resolve()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000020"
    outcome = json.loads((out / "outcome.json").read_text())
    assert (outcome["state"], outcome["step"], outcome["error"]) == ("completed", 20, None)

    # The export loads the documented way and generates from text (issue 38.1): the byte-level
    # stand-in ships as a real tokenizer. Oracle: the run's own encoding, UTF-8 byte b -> id 8 + b.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    export = Path(summary["export"])
    assert "`AutoTokenizer.from_pretrained(DIR)`" in (export / "README.md").read_text()
    tok = AutoTokenizer.from_pretrained(export, local_files_only=True)
    text = "Hello, wörld"
    ids = tok(text, return_tensors="pt").input_ids
    assert ids[0].tolist() == [8 + b for b in text.encode()]
    model = AutoModelForCausalLM.from_pretrained(export, local_files_only=True).eval()
    gen = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert gen.shape == (1, ids.shape[1] + 4) and int(gen.max()) < len(tok)  # every generated id decodes
    assert tok.decode(gen[0]).startswith(text)
    # ... and every id the tokenizer can produce has a row: its specials, another model family's
    # end-of-text (plain bytes here), an added token (AutoTokenizer's length counts those).
    rows = model.get_input_embeddings().num_embeddings
    assert len(tok) <= rows and max(tok.get_vocab().values()) < rows, (len(tok), rows)
    probe = tok("<|endoftext|><bos><eos><pad><|im_start|>" + text, return_tensors="pt").input_ids
    assert int(probe.max()) < rows
    model(probe)
