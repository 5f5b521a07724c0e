"""THE ORACLE from a real checkpoint: a packed batch trains each document as if it were alone.

The random-init oracles (test_oracle, test_vision) build their configs with ``use_cache=False``.
Every transformers checkpoint says ``use_cache: true`` (Qwen3.5's own, and the stage-1 export);
with a cache present transformers' ``create_causal_mask`` skips the per-document mask it
derives from ``position_ids``, and sdpa attends across the documents of a row. So here:

Model: a tiny Qwen3.5 saved with ``save_pretrained`` with ``use_cache: true`` (text, and with
its vision tower), loaded by the trainer's ``build_model(init_from=...)``, its kernels and
attention lever applied as the trainer does, the per-token loss from the trainer's objective.
Reference: the same weights in transformers' stock modules, each document alone. Both batch
layouts (rows, flat) and both attention paths that run on a CPU (sdpa, varlen).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.hf_fixtures import make_checkpoint
from train.common.fastpath import install_kernels, select_kernels
from train.common.levers import Levers, apply_levers
from train.common.packing import IGNORE_INDEX, Document, collate, layout_packer, model_kwargs
from train.common.shapes import get_shape
from train.stage1.data import load_manifests, tokenize_record
from train.stage1.model import build_model
from train.stage1.objective import CausalLMObjective
from train.stage1.synthetic import generate_synthetic
from train.stage1.tokenizer import build_tokenizer

ROW_LEN = 160
BATCH_ROWS = 2

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt-oracle") / "data"
    generate_synthetic(root, samples=30, seed=0)
    return root


@pytest.fixture(scope="module", params=["text", "vlm"])
def setup(request, tmp_path_factory, data):
    vision = request.param == "vlm"
    ckpt = make_checkpoint(tmp_path_factory.mktemp(f"ckpt-{request.param}"), vision=vision)
    config = json.loads((ckpt / "config.json").read_text())
    assert config.get("text_config", config)["use_cache"] is True  # as every real checkpoint
    tok = build_tokenizer(get_shape("tiny"), ckpt, vision)
    model, _ = build_model("tiny", init_from=ckpt, vision=vision, vision_ids=tok.vision_ids)
    stock = copy.deepcopy(model).eval()  # transformers' own modules, before the trainer's kernels
    install_kernels(model, select_kernels("cpu"))
    model.train()  # the training forward
    man = load_manifests(data)
    tasks = ["gen_img", "und", "replay_img", "gen_txt", "replay_text", "gen_img"] if vision else \
        ["und", "gen_txt", "replay_text", "und", "gen_txt", "replay_text"]
    seen: dict[str, int] = {}
    docs = []
    for task in tasks:
        i = seen[task] = seen.get(task, -1) + 1
        docs.append(tokenize_record(tok, data, task, man.records[task][i][1]))
    assert sum(len(d.tokens) for d in docs) <= ROW_LEN * BATCH_ROWS - 40  # every document fits whole
    if vision:
        assert sum(bool(d.images) for d in docs) >= 3
    return model, stock, docs


def packed(docs: list[Document], layout: str):
    rows = list(layout_packer(layout, ROW_LEN, BATCH_ROWS, close_below=1).pack(docs))
    rows = rows[: BATCH_ROWS if layout == "rows" else 1]
    # (row, start, end) of each document, in the order of docs (a row takes them first-fit)
    where = {}
    for r_i, row in enumerate(rows):
        cu = row.cu_seqlens.tolist()
        for a, b in zip(cu[:-1], cu[1:], strict=True):
            if a < row.n_real_tokens:
                i = next(i for i, d in enumerate(docs) if i not in where and d.tokens == row.input_ids[a:b].tolist())
                where[i] = (r_i, a, b)
    assert len(where) == len(docs)
    return rows, collate(rows), [where[i] for i in range(len(docs))]


def train_losses(model, batch) -> torch.Tensor:
    """Per-token loss [B, T-1] of the trainer's objective (labels[t] is scored at t-1)."""
    kwargs = model_kwargs(batch)
    labels = kwargs.pop("labels")
    with torch.no_grad():
        return CausalLMObjective(model, "logits")(labels, **kwargs)


def alone_losses(stock, doc: Document, labels: torch.Tensor) -> torch.Tensor:
    """Per-token loss of one document through transformers' stock forward, with the packed labels."""
    ids = torch.tensor([doc.tokens])
    kwargs = {}
    if doc.images:
        image_id = stock.config.image_token_id
        kwargs = dict(pixel_values=torch.cat([i.pixel_values for i in doc.images]),
                      image_grid_thw=torch.tensor([i.grid_thw for i in doc.images]),
                      mm_token_type_ids=(ids == image_id).int())
    with torch.no_grad():
        logits = stock(input_ids=ids, **kwargs).logits[0, :-1]
    return F.cross_entropy(logits, labels[1:], ignore_index=IGNORE_INDEX, reduction="none")


def perturbed(doc: Document) -> Document:
    """The same document with one text token changed (and its images' pixels, if it has any)."""
    tokens = list(doc.tokens)
    image_spans = {t for img in doc.images for t in range(img.start - 1, img.end + 1)}
    k = next(t for t in range(2, len(tokens)) if t not in image_spans)
    # a text token of the checkpoint's tokenizer (the new codebook rows all start as the same mean row)
    tokens[k] = 100 if tokens[k] != 100 else 101
    images = [type(img)(img.pixel_values + 0.5, img.grid_thw, img.spatial_merge_size, img.start)
              for img in doc.images]
    return Document(tokens, doc.task, images)


@pytest.mark.parametrize("attention", ["sdpa", "varlen"])
@pytest.mark.parametrize("layout", ["rows", "flat"])
def test_checkpoint_trains_each_document_as_if_alone(setup, layout, attention):
    model, stock, docs = setup
    lines = apply_levers(model, torch.device("cpu"), Levers(compile="off", attention=attention))
    assert "no KV cache" in lines[0]  # the header says what runs
    _, batch, segments = packed(docs, layout)
    losses = train_losses(model, batch)
    for doc, (r, a, b) in zip(docs, segments, strict=True):
        want = alone_losses(stock, doc, batch["labels"][r, a:b])
        got = losses[r, a : b - 1]
        assert float((got - want).abs().max()) <= 1e-5, f"document at {r}:{a}-{b}"
    # changing one document (a token, and its images) moves no other document's loss
    for j in (0, len(docs) // 2):
        _, batch2, segments2 = packed([perturbed(d) if i == j else d for i, d in enumerate(docs)], layout)
        assert segments2 == segments
        losses2 = train_losses(model, batch2)
        moved = (losses2 - losses).abs()
        for i, (r, a, b) in enumerate(segments):
            if i != j:
                assert float(moved[r, a : b - 1].max()) <= 1e-6, f"document {i} moved when document {j} changed"
        r, a, b = segments[j]
        assert float(moved[r, a : b - 1].max()) > 1e-4  # the change itself is seen
