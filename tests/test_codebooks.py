"""3D codebook vocab layout, code<->token round trips, embedding extension and model presets."""

from __future__ import annotations

import pytest
import torch

from train.common.codebooks import CODEBOOK_NAMES, CodebookConfig, CodebookVocab, extend_embeddings
from train.common.shapes import SHAPES, get_shape
from train.stage1.model import build_model, text_config


def test_full_size_layout():
    vocab = CodebookVocab(248_320)
    assert vocab.offsets == {"ss": 248_320, "shape": 248_320 + 8192, "tex": 248_320 + 2 * 8192}
    assert vocab.used_vocab == 248_320 + 3 * 8192 + len(vocab.config.specials) == 272_912
    assert vocab.padded_vocab == 273_152  # the "~272.9k": 272,896 + 16 specials, padded to 256
    assert vocab.config.lengths == (1728, 2048, 2048)  # 5,824 codes per asset
    assert vocab.padded_vocab % 256 == 0
    assert 0 <= vocab.padded_vocab - vocab.used_vocab < 256
    assert sorted(vocab.special_ids.values()) == list(range(vocab.special_offset, vocab.used_vocab))


@pytest.mark.parametrize("name", CODEBOOK_NAMES)
def test_round_trip_every_code(name):
    vocab = CodebookVocab(248_320)
    codes = torch.arange(vocab.sizes[name])
    tokens = vocab.codes_to_tokens(name, codes)
    assert tokens.min() >= 248_320 and tokens.max() < vocab.special_offset
    assert torch.equal(vocab.tokens_to_codes(name, tokens), codes)
    assert {vocab.codebook_of(int(t)) for t in tokens} == {name}


def test_encode_decode_3d_asset():
    vocab = CodebookVocab(4096, CodebookConfig(ss=216, shape=256, tex=256))
    g = torch.Generator().manual_seed(0)
    ss, shape, tex = (torch.randint(0, n, (40,), generator=g).tolist() for n in (216, 256, 256))
    tokens = vocab.encode_3d(ss, shape, tex)
    assert tokens[0] == vocab.special_ids["<|3d_start|>"] and tokens[-1] == vocab.special_ids["<|3d_end|>"]
    assert vocab.decode_3d(tokens) == {"ss": ss, "shape": shape, "tex": tex}


def test_out_of_range_codes_and_foreign_tokens_are_refused():
    vocab = CodebookVocab(248_320)
    with pytest.raises(ValueError, match=r"ss codes must lie in \[0, 8192\)"):
        vocab.codes_to_tokens("ss", [0, 8192])
    with pytest.raises(ValueError, match="not tex codebook tokens"):
        vocab.tokens_to_codes("tex", vocab.codes_to_tokens("shape", [5]))
    with pytest.raises(ValueError, match="unknown codebook"):
        vocab.codes_to_tokens("color", [1])


def test_new_embedding_rows_are_the_mean_of_the_old_ones():
    from transformers import Qwen3_5ForCausalLM

    cfg = text_config(get_shape("tiny"))
    model = Qwen3_5ForCausalLM(cfg)
    old = model.get_input_embeddings().weight.detach().clone()
    extend_embeddings(model, 4864)
    new = model.get_input_embeddings().weight.detach()
    assert new.shape == (4864, cfg.hidden_size)
    assert torch.equal(new[:4096], old)
    assert torch.allclose(new[4096:], old.mean(0).expand(4864 - 4096, -1))
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight  # still tied


def test_tiny_preset_shape_and_parameter_count():
    model, spec = build_model("tiny")
    assert 4e6 < spec.n_params < 6e6
    assert (spec.n_gdn_layers, spec.n_full_attention_layers) == (3, 1)
    assert model.config.vocab_size == spec.vocab.padded_vocab == model.lm_head.weight.shape[0]
    assert model.config.vocab_size % 256 == 0


def test_2b_shape_on_meta_device():
    model, spec = build_model("qwen35-2b", device="meta")
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.intermediate_size) == (2048, 24, 6144)
    assert (spec.n_gdn_layers, spec.n_full_attention_layers) == (18, 6)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (8, 2, 256)
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim) == (16, 16, 128)
    assert cfg.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert 1.8e9 < spec.n_params < 2.0e9


def test_unknown_shape_lists_the_valid_ones():
    with pytest.raises(ValueError) as err:
        build_model("qwen35-70b")
    for name in SHAPES:
        assert name in str(err.value)


def test_init_from_a_local_checkpoint(tmp_path):
    model, _ = build_model("tiny")
    model.save_pretrained(tmp_path / "ckpt")
    loaded, spec = build_model("tiny", init_from=tmp_path / "ckpt")
    assert spec.init_from == str(tmp_path / "ckpt")
    for (name, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="nowhere: not a directory"):
        build_model("tiny", init_from=tmp_path / "nowhere")
