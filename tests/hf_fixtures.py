"""Tiny local Qwen3.5 checkpoint directories, built here (no hub is reachable).

A random tiny Qwen3.5 (the ``tiny`` shape, text-only or with its vision tower) saved with
``save_pretrained``; a byte-level BPE tokenizer trained with the ``tokenizers`` library on a few
hundred lines, saved as a transformers tokenizer with Qwen's special tokens; the vision model's
config names the tokenizer's ``<|image_pad|>``/``<|vision_start|>``/``<|vision_end|>`` ids, as a
real Qwen3.5 checkpoint does, and the Qwen image processor's config sits next to it.
"""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

from train.common.shapes import get_shape
from train.stage1.data import load_manifests, tokenize_record
from train.stage1.model import multimodal_config, text_config
from train.stage1.synthetic import COLORS, PRIMITIVES, REPLAY_SENTENCES, SIZES
from train.stage1.vision import image_processor_for_shape

# Qwen's special tokens in Qwen's order (<|image_pad|> is the 13th): ids unlike the byte stand-in's.
QWEN_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                 "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>",
                 "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>"]


def training_lines() -> list[str]:
    """A few hundred lines in the synthetic data's words (so its captions tokenize compactly)."""
    lines = list(REPLAY_SENTENCES)
    for p in PRIMITIVES:
        for c in COLORS:
            for s in SIZES:
                lines += [f"make a {s} {c} {p}.", f"this is a {s} {c} {p}.", f"a picture of a {s} {c} {p}."]
    return lines


def make_tokenizer(path: Path, vocab_size: int = 600) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=QWEN_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(training_lines(), trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
                                 unk_token=None, additional_special_tokens=QWEN_SPECIALS[1:])
    hf.save_pretrained(path)
    return hf


def make_checkpoint(path: Path, vision: bool = False, seed: int = 0) -> Path:
    """A tiny random Qwen3.5 checkpoint dir with its own tokenizer (and image processor with vision)."""
    torch.manual_seed(seed)
    shape = get_shape("tiny")
    hf = make_tokenizer(path)
    if vision:
        ids = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
               "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>"}
        model = Qwen3_5ForConditionalGeneration(
            multimodal_config(shape, {k: hf.convert_tokens_to_ids(t) for k, t in ids.items()}))
        image_processor_for_shape(shape.vision).save_pretrained(path)
    else:
        model = Qwen3_5ForCausalLM(text_config(shape))
    # as every real checkpoint (Qwen3.5's, the stage-1 export): the trainer must not act on it
    for config in (model.config, getattr(model.config, "text_config", model.config)):
        config.use_cache = True
    model.save_pretrained(path)
    return path


def document_logits(model: torch.nn.Module, tok, data: Path, task: str, index: int) -> torch.Tensor:
    """Logits of one real document of the data set (record `index` of `task`), alone, through
    transformers' stock forward: what an exported checkpoint is compared on."""
    doc = tokenize_record(tok, data, task, load_manifests(data).records[task][index][1])
    ids = torch.tensor([doc.tokens])
    kwargs = {}
    if doc.images:
        kwargs = dict(pixel_values=torch.cat([i.pixel_values for i in doc.images]),
                      image_grid_thw=torch.tensor([i.grid_thw for i in doc.images]),
                      mm_token_type_ids=(ids == tok.vision_ids["image_token_id"]).int())
    with torch.no_grad():
        return model(input_ids=ids, **kwargs).logits
