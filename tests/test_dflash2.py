"""DFlash2 beside DFlash: the same trainer and shards, the published layout as a preset, its export
as vLLM reads a DFlash2DraftModel (tests/dflash_serving.py follows vLLM's qwen3_dflash2.py and its
DFlash2 speculator), drafting there what the trainer's drafter drafts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from dflash_serving import ServingDrafter, hf_config
from engine_code import EngineCodeUnavailable, SGLangCode, sglang_sources

from train.dflash import train as dflash_train
from train.dflash.args import DFLASH2_BLOCK, parse_args
from train.dflash.data import ShardDataset
from train.dflash.export import export_checkpoint, load_export
from train.dflash.model import (
    FULL,
    SLIDING,
    Drafter,
    DrafterConfig,
    TargetHead,
    TargetShape,
    drafter_config,
)
from train.extract import extract as ex
from train.extract.data import generate_synthetic

SHAPE = TargetShape(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=128, vocab_size=300, rope_theta=1e7)
QWEN36_27B = TargetShape(hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                         head_dim=256, intermediate_size=17408, vocab_size=248320, rope_theta=1e7,
                         max_position_embeddings=262144)
STEPS = 16
TRAIN = ["--token-budget", "320", "--lr", "5e-3", "--warmup", "2", "--steps", str(STEPS), "--ckpt-every", "100",
         "--anchors", "64"]


@pytest.fixture(scope="module")
def sglang() -> SGLangCode:
    """SGLang's parsing code from its release on PyPI (as tests/test_dflash_engines.py takes it)."""
    try:
        return SGLangCode(sglang_sources())
    except EngineCodeUnavailable as exc:
        pytest.skip(f"SGLang's released code could not be fetched, so its parsing cannot run: {exc}")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("extract")
    data = generate_synthetic(root / "data.jsonl", 24, seed=3, vocab=4096, min_len=12, max_len=40, median=24)
    out = root / "shards"
    assert ex.main(["--out", str(out), "--data", str(data), "--layers", "1,2", "--token-budget", "160",
                    "--max-len", "40"], guard=False) == 0
    return out


def test_dflash2_preset_is_the_published_layout_and_defaults_to_block_8():
    """`--drafter qwen3.6-27b-dflash2` (and `dflash2` on a Qwen3.6-27B-shaped target) is SpecForge's
    configs/qwen3.6-27b-dflash2.json: 5 sliding layers (2,048), 32 x 128 heads / 8 KV, MLP 17,408,
    2-tap convolutions in groups of 16, a rank-256 top-16 selector; the block defaults to 8."""
    for spec in ("qwen3.6-27b-dflash2", "dflash2"):
        cfg = drafter_config(spec, QWEN36_27B, [5, 19, 33, 47, 61], DFLASH2_BLOCK)
        assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (
            5, 32, 8, 128, 17408)
        assert cfg.layer_types == [SLIDING] * 5 and cfg.sliding_window == 2048
        assert (cfg.conv_kernel_size, cfg.conv_group_size, cfg.selector_rank, cfg.selector_top_k) == (2, 16, 256, 16)
    assert parse_args(["--data", "x", "--drafter", "dflash2"]).block_size == 8
    assert parse_args(["--data", "x"]).block_size == 16
    assert parse_args(["--data", "x", "--drafter", "dflash2", "--block-size", "12"]).block_size == 12
    with pytest.raises(ValueError, match="both its convolution"):
        DrafterConfig(hidden_size=64, target_layer_ids=[1], num_target_layers=4, vocab_size=300, conv_kernel_size=2)
    with pytest.raises(ValueError, match="exceeds block_size"):
        DrafterConfig(hidden_size=64, target_layer_ids=[1], num_target_layers=4, vocab_size=300, block_size=4,
                      conv_kernel_size=5, selector_rank=8)


def test_fresh_dflash2_computes_what_dflash_does():
    """Identity base kernels, zero dynamic kernels and a zero successor codebook: a fresh DFlash2
    drafter with DFlash's weights gives DFlash's states, and its selector walk DFlash's argmax."""
    torch.manual_seed(0)
    plain = Drafter(drafter_config("tiny", SHAPE, [1, 2], 8)).eval()
    two = Drafter(drafter_config("dflash2", SHAPE, [1, 2], 8)).eval()
    missing, unexpected = two.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and missing and all("conv" in k or "candidate_selector" in k for k in missing)
    head = TargetHead(torch.randn(300, 64), torch.randn(300, 64))
    hidden = torch.randn(2, 30, 128)
    blocks = torch.randint(0, 299, (2, 3, 8))
    anchors, lengths = torch.tensor([[2, 9, 20], [5, 11, -1]]), torch.tensor([30, 17])
    with torch.no_grad():
        a = plain(hidden, head.embed_tokens(blocks), anchors, lengths)
        b = two(hidden, head.embed_tokens(blocks), anchors, lengths)
    torch.testing.assert_close(b, a, atol=0, rtol=0)
    assert torch.equal(two.draft(head, b, blocks), plain.draft(head, a, blocks))


def _losses(out: Path) -> list[float]:
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in recs if r.get("event") == "step"]


@pytest.mark.slow
def test_dflash2_and_dflash_trained_from_the_same_shards_both_learn_and_draft_as_served(shards, tmp_path, sglang):
    """DFlash (tiny, block 16) and DFlash2 (`--drafter dflash2`: tiny + convolutions + selector,
    block 8 by default) trained on the same shards: both losses fall. Each export, read by the
    engine-style loader as vLLM and as SGLang do (DFlash2's parts as vLLM's DFlash2 code runs them),
    drafts what the trainer's drafter drafts at the exported weights, token for token, after 12
    anchors of the shards' samples."""
    data = ShardDataset(shards)
    embed, lm_head = data.head_weights()
    head = TargetHead(embed, lm_head)
    for drafter, engine in (("tiny", "vllm"), ("tiny", "sglang"), ("dflash2", "vllm"), ("dflash2", "sglang")):
        run = tmp_path / drafter
        if not run.exists():
            assert dflash_train.main(["--data", str(shards), "--out", str(run), "--drafter", drafter, *TRAIN],
                                     guard=False) == 0
            losses = _losses(run)
            assert len(losses) == STEPS and np.mean(losses[-4:]) < np.mean(losses[:4]) - 1.0, (drafter, losses)
        out = export_checkpoint(run, None, None)
        trainer = load_export(out).eval()
        assert trainer.cfg.dflash2 == (drafter == "dflash2")
        assert trainer.cfg.block_size == (8 if drafter == "dflash2" else 16)
        hf = hf_config(out)
        assert hf.architectures == (["DFlash2DraftModel"] if drafter == "dflash2" else ["DFlashDraftModel"])
        serving = ServingDrafter(out, embed, lm_head, engine=engine, sglang=sglang)
        assert serving.dflash2 == (drafter == "dflash2")
        k, drafts = trainer.cfg.block_size, 0
        for sample in range(12):
            batch = data.batch([sample])
            n = int(batch["lengths"][0])
            a = 1 + (sample * 7) % (n - 2)  # an anchor with context before it
            ids = batch["input_ids"][0]
            block = torch.tensor([int(ids[a])] + [trainer.cfg.mask_token_id] * (k - 1))
            with torch.no_grad():
                states = trainer(batch["hidden"][:, : a + 1].float(), head.embed_tokens(block)[None, None],
                                 torch.tensor([[a]]), torch.tensor([a + 1]))[0, 0]
            mine = trainer.draft(head, states, block).tolist()
            theirs = serving.draft(batch["hidden"][0, :a].float(), int(ids[a]))
            assert mine == theirs, (drafter, engine, sample, mine, theirs)
            drafts += 1
        assert drafts == 12


def test_dflash2_export_keys_are_the_ones_vllm_loads(tmp_path):
    """config.json: DFlash2DraftModel with dflash_config's four DFlash2 fields (vLLM reads them with
    [...], so each must be there); weights: DFlash's plus layers.*.{attention,mlp}_conv.{base_kernel,
    kernel_projection.weight} and candidate_selector.* in vLLM's shapes."""
    from safetensors import safe_open

    from train.dflash.export import write_export

    cfg = drafter_config("dflash2", SHAPE, [1, 2], 8)
    cfg.layer_types, cfg.sliding_window = [SLIDING, FULL], 6
    drafter = Drafter(DrafterConfig(**cfg.__dict__))
    out = write_export(drafter, tmp_path / "e")
    hf = hf_config(out)
    assert hf.dflash_config["conv_kernel_size"] == 2 and hf.dflash_config["conv_group_size"] == 16
    assert hf.dflash_config["selector_rank"] == 256 and hf.dflash_config["selector_top_k"] == 16
    assert hf.dflash_config["block_size"] == 8
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    for i in range(2):
        for conv in ("attention_conv", "mlp_conv"):
            assert shapes[f"layers.{i}.{conv}.base_kernel"] == (2, 2, 64)
            assert shapes[f"layers.{i}.{conv}.kernel_projection.weight"] == (2 * 2 * 4, 64)
    assert shapes["candidate_selector.predecessor_codebook"] == (300, 256)
    assert shapes["candidate_selector.successor_codebook"] == (300, 256)
    assert shapes["candidate_selector.hidden_projection.weight"] == (256, 64)
    assert load_export(out).cfg == drafter.cfg


def test_dflash2_dense_and_flex_agree_with_live_convolutions():
    """The convolutions see each block's K slots in order in both attention paths (the flex path
    packs valid blocks only): equal in fp32 with nonzero dynamic kernels and a 2-tap base."""
    torch.manual_seed(0)
    cfg = drafter_config("dflash2", SHAPE, [1, 2], 8)
    cfg.conv_kernel_size = 3
    drafter = Drafter(DrafterConfig(**cfg.__dict__)).eval()
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name:
                p.add_(torch.randn_like(p) * 0.1)
    hidden = torch.randn(2, 30, 128)
    x = torch.randn(2, 3, 8, 64)
    anchors, lengths = torch.tensor([[2, 9, 20], [5, 11, -1]]), torch.tensor([30, 17])
    with torch.no_grad():
        dense = drafter(hidden, x, anchors, lengths, attn_impl="dense")
        flex = drafter(hidden, x, anchors, lengths, attn_impl="flex")
    valid = anchors >= 0
    torch.testing.assert_close(flex[valid], dense[valid], atol=2e-5, rtol=1e-4)
