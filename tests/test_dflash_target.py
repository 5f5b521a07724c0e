"""DFlash for a real target: the checkpoint as it is (its vocab, no codebook rows added), a
drafter whose vocab and mask token are the target's, an export a serving engine's loader reads
(tests/dflash_serving.py) and drafts a block with, and the block-sparse attention against the dense
reference. Tiny real checkpoints (save_pretrained + a trained BPE), CPU."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import torch
from dflash_fixtures import make_tokenizer, write_conversations
from dflash_serving import ServingDrafter

from train.common.config import ConfigError
from train.dflash import train as dflash_train
from train.dflash.export import export_checkpoint, load_export
from train.dflash.model import Drafter, TargetShape, block_inputs, drafter_config, sample_anchors
from train.extract import extract as ex

K = 8


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    """A tiny random Qwen3.5 saved with save_pretrained, a ChatML BPE tokenizer beside it."""
    from transformers import Qwen3_5ForCausalLM

    from train.common.shapes import get_shape
    from train.stage1.model import text_config

    root = tmp_path_factory.mktemp("target")
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(text_config(get_shape("tiny"))).save_pretrained(str(root))
    make_tokenizer(root)
    return root


@pytest.fixture(scope="module")
def exported(target, tmp_path_factory) -> tuple[Path, Path]:
    """extract (--init-from the checkpoint) -> offline DFlash (2 steps) -> export."""
    root = tmp_path_factory.mktemp("run")
    chat = write_conversations(root / "chat.jsonl", 6, n_words=6)
    shards = root / "shards"
    assert ex.main(["--out", str(shards), "--data", str(chat), "--init-from", str(target), "--layers", "1,2",
                    "--token-budget", "512", "--max-len", "128"], guard=False) == 0
    run = root / "dflash"
    assert dflash_train.main(["--data", str(shards), "--out", str(run), "--steps", "2", "--block-size", str(K),
                              "--token-budget", "256", "--anchors", "16", "--warmup", "1"], guard=False) == 0
    return shards, export_checkpoint(run, None, None)


def test_export_has_the_targets_vocab_and_a_mask_token_of_its_tokenizer(target, exported):
    from transformers import AutoConfig, AutoTokenizer

    shards, out = exported
    vocab = AutoConfig.from_pretrained(str(target), local_files_only=True).vocab_size
    meta = json.loads((shards / "meta.json").read_text())
    digest = hashlib.sha256((target / "config.json").read_bytes()).hexdigest()
    assert meta["vocab_size"] == vocab == 4096  # no codebook rows appended to a plain checkpoint
    assert meta["target"] == str(target) and meta["target_config_sha256"] == digest
    cfg = json.loads((out / "config.json").read_text())
    tok = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    mask = cfg["dflash_config"]["mask_token_id"]
    assert cfg["vocab_size"] == vocab and 0 <= mask < vocab and mask < len(tok)
    assert tok.convert_ids_to_tokens(mask) == tok.pad_token  # auto: the tokenizer's pad token
    assert cfg["dflash_config"]["block_size"] == K and cfg["dflash_config"]["target_layer_ids"] == [1, 2]
    readme = (out / "README.md").read_text()
    assert str(target) in readme and digest in readme


def test_serving_loader_drafts_a_block_equal_to_the_trainers_drafter(target, exported):
    """The engine-side loader reads only what SGLang/vLLM read, embeds with the target's embedding,
    and its block equals the trained drafter's for the same prompt (the oracle: load_export)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, out = exported
    model = AutoModelForCausalLM.from_pretrained(str(target), local_files_only=True, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    embed, lm_head = model.get_input_embeddings().weight.detach(), model.lm_head.weight.detach()
    serving = ServingDrafter(out, embed, lm_head)
    conv = json.loads((out.parents[2] / "chat.jsonl").read_text().splitlines()[0])["conversations"]
    ids = tok.apply_chat_template(conv[:2], add_generation_prompt=True, return_tensors="pt", return_dict=True)
    ids = ids["input_ids"]
    with torch.no_grad():
        res = model(input_ids=ids, output_hidden_states=True)
    anchor = int(res.logits[0, -1].argmax())  # the token the target just sampled
    ctx = serving.context(res.hidden_states)
    drafts = serving.draft(ctx, anchor)
    assert len(drafts) == K - 1 and all(0 <= t < embed.shape[0] for t in drafts)

    drafter = load_export(out).eval()
    n = ctx.shape[0]
    hidden = torch.cat([ctx, torch.zeros(1, ctx.shape[1])])[None]  # the anchor's own state: not there yet
    block = embed[torch.tensor([anchor] + [serving.mask_id] * (K - 1))][None, None]
    with torch.no_grad():
        mine = drafter(hidden, block, torch.tensor([[n]]), torch.tensor([n + 1]))[0, 0]
        theirs = serving.block_states(ctx, anchor)
    torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)
    assert (mine[1:] @ lm_head.T).argmax(-1).tolist() == drafts


def test_stage1_export_with_other_codebooks_is_a_target_as_it_is(tmp_path):
    """A stage-1 checkpoint trained with non-default --codebook-sizes (vocab 4096 + its rows):
    extraction and the drafter take its vocab unchanged (the old builder refused it)."""
    from train.common.codebooks import CodebookConfig
    from train.extract.data import generate_synthetic
    from train.stage1.model import build_model

    torch.manual_seed(0)
    model, spec = build_model("tiny", codebooks=CodebookConfig(ss=64, shape=96, tex=128, lengths=(8, 10, 10)))
    ckpt = tmp_path / "stage1-export"
    model.save_pretrained(str(ckpt))
    vocab = spec.vocab.padded_vocab
    assert vocab not in (4096, 5120)  # neither the base nor the default codebooks' vocab
    data = generate_synthetic(tmp_path / "data.jsonl", 6, seed=1, vocab=4096, min_len=16, max_len=32, median=20)
    shards = tmp_path / "shards"
    assert ex.main(["--out", str(shards), "--data", str(data), "--init-from", str(ckpt), "--layers", "1,2",
                    "--token-budget", "128", "--max-len", "32"], guard=False) == 0
    assert json.loads((shards / "meta.json").read_text())["vocab_size"] == vocab
    from safetensors.torch import load_file

    head = load_file(str(shards / "target_head.safetensors"))
    torch.testing.assert_close(head["embed_tokens"], model.get_input_embeddings().weight.detach())
    run = tmp_path / "dflash"
    assert dflash_train.main(["--data", str(shards), "--out", str(run), "--steps", "1", "--block-size", "4",
                              "--token-budget", "128", "--anchors", "4", "--warmup", "1"], guard=False) == 0
    cfg = torch.load(run / "drafter.pt", weights_only=False)["config"]
    assert cfg["vocab_size"] == vocab and cfg["mask_token_id"] == vocab - 1  # no tokenizer: the last row


def test_auto_mask_token_of_a_stage1_export_of_qwen35(tmp_path):
    """A tokenizer laid out as the stage-1 export of Qwen3.5's: 248,320 base tokens, then the 3D
    tokens (<|ss_0|> at 248,320); the embedding has 273,152 rows. auto gives the published 248070;
    the same export of a smaller tokenizer keeps the pad token."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from train.common.codebooks import code_token_name

    for base, want in ((248320, 248070), (5000, 7)):
        tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(
            {f"t{i}": i for i in range(base)}, unk_token="t0")), pad_token="t7")
        tok.add_tokens([code_token_name("ss", c) for c in range(4)], special_tokens=True)
        tok.save_pretrained(tmp_path / str(base))
        assert dflash_train.resolve_mask_token("auto", 273152, str(tmp_path / str(base))) == want


def test_mask_token_is_a_real_id_of_the_targets_tokenizer(target):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert dflash_train.resolve_mask_token("<|im_end|>", 4096, str(target)) == im_end
    assert dflash_train.resolve_mask_token(str(im_end), 4096, str(target)) == im_end
    assert dflash_train.resolve_mask_token("auto", 248320, None) == 248070  # the published Qwen3.5 id
    assert dflash_train.resolve_mask_token("auto", 4096, None) == 4095
    # a stage-1 export of Qwen3.5 (273,152 rows, the same tokenizer, 3D rows from 248,320 on) keys on
    # the tokenizer, not on the row count: the published id, never the pad token
    assert dflash_train.resolve_mask_token("auto", 273152, None) == 248070
    for bad, why in (("4096", "not a row"), (str(len(tok)), "padding row"), ("<|nope|>", "not a token")):
        with pytest.raises(ConfigError, match=why):
            dflash_train.resolve_mask_token(bad, 4096, str(target))


SHAPE = TargetShape(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=128, vocab_size=300, rope_theta=1e7)


def test_block_sparse_flex_attention_equals_the_dense_reference_and_keeps_the_strict_mask():
    """flex_attention with the block mask (what CUDA runs, compiled) against today's dense chunked
    attention, on 2 rows with a loss mask and rows of unequal length: the same outputs; and under
    flex, perturbing the context at the anchor changes nothing, before the anchor it does."""
    torch.manual_seed(0)
    cfg = drafter_config("tiny", SHAPE, [1, 2], 16)
    drafter = Drafter(cfg).eval()
    n = 200
    lengths = torch.tensor([n, 90])
    loss_mask = torch.zeros(2, n, dtype=torch.bool)
    loss_mask[0, 20:] = True
    loss_mask[1, 30:90] = True
    anchors = sample_anchors(lengths, 24, 16, torch.Generator().manual_seed(1), loss_mask)
    ids = torch.randint(0, 299, (2, n))
    hidden = torch.randn(2, n, 128)
    emb = torch.nn.Embedding(300, 64)
    blocks, _ = block_inputs(ids, anchors, 16, cfg.mask_token_id, loss_mask, lengths)
    x = emb(blocks).detach()
    with torch.no_grad():
        dense = drafter(hidden, x, anchors, lengths, attn_impl="dense")
        flex = drafter(hidden, x, anchors, lengths, attn_impl="flex")
        torch.testing.assert_close(flex, dense, atol=2e-5, rtol=1e-4)
        a = int(anchors[0, 3])
        at, before = hidden.clone(), hidden.clone()
        at[0, a:] += 5.0
        before[0, a - 1] += 5.0
        moved_at = drafter(at, x, anchors, lengths, attn_impl="flex")
        moved_before = drafter(before, x, anchors, lengths, attn_impl="flex")
    torch.testing.assert_close(moved_at[0, 3], flex[0, 3], atol=0, rtol=0)
    assert (moved_before[0, 3] - flex[0, 3]).abs().max() > 1e-3


def test_target_streamed_in_small_pieces_equals_from_pretrained_and_a_bad_checkpoint_is_one_line(
        target, tmp_path, monkeypatch, capsys):
    """With 64 KiB pieces (the embedding in row slices, the shard re-mapped many times) the decoder
    stack equals transformers' own from_pretrained; a checkpoint lacking a weight is one line."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from train.extract import target as target_mod

    monkeypatch.setattr(target_mod, "MAPPED_BYTES", 64 << 10)
    got = target_mod.load_target(target, "tiny", torch.device("cpu"))
    want = AutoModelForCausalLM.from_pretrained(str(target), local_files_only=True, dtype=torch.float32).model
    mine = dict(got.base.named_parameters())
    assert mine.keys() == dict(want.named_parameters()).keys()
    for name, p in want.named_parameters():
        assert torch.equal(mine[name], p), name
    # what an online drafter rank reads instead of the model: the config and the head, from the files
    embed, head = target_mod.checkpoint_head(target)
    full = AutoModelForCausalLM.from_pretrained(str(target), local_files_only=True, dtype=torch.float32)
    assert torch.equal(embed, full.get_input_embeddings().weight) and torch.equal(head, full.lm_head.weight)
    assert target_mod.checkpoint_config(target).num_hidden_layers == want.config.num_hidden_layers
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in target.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    weights = load_file(str(broken / "model.safetensors"))
    weights.pop("model.layers.1.mlp.up_proj.weight")
    save_file(weights, str(broken / "model.safetensors"), metadata={"format": "pt"})
    capsys.readouterr()  # transformers' loading bar above
    assert ex.main(["--out", str(tmp_path / "x"), "--init-from", str(broken), "--layers", "1,2"], guard=False) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lacks 1 weight(s)" in err[0] and "layers.1.mlp.up_proj.weight" in err[0], err


def test_a_vision_checkpoint_is_a_target_through_its_language_model(tmp_path):
    """A Qwen3.5 conditional-generation checkpoint (vision tower beside the text model): the target
    is its language model, loaded as it is, the tower left out."""
    from hf_fixtures import make_checkpoint
    from transformers import AutoModelForImageTextToText

    from train.extract.target import checkpoint_head, load_target

    ckpt = make_checkpoint(tmp_path / "vl", vision=True)
    got = load_target(ckpt, "tiny", torch.device("cpu"))
    full = AutoModelForImageTextToText.from_pretrained(str(ckpt), local_files_only=True, dtype=torch.float32)
    lm = full.model.language_model
    assert not any("visual" in n for n, _ in got.base.named_parameters())
    for name, p in lm.named_parameters():
        assert torch.equal(dict(got.base.named_parameters())[name], p), name
    ids = torch.randint(20, 500, (1, 12))
    with torch.no_grad():
        torch.testing.assert_close(got.base(input_ids=ids).last_hidden_state, lm(input_ids=ids).last_hidden_state)
    embed, head = checkpoint_head(ckpt)
    assert torch.equal(embed, lm.embed_tokens.weight) and torch.equal(head, full.lm_head.weight)
