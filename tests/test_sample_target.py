"""`make sample-target` (train/common/sample_target.py): a tiny chat target that transformers' own
Auto classes load from its directory, whose chat template renders the shipped conversations, and
that regen's own parser accepts at submit time."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from train.common.sample_target import main


def test_sample_target_loads_and_fits_the_walk_through(tmp_path: Path, capsys) -> None:
    assert main(["--out", str(tmp_path / "t"), "--conversations", "3"]) == 0
    said = capsys.readouterr().out.splitlines()
    model_dir, chat = tmp_path / "t" / "model", tmp_path / "t" / "chat.jsonl"
    assert said[-1] == f"next: launch submit regen --preset tiny --arg init_from={model_dir} --arg data={chat} --follow"
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32).eval()
    rows = [json.loads(ln) for ln in chat.read_text().splitlines()]
    assert len(rows) == 3 and [t["role"] for t in rows[0]["conversations"]] == ["system", "user", "assistant"]
    text = tok.apply_chat_template(rows[0]["conversations"], tokenize=False)
    assert text.count("<|im_start|>") == 3 and text.endswith("<|im_end|>\n")
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text  # the BPE round-trips the rendered conversation
    assert max(ids) < model.config.vocab_size and tok.eos_token == "<|im_end|>"
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), model.config.vocab_size) and torch.isfinite(logits).all()

    from train.regen.regen import parse_args

    cfg = parse_args(["--init-from", str(model_dir), "--data", str(chat)])  # what submit checks
    assert cfg.init_from == str(model_dir)

    # a second `make sample-target` onto the same directory: refused, the model untouched
    before = {p: p.read_bytes() for p in (tmp_path / "t").rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["--out", str(tmp_path / "t")]) == 2
    assert capsys.readouterr().err == (f"sample_target: error: {model_dir} already exists: nothing written; remove it "
                                       "or give another --out (make sample-target SAMPLE_TARGET_DIR=DIR)\n")
    assert {p: p.read_bytes() for p in (tmp_path / "t").rglob("*") if p.is_file()} == before
