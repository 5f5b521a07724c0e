"""Images through the Qwen3.5 vision tower: preprocessing, mrope positions, packing, THE ORACLE.

Model: the ``tiny`` preset with its tiny vision tower (``Qwen3_5ForConditionalGeneration``), fp32,
random-init, on CPU. Packed: the project's reference kernels (``install_kernels``) and the
trainer's forward (``objective.base_forward``) on a packed batch of image and text documents.
Reference: the same weights in transformers' stock modules, each document alone, with
transformers computing the 3-D positions itself (``get_rope_index`` from ``mm_token_type_ids``).
"""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from train.common.fastpath import install_kernels, select_kernels
from train.common.losses import token_losses
from train.common.packing import (
    IGNORE_INDEX,
    Document,
    ImageInput,
    Packer,
    collate,
    model_kwargs,
    mrope_positions,
)
from train.common.shapes import get_shape
from train.stage1.data import TASKS, DataConfig, PackedBatches, build_batch, load_manifests, tokenize_record
from train.stage1.model import build_model
from train.stage1.objective import base_forward
from train.stage1.synthetic import generate_synthetic
from train.stage1.tokenizer import build_tokenizer

TOK = build_tokenizer(get_shape("tiny"), None, vision=True)  # byte stand-in + the shape's image processor
IMAGE_ID = TOK.vision_ids["image_token_id"]
ROW_LEN = 128
TINY_VISION = get_shape("tiny").vision


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------------------------------------
# preprocessing


def test_image_encoder_emits_what_the_vision_tower_reads(tmp_path: Path):
    """The shape's processor resizes into [min_pixels, max_pixels] in patch*merge multiples."""
    from PIL import Image

    rng = np.random.default_rng(0)
    # by hand (smart_resize, factor 16): 200x90 -> 80x32 (shrunk to <= 64*64), 7x9 -> 32x48 (grown)
    for (h, w), grid in [((32, 48), (1, 4, 6)), ((200, 90), (1, 10, 4)), ((7, 9), (1, 4, 6))]:
        path = tmp_path / f"x{h}.png"
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
        img = TOK.encoder(path)
        assert tuple(img.grid_thw) == grid, (h, w, img.grid_thw)
        dim = 3 * TINY_VISION.temporal_patch_size * TINY_VISION.patch_size**2
        assert img.pixel_values.shape == (grid[1] * grid[2], dim) and img.pixel_values.dtype == torch.float32
        assert img.n_tokens == grid[1] * grid[2] // 4 <= TOK.encoder.max_tokens


def test_qwen35_images_come_in_a_few_patch_grids(tmp_path: Path):
    """The Qwen3.5 shapes bucket image sides to 128 px: square 448-1024 px images (19 grids
    unbucketed) give the 5 grids of 512..1024 px; a 1024 x 448 image keeps its aspect roughly."""
    from PIL import Image

    from train.stage1.vision import ImageEncoder, bucketed_size, image_processor_for_shape

    vision = get_shape("qwen35-2b").vision
    enc = ImageEncoder(image_processor_for_shape(vision), bucket=vision.size_bucket)
    assert vision.size_bucket == 128
    grids = set()
    for side in range(448, 1025, 32):
        path = tmp_path / f"s{side}.png"
        Image.new("RGB", (side, side), (side % 256, 10, 200)).save(path)
        grids.add(tuple(enc(path).grid_thw))
    assert grids == {(1, s // 16, s // 16) for s in (512, 640, 768, 896, 1024)}
    assert bucketed_size(448, 1024, 128, 64 * 64, 1024 * 1024) == (512, 1024)
    assert bucketed_size(1024, 1100, 128, 64 * 64, 1024 * 1024) == (1024, 1024)  # 1024 x 1152 is over max_pixels: the longer side steps down
    with pytest.raises(ValueError, match="not a multiple of patch x merge = 32"):
        ImageEncoder(image_processor_for_shape(vision), bucket=100)


# ------------------------------------------------------------------------------------------------
# positions and packing


def fake_image(grid: tuple[int, int, int], start: int, seed: int = 0) -> ImageInput:
    n = grid[0] * grid[1] * grid[2]
    dim = 3 * TINY_VISION.temporal_patch_size * TINY_VISION.patch_size**2
    pixels = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    return ImageInput(pixels, grid, TINY_VISION.spatial_merge_size, start)


def image_doc(grids: list[tuple[int, int, int]], text_between: int, task: int, seed: int) -> Document:
    """bos task [<img> pad.. </img> text..]*: placeholder runs with text between."""
    g = torch.Generator().manual_seed(seed)
    tokens, images = [1, 4830 + task], []
    for i, grid in enumerate(grids):
        tokens.append(3)
        img = fake_image(grid, len(tokens), seed * 10 + i)
        images.append(img)
        tokens += [IMAGE_ID] * img.n_tokens + [4]
        tokens += torch.randint(8, 4000, (text_between,), generator=g).tolist()
    return Document(tokens, task, images)


def test_mrope_positions_equal_transformers_get_rope_index():
    model, _ = build_model("tiny", device="meta", vision=True, vision_ids=TOK.vision_ids)
    doc = image_doc([(1, 4, 6), (1, 8, 2), (1, 2, 2)], text_between=5, task=0, seed=1)
    ids = torch.tensor([doc.tokens])
    theirs, _ = model.model.get_rope_index(
        ids, (ids == IMAGE_ID).int(), image_grid_thw=torch.tensor([i.grid_thw for i in doc.images])
    )
    ours = mrope_positions(len(doc.tokens), doc.images)
    assert torch.equal(ours, theirs[:, 0])
    assert not torch.equal(ours[0], torch.arange(len(doc.tokens)))  # the image really bends the positions


def test_packer_carries_images_in_row_order_and_resets_positions():
    docs = [
        image_doc([(1, 4, 4)], 30, 0, seed=1),
        Document(list(range(8, 60)), 4),
        image_doc([(1, 4, 6), (1, 2, 2)], 20, 3, seed=2),
        image_doc([(1, 4, 4)], 90, 0, seed=3),
    ]
    rows = list(Packer(row_len=ROW_LEN, open_rows=2).pack(docs))
    batch = collate(rows)
    flat_ids = batch["input_ids"].reshape(-1)
    # the k-th run of placeholders in row-major order belongs to the k-th image of the batch
    starts = [r_i * ROW_LEN + img.start for r_i, row in enumerate(rows) for img in row.images]
    assert starts == sorted(starts) and len(starts) == 4
    sizes = (batch["image_grid_thw"].prod(-1) // 4).tolist()
    assert int((flat_ids == IMAGE_ID).sum()) == sum(sizes)
    offset = 0
    for start, size, grid in zip(starts, sizes, batch["image_grid_thw"].tolist(), strict=True):
        assert (flat_ids[start : start + size] == IMAGE_ID).all()
        src = next(i for d in docs for i in d.images if list(i.grid_thw) == grid and i.n_tokens == size
                   and torch.equal(i.pixel_values, batch["pixel_values"][offset : offset + size * 4]))
        assert src is not None
        offset += size * 4
    assert offset == batch["pixel_values"].shape[0]
    # placeholders are never scored; every document restarts its text and 3-D positions at 0
    assert (batch["labels"].reshape(-1)[flat_ids == IMAGE_ID] == IGNORE_INDEX).all()
    for r_i, row in enumerate(rows):
        for a in row.cu_seqlens[:-1].tolist():
            assert row.position_ids[a] == 0 and (batch["mrope_position_ids"][:, r_i, a] == 0).all()
    kwargs = model_kwargs(batch)
    assert kwargs["position_ids"].shape == (4, len(rows), ROW_LEN)
    assert torch.equal(kwargs["position_ids"][0], batch["position_ids"])


def test_long_image_document_is_never_cut_inside_an_image():
    doc = image_doc([(1, 4, 4), (1, 8, 8), (1, 4, 4)], 40, 0, seed=4)  # 4 + 16 + 4 placeholders
    assert len(doc.tokens) > 2 * 64
    pieces = Packer(row_len=64, open_rows=1)._pieces(doc)
    assert sum(len(p.tokens) for p in pieces) == len(doc.tokens)
    assert sum(len(p.images) for p in pieces) == 3
    for p in pieces:
        assert len(p.tokens) <= 64
        for img in p.images:
            assert (torch.tensor(p.tokens[img.start : img.end]) == IMAGE_ID).all()
            assert img.end <= len(p.tokens) and (img.start == 0 or p.tokens[img.start - 1] != IMAGE_ID)
    with pytest.raises(ValueError, match="does not fit"):
        list(Packer(row_len=8).pack([image_doc([(1, 8, 8)], 1, 0, seed=5)]))


# ------------------------------------------------------------------------------------------------
# THE ORACLE with the vision tower on


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    stock, _ = build_model("tiny", vision=True, vision_ids=TOK.vision_ids)
    stock.eval()
    packed = copy.deepcopy(stock)
    assert install_kernels(packed, select_kernels("cpu")) == 3
    return stock, packed


@pytest.fixture(scope="module")
def image_batch(tmp_path_factory):
    """Real documents of the synthetic set (PNG -> pixel_values), plus one long document split over rows."""
    data = tmp_path_factory.mktemp("vision") / "data"
    generate_synthetic(data, samples=40, seed=0)
    man = load_manifests(data)
    docs = [tokenize_record(TOK, data, task, man.records[task][i][1])
            for task, i in [("gen_img", 0), ("replay_img", 0), ("gen_txt", 0), ("replay_img", 1), ("gen_img", 1)]]
    long_doc = image_doc([(1, 4, 4), (1, 4, 6)], 70, TASKS.index("replay_img"), seed=6)  # > ROW_LEN: split
    docs.insert(2, long_doc)
    assert all(d.images for d in docs if TASKS[d.task] in ("gen_img", "replay_img"))
    rows = list(Packer(row_len=ROW_LEN).pack(docs))
    assert len(rows) >= 2 and sum(len(r.images) for r in rows) == 6
    return rows, collate(rows)


def segments_of(rows) -> list[tuple[int, int, int]]:
    out = []
    for r_i, row in enumerate(rows):
        cu = row.cu_seqlens.tolist()
        out += [(r_i, a, b) for a, b in zip(cu[:-1], cu[1:], strict=True) if a < row.n_real_tokens]
    return out


def run_alone(stock, row, a: int, b: int, grad: bool = False) -> torch.Tensor:
    """Logits of one document through transformers' stock forward (it computes the 3-D positions)."""
    ids = row.input_ids[a:b][None]
    images = [img for img in row.images if a <= img.start < b]
    kwargs = {}
    if images:
        kwargs = dict(pixel_values=torch.cat([i.pixel_values for i in images]),
                      image_grid_thw=torch.tensor([i.grid_thw for i in images]),
                      mm_token_type_ids=(ids == IMAGE_ID).int())
    with torch.set_grad_enabled(grad):
        return stock(input_ids=ids, **kwargs).logits


def test_packed_image_logits_and_loss_equal_documents_run_alone(models, image_batch):
    stock, packed = models
    rows, batch = image_batch
    kwargs = model_kwargs(batch)
    labels = kwargs.pop("labels")
    with torch.no_grad():
        hidden = base_forward(packed, **kwargs)
        logits = packed.lm_head(hidden)
        per_token = token_losses(hidden, packed.lm_head.weight, labels, "logits")
    segments = segments_of(rows)
    n_image_docs = 0
    ce_sum, n_targets = torch.zeros(()), 0
    for r_i, a, b in segments:
        alone = run_alone(stock, rows[r_i], a, b)
        torch.testing.assert_close(logits[r_i : r_i + 1, a:b], alone, atol=1e-5, rtol=1e-4)
        n_image_docs += any(a <= img.start < b for img in rows[r_i].images)
        target = labels[r_i, a + 1 : b]
        keep = target != IGNORE_INDEX
        ce_sum += F.cross_entropy(alone[0, :-1][keep], target[keep], reduction="sum")
        n_targets += int(keep.sum())
    assert n_image_docs >= 5
    assert int((labels != IGNORE_INDEX).sum()) == n_targets
    torch.testing.assert_close(per_token.sum() / n_targets, ce_sum / n_targets, atol=1e-5, rtol=1e-5)


def test_packed_image_gradients_reach_the_vision_tower_and_match(models, image_batch):
    stock, packed = models
    rows, batch = image_batch
    kwargs = model_kwargs(batch)
    labels = kwargs.pop("labels")
    packed.zero_grad()
    hidden = base_forward(packed, **kwargs)
    per_token = token_losses(hidden, packed.lm_head.weight, labels, "logits")
    n_targets = int((labels != IGNORE_INDEX).sum())
    (per_token.sum() / n_targets).backward()
    stock.zero_grad()
    for r_i, a, b in segments_of(rows):
        logits = run_alone(stock, rows[r_i], a, b, grad=True)
        target = labels[r_i, a + 1 : b]
        (F.cross_entropy(logits[0, :-1], target, ignore_index=IGNORE_INDEX, reduction="sum") / n_targets).backward()
    for name in ("model.visual.patch_embed.proj.weight", "model.visual.blocks.0.attn.qkv.weight",
                 "model.visual.merger.linear_fc2.weight", "model.language_model.layers.0.linear_attn.A_log",
                 "model.language_model.layers.3.self_attn.q_proj.weight"):
        g_packed = dict(packed.named_parameters())[name].grad
        g_stock = dict(stock.named_parameters())[name].grad
        assert g_packed is not None and g_packed.abs().sum() > 0, name
        torch.testing.assert_close(g_packed, g_stock, atol=1e-6, rtol=1e-4, msg=name)
    packed.zero_grad()
    stock.zero_grad()


def test_vision_tower_checkpointing_keeps_the_gradients(models, image_batch):
    """--vision-ckpt recomputes the tower's blocks in the backward: the same tower gradients as
    without it (its activations are not kept, which is the memory it saves)."""
    from train.stage1.train import checkpoint_vision_tower

    _, packed = models
    rows, batch = image_batch
    kwargs = model_kwargs(batch)
    labels = kwargs.pop("labels")

    def tower_grads(model) -> dict[str, torch.Tensor]:
        model.train()
        model.zero_grad()
        per_token = token_losses(base_forward(model, **kwargs), model.lm_head.weight, labels, "logits")
        per_token.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if n.startswith("model.visual.")}
        model.zero_grad()
        model.eval()
        return grads

    plain = tower_grads(packed)
    checkpointed = copy.deepcopy(packed)
    assert checkpoint_vision_tower(checkpointed) == ["vision tower: activation checkpointing of its 2 blocks"]
    assert all(b.gradient_checkpointing for b in checkpointed.model.visual.blocks)
    assert not checkpointed.model.language_model.gradient_checkpointing
    again = tower_grads(checkpointed)
    assert plain.keys() == again.keys() and len(plain) > 10
    for name, g in plain.items():
        torch.testing.assert_close(again[name], g, atol=1e-6, rtol=1e-5, msg=name)


def test_oracle_can_fail_without_the_text_position_row(models, image_batch):
    """With only the 3-D positions, transformers has no text positions to find the documents in,
    builds one causal mask over the whole row, and later documents see earlier ones."""
    stock, packed = models
    rows, batch = image_batch
    kwargs = model_kwargs(batch)
    kwargs.pop("labels")
    with torch.no_grad():
        right = base_forward(packed, **kwargs)
        kwargs["position_ids"] = kwargs["position_ids"][1:]
        leaky = base_forward(packed, **kwargs)
    r_i, a, b = next(s for s in segments_of(rows) if s[1] > 0)
    assert (leaky[r_i, a:b] - right[r_i, a:b]).abs().max() > 1e-3


def test_trainer_vision_defaults():
    from launch.jobspec import find_spec
    from train.stage1.train import parse_args, vision_on

    def vision(argv):
        return vision_on(parse_args(argv))

    assert vision(["--shape", "tiny"]) is True
    assert vision(["--shape", "tiny", "--vision", "off"]) is False
    # every job preset (launch/jobs/stage1.yaml) trains the VLM: vision off is an explicit choice
    spec = find_spec("stage1")
    for preset in ("qwen35-2b", "qwen35-0.8b", "tiny"):
        assert vision(spec.resolve(preset).argv()) is True, preset
    assert vision(spec.resolve("qwen35-2b").argv(["--vision", "off"])) is False


def test_loader_batches_carry_images_and_report_broken_pngs(tmp_path: Path):
    data = tmp_path / "data"
    generate_synthetic(data, samples=40, seed=0)
    broken = data / load_manifests(data).records["replay_img"][0][1]["image"]
    broken.write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    ds = PackedBatches(DataConfig(str(data), row_len=ROW_LEN, batch_rows=2,
                                  weights={"gen_img": 1, "replay_img": 1}), TOK, rank=0)
    batches = [build_batch(ds.sampler, ds.tok, ds.cfg, k) for k in range(4)]
    for batch in batches:
        n_placeholders = int((batch["input_ids"] == IMAGE_ID).sum())
        assert n_placeholders == int(batch["image_grid_thw"].prod(-1).sum()) // 4 > 0
        assert batch["pixel_values"].shape[0] == int(batch["image_grid_thw"].prod(-1).sum())
    bad = {line for b in batches for line in b["bad_records"]}
    assert bad == {f"{data / 'replay_img.jsonl'}:1: unreadable image {broken} (OSError)"}


def test_batch_without_images_still_gives_every_vision_parameter_a_gradient(models):
    """DDP/ZeRO reduce the same gradients on every rank, whether or not its batch held images."""
    _, packed = models
    rows = list(Packer(row_len=64).pack([Document(list(range(8, 40)), 4)]))
    kwargs = model_kwargs(collate(rows))
    labels = kwargs.pop("labels")
    packed.zero_grad()
    hidden = base_forward(packed, **kwargs)
    token_losses(hidden, packed.lm_head.weight, labels, "logits").sum().backward()
    grads = [p.grad for p in packed.model.visual.parameters()]
    assert all(g is not None and not g.any() for g in grads)
    packed.zero_grad()


def test_vision_tower_varlen_equals_transformers_per_image_attention():
    """The tower with every image of a step in one varlen attention call per block
    (varlen_attention.use_vision_varlen: transformers' cu_seqlens branch) against transformers'
    own per-image sdpa: outputs and gradients of the same weights on three images of different
    grids. On the CPU the varlen call is sdpa per image, non-causal; the oracle is transformers' code."""
    from train.common import varlen_attention

    tok = build_tokenizer(get_shape("tiny"), None, vision=True)
    model, _ = build_model("tiny", vision=True, vision_ids=tok.vision_ids)
    ref = copy.deepcopy(model)
    assert varlen_attention.use_vision_varlen(model) and not varlen_attention.use_vision_varlen(
        build_model("tiny", vision=False)[0])
    assert model.config.vision_config._attn_implementation == varlen_attention.VISION_VARLEN_IMPL
    assert ref.config.vision_config._attn_implementation != varlen_attention.VISION_VARLEN_IMPL
    grid = torch.tensor([[1, 4, 4], [1, 6, 4], [1, 8, 8]])
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 8 * 8, generator=g)
    outs, grads = [], []
    for m in (model, ref):
        out = m.model.visual(pixels, grid_thw=grid).pooler_output
        out.square().sum().backward()
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in m.model.visual.named_parameters() if p.grad is not None})
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 10
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-5, msg=name)
    # the oracle can fail: the text layers' causal varlen call in the tower differs from transformers'
    from transformers import AttentionInterface

    AttentionInterface.register(varlen_attention.VISION_VARLEN_IMPL,
                                lambda *a, **kw: varlen_attention.varlen_attention_forward(*a, **{**kw, "is_causal": True}))
    try:
        with torch.no_grad():
            causal = model.model.visual(pixels, grid_thw=grid).pooler_output
    finally:
        varlen_attention.register()
    assert not torch.allclose(causal, outs[1], atol=1e-3)
