"""MFU math against a hand count for the tiny preset, and against the built model's Linear layers."""

from __future__ import annotations

import pytest
import torch

from train.common.mfu import flops_per_token, gated_delta_rule_flops, matmul_params, mfu, mfu_pair, peak_flops
from train.stage1.model import build_model


def hand_count_tiny() -> int:
    # tiny: hidden 256, 3 GDN + 1 full layer, FFN 768, vocab 5120 (4096 text + 3 x 256 codes + 16 specials, padded)
    gdn = (
        256 * (2 * 4 * 64 + 4 * 64)  # in_proj_qkv: q, k (4 heads x 64) and v (4 heads x 64)
        + 256 * 256  # in_proj_z
        + 256 * 4 * 2  # in_proj_b, in_proj_a: one scalar per value head
        + 256 * 256  # out_proj
    )
    full = 256 * 4 * 64 * 2 + 256 * 2 * 64 * 2 + 4 * 64 * 256  # q (with gate), k, v, o
    mlp = 3 * 256 * 768
    lm_head = 256 * 5120
    return 3 * (gdn + mlp) + (full + mlp) + lm_head


def test_matmul_params_tiny_hand_count():
    model, _ = build_model("tiny", device="meta")
    assert hand_count_tiny() == 4_921_344
    assert matmul_params(model.config) == 4_921_344
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert linear == 4_921_344  # every nn.Linear, lm_head included (tied, still a matmul)


def test_flops_per_token_tiny():
    model, _ = build_model("tiny", device="meta")
    attention = 12 * 1 * 4 * 64 * 8192  # one full-attention layer, 4 heads of 64, 8192-token row
    gdr = 18 * 3 * 4 * 64 * 64  # torchtitan's recurrence charge: 3 GDN layers, 4 value heads, d_k = d_v = 64
    assert gated_delta_rule_flops(model.config) == gdr == 884_736
    assert flops_per_token(model.config, 8192) == 6 * 4_921_344 + attention + gdr == 55_578_624


def test_useful_mfu_leaves_the_padding_out():
    all_tok, useful = mfu_pair(20_000, 15_000, 1e9, n_gpus=2, peak=1e13)
    assert all_tok == pytest.approx(1.0) and useful == pytest.approx(0.75)


def test_mfu_and_peak():
    assert mfu(10_000, 1e9, n_gpus=1, peak=1e13) == pytest.approx(1.0)
    assert mfu(8 * 23_417, 12e9, n_gpus=8) == pytest.approx(23_417 * 12e9 / 989e12)
    assert peak_flops("NVIDIA H200") == 989e12 and peak_flops("Quadro") is None
    with pytest.raises(ValueError):
        mfu(1.0, 1.0, n_gpus=0)


def test_2b_flops_count_the_extended_vocab():
    """The 2B lm_head is hidden x 273,152 (248,320 + 3 x 8,192 codebook rows + 16 specials, padded)."""
    model, spec = build_model("qwen35-2b", device="meta")
    assert model.config.vocab_size == spec.vocab.padded_vocab == 273_152
    base = {**model.config.to_dict(), "vocab_size": 248_320}
    assert matmul_params(model.config) - matmul_params(base) == 2048 * (273_152 - 248_320)
    assert flops_per_token(model.config, 8192) - flops_per_token(base, 8192) == 6 * 2048 * (273_152 - 248_320)


def test_2b_shape_in_the_expected_range():
    model, spec = build_model("qwen35-2b", device="meta")
    n = matmul_params(model.config)
    # tied embeddings: N_matmul ~ all parameters (the lm_head counted once, the lookup not)
    assert abs(n - spec.n_params) / spec.n_params < 0.01
    per_token = flops_per_token(model.config, 8192)
    assert 12e9 < per_token < 13e9
    # the GDN recurrence term is about +0.7% for this shape (18 layers, 16 heads of 128 x 128)
    assert gated_delta_rule_flops(model.config) == 18 * 18 * 16 * 128 * 128
    assert 0.006 < gated_delta_rule_flops(model.config) / per_token < 0.008


def test_vision_flops_tiny_tower_hand_count_and_flop_counter():
    """The tower's FLOPs for a step's images: a hand count for the tiny tower, and torch's own
    FlopCounterMode over a real forward of that tower (x3 for fwd + bwd)."""
    from torch.utils.flop_counter import FlopCounterMode
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel

    from train.common.mfu import vision_flops, vision_matmul_params
    from train.common.shapes import get_shape
    from train.stage1.model import vision_config

    cfg = vision_config(get_shape("tiny"))  # depth 2, hidden 64, inter 128, patch 8, merge 2, out 256
    patch = 3 * 2 * 8 * 8 * 64  # conv 3 x T2 x 8 x 8 -> 64
    blocks = 2 * (64 * 192 + 64 * 64 + 64 * 128 + 128 * 64)  # qkv, proj, fc1, fc2
    merger = (256 * 256 + 256 * 256) // 4  # fc1 256 -> 256 and fc2 256 -> 256, once per 4 patches
    assert vision_matmul_params(cfg) == patch + blocks + merger == 122_880
    grids = [(1, 4, 4), (1, 8, 6)]  # 16 and 48 patches; each attends within itself
    hand = sum(t * h * w * (6 * 122_880 + 12 * 2 * 64 * h * w) for t, h, w in grids)
    assert vision_flops(cfg, torch.tensor(grids)) == hand == 51_118_080
    assert vision_flops(cfg, None) == 0.0

    cfg._attn_implementation = "eager"  # plain matmuls: the counter sees the attention too
    tower = Qwen3_5VisionModel(cfg).eval()
    n = sum(t * h * w for t, h, w in grids)
    pixels = torch.randn(n, 3 * 2 * 8 * 8)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        tower(pixels, grid_thw=torch.tensor(grids))
    assert 3 * counter.get_total_flops() == pytest.approx(hand, rel=1e-6)
