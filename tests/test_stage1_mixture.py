"""Stage-1's mixture as the user gets it: image tasks are trained (the VLM is the default) or
refused at submit, never dropped silently, and both batch layouts train on the drawn mixture."""

from __future__ import annotations

import collections
import json
from pathlib import Path

import pytest
from transformers import AutoConfig

from tests.stage1_fixtures import make_data
from train.common.config import ConfigError
from train.common.shapes import get_shape
from train.stage1.data import REFERENCE_COUNTS, TASKS, DataConfig, PackedBatches
from train.stage1.tokenizer import build_tokenizer
from train.stage1.train import check_tasks, parse_args


@pytest.mark.parametrize("layout", ["rows", "flat"])
def test_a_long_run_trains_on_the_weights(tmp_path: Path, layout: str) -> None:
    """Documents per task over 400 batches (~4,000 documents) against the mixture weights, within
    2 points: first-fit rows (gap-filling, then the unemitted rows thrown away) had replay_img 4.6
    points over its weight here, and gen_img at half its weight on the 8192-token mix."""
    data = make_data(tmp_path)
    tok = build_tokenizer(get_shape("tiny"), None, vision=True)
    weights = {t: c / sum(REFERENCE_COUNTS.values()) for t, c in REFERENCE_COUNTS.items()}
    batches = iter(PackedBatches(DataConfig(str(data), row_len=256, batch_rows=2, packing=layout, num_workers=0),
                                 tok, rank=0))
    docs: collections.Counter[str] = collections.Counter()
    for _ in range(400):
        batch = next(batches)
        starts = (batch["position_ids"] == 0) & (batch["task_ids"] >= 0)  # every document's first token
        docs.update(TASKS[t] for t in batch["task_ids"][starts].tolist())
    n = sum(docs.values())
    assert n > 3000
    off = {t: round(docs[t] / n - weights[t], 4) for t in TASKS}
    assert all(abs(d) < 0.02 for d in off.values()), off


def test_submit_check_keeps_image_tasks_or_refuses(tmp_path: Path) -> None:
    """The default (random init) trains the tower; vision off is fine with text-only weights; a
    text-only checkpoint with the default mixture is refused in one line naming both ways out."""
    check_tasks(parse_args(["--shape", "tiny"]), 1)
    check_tasks(parse_args(["--vision", "off", "--weights", json.dumps({"und": 1, "replay_text": 2})]), 1)
    with pytest.raises(ConfigError, match=r"task\(s\) gen_img, replay_img carry images but --vision off"):
        check_tasks(parse_args(["--vision", "off"]), 1)
    vlm, text = tmp_path / "vlm", tmp_path / "text"
    # configs as transformers writes them (a checkpoint's own config.json; no weights needed here)
    AutoConfig.for_model("qwen3_5").save_pretrained(vlm)
    AutoConfig.for_model("qwen3_5_text").save_pretrained(text)
    check_tasks(parse_args(["--init-from", str(vlm)]), 1)
    with pytest.raises(ConfigError) as exc:
        check_tasks(parse_args(["--init-from", str(text), "--weights", '{"replay_img": 1, "und": 1}']), 1)
    msg = str(exc.value)
    assert "\n" not in msg and "task(s) replay_img carry images" in msg and f"checkpoint {text} has no vision" in msg
    # never --arg vision=on: submit would take it and the job refuse it at start; what trains instead
    assert "vision=on" not in msg and """--arg weights='{"gen_txt": 1, "und": 1, "replay_text": 1}'""" in msg
    assert msg.endswith("or an --init-from checkpoint with one")
    with pytest.raises(ConfigError, match=rf"--vision on: checkpoint {text}: no vision tower"):
        parse_args(["--init-from", str(text), "--vision", "on"])  # refused at submit, not at the job's start
    # a checkpoint that is not here is refused at parse time, before any task check (one line at submit)
    with pytest.raises(ConfigError, match=r"--init-from \S+elsewhere: not a directory"):
        parse_args(["--init-from", str(tmp_path / "elsewhere")])
