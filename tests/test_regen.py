"""Regeneration with the target: batched transformers generate on the tiny target (CPU), resumable
part files, and output the extraction and the DFlash loader read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dflash_fixtures import write_conversations

from train.regen import regen as rg


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A tiny stage-1 target saved with save_pretrained, its tokenizer and chat template beside it:
    what `make sample-target` ships."""
    from train.common.sample_target import make_target

    return make_target(tmp_path_factory.mktemp("target"))


def test_regenerates_resumes_and_feeds_extraction(target, tmp_path, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.dflash.data import ShardDataset
    from train.extract import extract as ex

    data = write_conversations(tmp_path / "chat.jsonl", 5, n_words=4)
    out = tmp_path / "regen"
    args = ["--init-from", str(target), "--data", str(data), "--out", str(out), "--batch-size", "2",
            "--max-new-tokens", "6", "--temperature", "0"]
    assert rg.main([*args, "--stop-after", "1"], guard=False) == 0
    assert sorted(p.name for p in out.glob("part_*")) == ["part_00000.jsonl"] and not (out / "data.jsonl").exists()
    first = (out / "part_00000.jsonl").read_bytes()
    assert rg.main(args, guard=False) == 0  # resumes: keeps part 0, writes parts 1 and 2
    printed = capsys.readouterr().out
    assert '"skipped": 1' in printed and (out / "part_00000.jsonl").read_bytes() == first
    # one line a part: `part n/N`, its rate and an ETA for the parts left (38.9)
    parts = [ln for ln in printed.splitlines() if ln.startswith("part ")]
    assert [ln.split(" | ")[0] for ln in parts] == ["part 1/3", "part 2/3", "part 3/3"]
    assert parts[-1].endswith(" | eta 0s") and all(" | eta " in ln for ln in parts)
    rows = [json.loads(x) for x in (out / "data.jsonl").read_text().splitlines()]
    originals = [json.loads(x) for x in data.read_text().splitlines()]
    assert [r["id"] for r in rows] == [o["id"] for o in originals]

    # Oracle: each conversation alone, unpadded, greedy, through transformers directly.
    tok = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(str(target), local_files_only=True, dtype=torch.float32).eval()
    for row, orig in zip(rows, originals, strict=True):
        prompt = tok.apply_chat_template(orig["conversations"][:-1], tokenize=False, add_generation_prompt=True)
        ids = tok(prompt, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            gen = model.generate(**ids, do_sample=False, max_new_tokens=6, pad_token_id=tok.pad_token_id,
                                 eos_token_id=tok.eos_token_id)
        want = tok.decode(gen[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
        assert row["conversations"][-1] == {"role": "assistant", "content": want}
        assert row["conversations"][:-1] == orig["conversations"][:-1]  # prompts untouched
    # Other settings in the same --out: refused, one line.
    assert rg.main([*args, "--top-k", "5"], guard=False) == 1
    assert "different top_k" in capsys.readouterr().err

    # The regenerated data through extraction (the target's tokenizer), read by the DFlash loader.
    shards = tmp_path / "shards"
    assert ex.main(["--out", str(shards), "--data", str(out / "data.jsonl"), "--tokenizer", str(target),
                    "--layers", "1,2", "--token-budget", "512", "--max-len", "128"], guard=False) == 0
    ds = ShardDataset(shards)
    batch = ds.batch(list(range(len(ds))))
    assert batch is not None and batch["input_ids"].shape[0] == 5
    assert batch["loss_mask"].any(dim=1).all() and not batch["loss_mask"].all(dim=1).any()
