"""Stage-1 model presets, built from transformers' own qwen3_5 classes.

Every preset is a Qwen3.5 hybrid: gated-delta-net (GDN, linear attention) layers with one
full-attention layer every ``full_attention_interval`` layers. Models are random-init from the
preset's shape, or loaded from a LOCAL checkpoint directory (``init_from``); nothing is ever
downloaded. The text vocabulary is then extended with the 3D codebook tokens
(:mod:`train.common.codebooks`), new rows initialised to the mean of the existing ones, and the
vocab padded to a multiple of 256.

The model is :class:`transformers.Qwen3_5ForCausalLM` (text tower only), or with ``vision=True``
:class:`transformers.Qwen3_5ForConditionalGeneration`: the same text model under
``model.model.language_model`` plus the preset's vision tower (``model.model.visual``), which turns
``pixel_values``/``image_grid_thw`` into the embeddings of the image placeholder tokens. Packed rows
need the varlen-correct token mixers: call :func:`train.common.fastpath.install_kernels` on the
result (it finds the GDN layers wherever they sit in the module tree).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from train.common.codebooks import CodebookConfig, CodebookVocab, extend_embeddings


@dataclass(frozen=True)
class VisionPresetConfig:
    """A Qwen3.5 vision tower shape, plus the image sizes its inputs are resized into."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    num_position_embeddings: int  # learned position grid (a square), resampled to each image's grid
    min_pixels: int  # images are resized (aspect kept) so that H*W lies in [min_pixels, max_pixels]
    max_pixels: int  # and H, W are multiples of patch_size * spatial_merge_size
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2


@dataclass(frozen=True)
class ModelPresetConfig:
    hidden_size: int
    num_layers: int
    full_attention_interval: int  # every n-th layer is full attention, the rest GDN
    num_heads: int
    num_kv_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    intermediate_size: int
    base_vocab: int
    tie_word_embeddings: bool = True
    linear_conv_kernel_dim: int = 4
    rope_theta: float = 10_000_000.0
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, int, int] = (11, 11, 10)
    max_position_embeddings: int = 32768
    codebooks: CodebookConfig = field(default_factory=CodebookConfig)
    vision: VisionPresetConfig | None = None  # the tower built when the model is asked for vision

    @property
    def layer_types(self) -> list[str]:
        k = self.full_attention_interval
        return ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(self.num_layers)]


# The Qwen3.5 vision tower shape of transformers' Qwen3_5VisionConfig defaults (27 blocks of 1152,
# patch 16), random-init; images up to 1024x1024 (1024 placeholder tokens).
QWEN35_VISION = VisionPresetConfig(
    depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, patch_size=16,
    num_position_embeddings=2304, min_pixels=64 * 64, max_pixels=1024 * 1024,
)

PRESETS: dict[str, ModelPresetConfig] = {
    # ~5M parameters, 3 GDN + 1 full attention; small vocab and scaled-down codebooks so a step is
    # fast on 2 CPU cores. Same code path as the big shapes.
    "tiny": ModelPresetConfig(
        hidden_size=256,
        num_layers=4,
        full_attention_interval=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        linear_num_key_heads=4,
        linear_num_value_heads=4,
        linear_key_head_dim=64,
        linear_value_head_dim=64,
        intermediate_size=768,
        base_vocab=4096,
        mrope_section=(3, 3, 2),
        max_position_embeddings=8192,
        codebooks=CodebookConfig(ss=216, shape=256, tex=256),
        # ~0.23M parameters: the synthetic 32x32 images become a 4x4 patch grid, 4 placeholder
        # tokens after the 2x2 merge, so a step costs about what the text-only model did.
        vision=VisionPresetConfig(
            depth=2, hidden_size=64, num_heads=2, intermediate_size=128, patch_size=8,
            num_position_embeddings=64, min_pixels=32 * 32, max_pixels=64 * 64,
        ),
    ),
    "qwen35-0.8b": ModelPresetConfig(
        hidden_size=1024,
        num_layers=24,
        full_attention_interval=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        intermediate_size=3584,
        base_vocab=248320,
        vision=QWEN35_VISION,
    ),
    "qwen35-2b": ModelPresetConfig(
        hidden_size=2048,
        num_layers=24,  # 18 GDN + 6 full attention
        full_attention_interval=4,
        num_heads=8,
        num_kv_heads=2,
        head_dim=256,
        linear_num_key_heads=16,
        linear_num_value_heads=16,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        intermediate_size=6144,
        base_vocab=248320,
        vision=QWEN35_VISION,
    ),
}


@dataclass
class ModelSpec:
    preset: str
    vocab: CodebookVocab
    n_params: int
    n_gdn_layers: int
    n_full_attention_layers: int
    init_from: str | None
    vision: VisionPresetConfig | None = None  # set when the model has the vision tower
    n_vision_params: int = 0


def get_preset(preset: str) -> ModelPresetConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; valid presets: {', '.join(PRESETS)}")
    return PRESETS[preset]


def text_config(preset: ModelPresetConfig, vocab_size: int | None = None):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab_size or preset.base_vocab,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_layers,
        num_attention_heads=preset.num_heads,
        num_key_value_heads=preset.num_kv_heads,
        head_dim=preset.head_dim,
        linear_conv_kernel_dim=preset.linear_conv_kernel_dim,
        linear_key_head_dim=preset.linear_key_head_dim,
        linear_value_head_dim=preset.linear_value_head_dim,
        linear_num_key_heads=preset.linear_num_key_heads,
        linear_num_value_heads=preset.linear_num_value_heads,
        layer_types=preset.layer_types,
        tie_word_embeddings=preset.tie_word_embeddings,
        max_position_embeddings=preset.max_position_embeddings,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": preset.rope_theta,
            "partial_rotary_factor": preset.partial_rotary_factor,
            "mrope_section": list(preset.mrope_section),
            "mrope_interleaved": True,
        },
        use_cache=False,
    )


def vision_config(preset: ModelPresetConfig):
    from transformers import Qwen3_5VisionConfig

    v = preset.vision
    if v is None:
        raise ValueError("this preset has no vision tower")
    return Qwen3_5VisionConfig(
        depth=v.depth,
        hidden_size=v.hidden_size,
        num_heads=v.num_heads,
        intermediate_size=v.intermediate_size,
        patch_size=v.patch_size,
        spatial_merge_size=v.spatial_merge_size,
        temporal_patch_size=v.temporal_patch_size,
        out_hidden_size=preset.hidden_size,
        num_position_embeddings=v.num_position_embeddings,
    )


def multimodal_config(preset: ModelPresetConfig):
    """Qwen3_5Config: the preset's text config + vision tower, with the placeholder token ids of
    the stage-1 tokenizer (train.stage1.data.TinyTokenizer)."""
    from transformers import Qwen3_5Config

    from train.stage1.data import TinyTokenizer

    ids = TinyTokenizer.vision_token_ids()
    return Qwen3_5Config(
        text_config=text_config(preset).to_dict(),
        vision_config=vision_config(preset).to_dict(),
        image_token_id=ids["image"],
        video_token_id=ids["video"],
        vision_start_token_id=ids["vision_start"],
        vision_end_token_id=ids["vision_end"],
        tie_word_embeddings=preset.tie_word_embeddings,
    )


def text_model_config(model: torch.nn.Module):
    """The text config of either model class (the conditional model nests it)."""
    return getattr(model.config, "text_config", model.config)


def build_model(
    preset: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    init_from: str | Path | None = None,
    attn_implementation: str = "sdpa",
    vision: bool = False,
):
    """Build the stage-1 model: ``(Qwen3_5ForCausalLM, ModelSpec)``, or with ``vision=True``
    ``(Qwen3_5ForConditionalGeneration, ModelSpec)`` (the preset must have a vision tower).

    ``init_from``: a local directory holding a transformers checkpoint (config.json +
    safetensors). A checkpoint already extended to the padded codebook vocab loads as is; a base
    checkpoint is extended here. Raises ValueError for an unknown preset or a missing directory.
    """
    from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    cfg = get_preset(preset)
    if vision and cfg.vision is None:
        raise ValueError(f"preset {preset!r} has no vision tower; run it without vision")
    model_cls = Qwen3_5ForConditionalGeneration if vision else Qwen3_5ForCausalLM
    vocab = CodebookVocab(cfg.base_vocab, cfg.codebooks)
    if init_from is not None:
        path = Path(init_from)
        if not (path / "config.json").is_file():
            raise ValueError(f"--init-from {path}: no config.json there; give a local transformers checkpoint dir")
        model = model_cls.from_pretrained(
            path, local_files_only=True, dtype=torch.float32, attn_implementation=attn_implementation
        )
        loaded_vocab = model.get_input_embeddings().weight.shape[0]
        if loaded_vocab not in (cfg.base_vocab, vocab.padded_vocab):
            raise ValueError(
                f"--init-from {path}: vocab {loaded_vocab} matches neither preset {preset!r}'s base vocab "
                f"{cfg.base_vocab} nor its extended vocab {vocab.padded_vocab}"
            )
    else:
        config = multimodal_config(cfg) if vision else text_config(cfg)
        with torch.device(device):
            model = model_cls._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    extend_embeddings(model, vocab.padded_vocab)
    text_model_config(model).vocab_size = vocab.padded_vocab
    model.to(device=device, dtype=dtype)
    types = text_model_config(model).layer_types
    spec = ModelSpec(
        preset=preset,
        vocab=vocab,
        n_params=sum(p.numel() for p in model.parameters()),
        n_gdn_layers=types.count("linear_attention"),
        n_full_attention_layers=types.count("full_attention"),
        init_from=str(init_from) if init_from is not None else None,
        vision=cfg.vision if vision else None,
        n_vision_params=sum(p.numel() for p in model.model.visual.parameters()) if vision else 0,
    )
    return model, spec
