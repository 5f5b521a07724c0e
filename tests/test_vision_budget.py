"""The per-step vision budget (train/common/vision_budget.py) as the batch builder applies it.

Oracle: what the data would have put in a step without the budget (every document of a stream of
the largest images fits the packed stream by length alone), against what the budget allows.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from train.common.shapes import get_shape
from train.common.vision_budget import MAX_IMAGES_PER_STEP, check_fits, derive_budget, fixed_budget
from train.stage1.data import (
    DataConfig,
    PackedBatches,
    Stage1Data,
    build_batch,
    tokenize_record,
)
from train.stage1.synthetic import generate_synthetic
from train.stage1.tokenizer import build_tokenizer

H200_BYTES = int(139.8 * 2**30)


def _image_dir(root: Path, sizes: list[tuple[int, int]]) -> Path:
    """replay_img records only, one image of each (w, h) (uniform colour: quick to decode)."""
    (root / "images").mkdir(parents=True)
    with open(root / "replay_img.jsonl", "w") as f:
        for i, (w, h) in enumerate(sizes):
            Image.new("RGB", (w, h), (i * 7 % 256, 90, 200)).save(root / "images" / f"{i}.png")
            f.write(json.dumps({"id": str(i), "image": f"images/{i}.png", "text": f"caption {i}"}) + "\n")
    return root


@pytest.fixture(scope="module")
def qwen35_2b_budget():
    """The budget the trainer derives for the qwen35-2b preset (4 x 8192 tokens a step) on one
    H200, from the model's real parameter count (built on the meta device: no memory)."""
    from train.stage1.model import build_model, text_model_config

    tok = build_tokenizer(get_shape("qwen35-2b"), None, vision=True)
    model, spec = build_model("qwen35-2b", device="meta", dtype=torch.bfloat16, vision=True,
                              vision_ids=tok.vision_ids)
    text = text_model_config(model)
    budget = derive_budget(vision=model.config.vision_config, params=spec.n_params, layers=text.num_hidden_layers,
                           hidden=text.hidden_size, step_tokens=4 * 8192, device_memory=H200_BYTES,
                           device_name="H200")
    return tok, budget


def test_a_step_of_only_the_largest_images_stays_within_the_budget(tmp_path: Path, qwen35_2b_budget):
    tok, budget = qwen35_2b_budget
    largest = tok.encoder.max_tokens  # 1024 for qwen35-2b (1024 x 1024 px)
    # Square images at the preset's largest, and larger ones the processor shrinks to it.
    data = _image_dir(tmp_path / "data", [(1024, 1024)] * 6 + [(2048, 2048), (1536, 1536)])
    cfg = DataConfig(str(data), row_len=8192, batch_rows=4, packing="flat", vision_budget=budget,
                     weights={"replay_img": 1})
    ds = PackedBatches(cfg, tok, rank=0)
    # Without the budget a step would hold as many of these images as fit its 32,768 tokens.
    one = tokenize_record(tok, data, "replay_img", ds.man.records["replay_img"][0][1])
    assert one.images[0].n_tokens == largest
    unbounded = (4 * 8192) // len(one.tokens)
    assert unbounded * largest > budget.tokens  # the oracle: the data alone would exceed the budget
    assert largest <= budget.tokens < 8 * largest  # the H200 holds a few largest images, not none, not all
    for k in range(2):
        batch = build_batch(ds.sampler, tok, cfg, k)
        grid = batch["image_grid_thw"]
        vision_tokens = int(grid.prod(-1).sum()) // 4
        assert vision_tokens == batch["vision_tokens"] <= budget.tokens
        assert len(grid) <= budget.images
        assert len(grid) == budget.tokens // largest  # the budget is used up, not left idle
        assert (grid.prod(-1) // 4 == largest).all()
        assert batch["input_ids"].shape == (1, 4 * 8192)  # same shape: the closed stream is padded
        # the images the budget could not take wait in the carry-over buffer for a later step
        assert batch["budget_waits"] > 0 and batch["carry"] and batch["over_budget"] == []


def test_header_estimate_equals_the_decoded_image(tmp_path: Path, qwen35_2b_budget):
    tok, _ = qwen35_2b_budget
    sizes = [(1024, 1024), (640, 480), (300, 2000), (33, 40), (3000, 1000), (1000, 999)]
    data = _image_dir(tmp_path / "data", sizes)
    for i in range(len(sizes)):
        path = data / "images" / f"{i}.png"
        assert tok.encoder.tokens_for(path) == tok.encoder(path).n_tokens, sizes[i]


def test_an_image_over_the_whole_budget_is_dropped_with_a_note(tmp_path: Path):
    tok = build_tokenizer(get_shape("tiny"), None, vision=True)
    data = tmp_path / "data"
    generate_synthetic(data, samples=40, seed=0)
    budget = fixed_budget(tok.encoder.min_tokens - 1 or 1, images=4)  # below every image (tiny: 4 tokens)
    assert tok.encoder.min_tokens > budget.tokens
    cfg = DataConfig(str(data), row_len=128, batch_rows=2, num_workers=0, vision_budget=budget,
                     weights={"replay_img": 1, "replay_text": 1})
    notes: list[str] = []
    loader = Stage1Data(cfg, tok, report=notes.append)
    batches = [next(loader) for _ in range(3)]
    assert all(b.get("image_grid_thw") is None for b in batches)
    assert all(int(b["n_real_tokens"]) > 0 for b in batches)  # the text documents still fill the step
    dropped = [n for n in notes if n.startswith("dropped (over the vision budget): ")]
    assert dropped and all("replay_img.jsonl:" in n for n in dropped)
    assert loader.over_budget >= len(dropped) and loader.bad_seen == 0  # counted apart from malformed records


def test_budgeted_batches_are_deterministic_and_bounded(tmp_path: Path):
    tok = build_tokenizer(get_shape("tiny"), None, vision=True)
    data = tmp_path / "data"
    generate_synthetic(data, samples=60, seed=1)
    budget = fixed_budget(3 * tok.encoder.max_tokens, images=2)
    cfg = DataConfig(str(data), row_len=128, batch_rows=4, vision_budget=budget,
                     weights={"gen_img": 1, "replay_img": 1, "replay_text": 1})
    ds = PackedBatches(cfg, tok, rank=0)
    unbounded = DataConfig(**{**cfg.__dict__, "vision_budget": None})
    most = max(len(build_batch(ds.sampler, tok, unbounded, k).get("image_grid_thw", [])) for k in range(4))
    assert most > budget.images  # the oracle: these batches draw more images than the budget allows
    for k in range(4):
        a, b = build_batch(ds.sampler, tok, cfg, k), build_batch(ds.sampler, tok, cfg, k)
        assert torch.equal(a["input_ids"], b["input_ids"])
        n = 0 if a.get("image_grid_thw") is None else len(a["image_grid_thw"])
        assert n <= budget.images and a["vision_tokens"] <= budget.tokens


def test_derived_budget_shrinks_with_the_step_and_grows_with_memory_and_shards():
    v = get_shape("qwen35-2b").vision
    base = dict(vision=v, params=2_379_252_272, layers=24, hidden=2048, step_tokens=32768, device_memory=H200_BYTES)
    b = derive_budget(**base)
    assert derive_budget(**{**base, "step_tokens": 2 * 32768}).tokens < b.tokens
    assert derive_budget(**{**base, "device_memory": 2 * H200_BYTES}).tokens > b.tokens
    assert derive_budget(**base, zero_shards=8).tokens > b.tokens
    h100 = derive_budget(**{**base, "device_memory": 80 * 2**30})
    assert h100.tokens == 0  # does not fit: no images; the trainer refuses to start rather than drop them all
    with pytest.raises(ValueError, match="cannot hold one of the largest images .* lower --batch-rows"):
        check_fits(h100, 1024)
    check_fits(b, 1024)
    assert b.images == min(MAX_IMAGES_PER_STEP, b.tokens)
    assert "GiB" in b.header() and str(b.tokens) in b.header()
    with pytest.raises(ValueError):
        fixed_budget(0)
    np.testing.assert_equal(fixed_budget(10).images, 10)
