"""MFU math against a hand count for the tiny preset, and against the built model's Linear layers."""

from __future__ import annotations

import pytest
import torch

from train.common.mfu import flops_per_token, matmul_params, mfu, peak_flops
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
    assert flops_per_token(model.config, 8192) == 6 * 4_921_344 + attention == 54_693_888


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
