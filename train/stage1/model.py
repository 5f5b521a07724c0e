"""The stage-1 model builder, from transformers' own qwen3_5 classes and a model shape.

Models are random-init from a model shape (train.common.shapes), or loaded from a LOCAL
checkpoint directory (``init_from``); nothing is ever downloaded. The text vocabulary is then
extended with the 3D codebook tokens (:mod:`train.common.codebooks`), new rows initialised to the
mean of the existing ones, and the vocab padded to a multiple of 256.

The model is :class:`transformers.Qwen3_5ForCausalLM` (text tower only), or with ``vision=True``
:class:`transformers.Qwen3_5ForConditionalGeneration`: the same text model under
``model.model.language_model`` plus the vision tower (``model.model.visual``), which turns
``pixel_values``/``image_grid_thw`` into the embeddings of the image placeholder tokens. A
random-init vision model takes its placeholder ids from the tokenizer (``vision_ids``); a
checkpoint keeps its own (train.stage1.tokenizer checks them against its tokenizer). Packed rows
need the varlen-correct token mixers: call :func:`train.common.fastpath.install_kernels` on the
result (it finds the GDN layers wherever they sit in the module tree).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
    Qwen3_5VisionConfig,
)
from transformers.utils import logging as hf_logging

from train.common.codebooks import CodebookConfig, CodebookVocab, extend_embeddings
from train.common.gdn_guard import init_decay
from train.common.hf_local import HFLocalError, load_config
from train.common.shapes import SHAPES, ModelShape, VisionShape, get_shape

__all__ = ["SHAPES", "ModelSpec", "build_model", "get_shape", "text_config", "vision_config", "multimodal_config",
           "text_model_config", "VISION_ID_KEYS"]

# The config keys of a Qwen3.5 vision model that name tokenizer ids.
VISION_ID_KEYS = ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id")


@dataclass
class ModelSpec:
    shape: str
    vocab: CodebookVocab
    n_params: int
    n_gdn_layers: int
    n_full_attention_layers: int
    init_from: str | None
    vision: VisionShape | None = None  # set when the model has the vision tower
    n_vision_params: int = 0
    vision_ids: dict[str, int] | None = None  # the model config's image/video/vision start/end ids


def text_config(shape: ModelShape, vocab_size: int | None = None) -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        vocab_size=vocab_size or shape.base_vocab,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
        linear_conv_kernel_dim=shape.linear_conv_kernel_dim,
        linear_key_head_dim=shape.linear_key_head_dim,
        linear_value_head_dim=shape.linear_value_head_dim,
        linear_num_key_heads=shape.linear_num_key_heads,
        linear_num_value_heads=shape.linear_num_value_heads,
        layer_types=shape.layer_types,
        tie_word_embeddings=shape.tie_word_embeddings,
        max_position_embeddings=shape.max_position_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": shape.rope_theta,
            "partial_rotary_factor": shape.partial_rotary_factor,
            "mrope_section": list(shape.mrope_section),
            "mrope_interleaved": True,
        },
        use_cache=False,
    )


def vision_config(shape: ModelShape) -> Qwen3_5VisionConfig:
    v = shape.vision
    if v is None:
        raise ValueError("this model shape has no vision tower")
    return Qwen3_5VisionConfig(
        depth=v.depth,
        hidden_size=v.hidden_size,
        num_heads=v.num_heads,
        intermediate_size=v.intermediate_size,
        patch_size=v.patch_size,
        spatial_merge_size=v.spatial_merge_size,
        temporal_patch_size=v.temporal_patch_size,
        out_hidden_size=shape.hidden_size,
        num_position_embeddings=v.num_position_embeddings,
    )


def multimodal_config(shape: ModelShape, vision_ids: dict[str, int]) -> Qwen3_5Config:
    """Qwen3_5Config: the shape's text config + vision tower, with the placeholder token ids of
    the tokenizer in use (``vision_ids``: the keys of VISION_ID_KEYS)."""
    return Qwen3_5Config(
        text_config=text_config(shape).to_dict(),
        vision_config=vision_config(shape).to_dict(),
        **{k: vision_ids[k] for k in VISION_ID_KEYS},
        tie_word_embeddings=shape.tie_word_embeddings,
    )


def text_model_config(model: torch.nn.Module):
    """The text config of either model class (the conditional model nests it)."""
    return getattr(model.config, "text_config", model.config)


def build_model(
    shape: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    init_from: str | Path | None = None,
    attn_implementation: str = "sdpa",
    vision: bool = False,
    codebooks: CodebookConfig | None = None,
    vision_ids: dict[str, int] | None = None,
):
    """Build the stage-1 model: ``(Qwen3_5ForCausalLM, ModelSpec)``, or with ``vision=True``
    ``(Qwen3_5ForConditionalGeneration, ModelSpec)`` (the shape must have a vision tower).

    ``init_from``: a local directory holding a transformers checkpoint (config.json +
    safetensors). A checkpoint already extended to the padded codebook vocab loads as is; a base
    checkpoint is extended here. ``codebooks``: the 3D codebooks (default: the shape's).
    ``vision_ids``: placeholder ids for a random-init vision model (VISION_ID_KEYS).
    Raises ValueError (one line) for an unknown shape or a checkpoint that does not fit.
    """
    cfg = get_shape(shape)
    if vision and cfg.vision is None:
        raise ValueError(f"model shape {shape!r} has no vision tower; run it without vision")
    model_cls = Qwen3_5ForConditionalGeneration if vision else Qwen3_5ForCausalLM
    vocab = CodebookVocab(cfg.base_vocab, codebooks or cfg.codebooks)
    if init_from is not None:
        path = Path(init_from)
        hf_config = load_config(path)
        if vision and getattr(hf_config, "vision_config", None) is None:
            raise ValueError(f"--init-from {path}: the checkpoint has no vision tower (no vision_config in its "
                             "config.json); train it with --vision off")
        # transformers' load report (a table of MISSING weights on stderr) is replaced by the one
        # line below: the user sees what to do, not a table that scrolls past.
        verbosity, bars = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
        try:
            model, info = model_cls.from_pretrained(
                path, local_files_only=True, dtype=torch.float32, attn_implementation=attn_implementation,
                output_loading_info=True,
            )
        finally:
            hf_logging.set_verbosity(verbosity)
            if bars:
                hf_logging.enable_progress_bar()
        # A weight the checkpoint lacks is random init in a model that reads as "initialised from"
        # it (a half-copied checkpoint: every GDN layer re-initialised): refused, not trained.
        missing = sorted(set(info.get("missing_keys") or ()) | {k[0] if isinstance(k, tuple) else k
                                                                 for k in info.get("mismatched_keys") or ()})
        if missing:
            raise HFLocalError(f"--init-from {path}: {len(missing)} of the model's weights are not in the checkpoint "
                             f"or do not fit it (e.g. {missing[0]}); they would start from random init: give a "
                             "complete checkpoint of this model")
        loaded_vocab = model.get_input_embeddings().weight.shape[0]
        if loaded_vocab not in (cfg.base_vocab, vocab.padded_vocab):
            raise ValueError(
                f"--init-from {path}: vocab {loaded_vocab} matches neither model shape {shape!r}'s base vocab "
                f"{cfg.base_vocab} nor its extended vocab {vocab.padded_vocab}"
            )
    else:
        if vision and vision_ids is None:
            raise ValueError("a random-init vision model needs the tokenizer's vision token ids")
        config = multimodal_config(cfg, vision_ids) if vision else text_config(cfg)
        with torch.device(device):
            model = model_cls._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
        init_decay(model)  # A_log drawn in fp32 above torchtitan's bound: no head starts dead (gdn_guard)
    # A training model never caches: a checkpoint's use_cache=true makes transformers skip the
    # per-document mask it derives from position_ids (train.stage1.objective passes False as well).
    for config in {id(c): c for c in (model.config, text_model_config(model))}.values():
        config.use_cache = False
    extend_embeddings(model, vocab.padded_vocab)
    text_model_config(model).vocab_size = vocab.padded_vocab
    model.to(device=device, dtype=dtype)
    types = text_model_config(model).layer_types
    spec = ModelSpec(
        shape=shape,
        vocab=vocab,
        n_params=sum(p.numel() for p in model.parameters()),
        n_gdn_layers=types.count("linear_attention"),
        n_full_attention_layers=types.count("full_attention"),
        init_from=str(init_from) if init_from is not None else None,
        vision=cfg.vision if vision else None,
        n_vision_params=sum(p.numel() for p in model.model.visual.parameters()) if vision else 0,
        vision_ids={k: getattr(model.config, k) for k in VISION_ID_KEYS} if vision else None,
    )
    return model, spec
