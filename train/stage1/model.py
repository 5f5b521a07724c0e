"""Stage-1 model presets, built from transformers' own qwen3_5 classes.

Every preset is a Qwen3.5 hybrid: gated-delta-net (GDN, linear attention) layers with one
full-attention layer every ``full_attention_interval`` layers. Models are random-init from the
preset's shape, or loaded from a LOCAL checkpoint directory (``init_from``); nothing is ever
downloaded. The text vocabulary is then extended with the 3D codebook tokens
(:mod:`train.common.codebooks`), new rows initialised to the mean of the existing ones, and the
vocab padded to a multiple of 256.

The model is :class:`transformers.Qwen3_5ForCausalLM` (text tower only). Packed rows need the
varlen-correct token mixers: call :func:`train.common.fastpath.install_kernels` on the result.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from train.common.codebooks import CodebookConfig, CodebookVocab, extend_embeddings


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

    @property
    def layer_types(self) -> list[str]:
        k = self.full_attention_interval
        return ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(self.num_layers)]


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


def build_model(
    preset: str,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    init_from: str | Path | None = None,
    attn_implementation: str = "sdpa",
):
    """Build the stage-1 model: ``(Qwen3_5ForCausalLM, ModelSpec)``.

    ``init_from``: a local directory holding a transformers checkpoint (config.json +
    safetensors). A checkpoint already extended to the padded codebook vocab loads as is; a base
    checkpoint is extended here. Raises ValueError for an unknown preset or a missing directory.
    """
    from transformers import Qwen3_5ForCausalLM

    cfg = get_preset(preset)
    vocab = CodebookVocab(cfg.base_vocab, cfg.codebooks)
    if init_from is not None:
        path = Path(init_from)
        if not (path / "config.json").is_file():
            raise ValueError(f"--init-from {path}: no config.json there; give a local transformers checkpoint dir")
        model = Qwen3_5ForCausalLM.from_pretrained(
            path, local_files_only=True, dtype=torch.float32, attn_implementation=attn_implementation
        )
        loaded_vocab = model.get_input_embeddings().weight.shape[0]
        if loaded_vocab not in (cfg.base_vocab, vocab.padded_vocab):
            raise ValueError(
                f"--init-from {path}: vocab {loaded_vocab} matches neither preset {preset!r}'s base vocab "
                f"{cfg.base_vocab} nor its extended vocab {vocab.padded_vocab}"
            )
    else:
        config = text_config(cfg)
        with torch.device(device):
            model = Qwen3_5ForCausalLM._from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    extend_embeddings(model, vocab.padded_vocab)
    model.config.vocab_size = vocab.padded_vocab
    model.to(device=device, dtype=dtype)
    types = model.config.layer_types
    spec = ModelSpec(
        preset=preset,
        vocab=vocab,
        n_params=sum(p.numel() for p in model.parameters()),
        n_gdn_layers=types.count("linear_attention"),
        n_full_attention_layers=types.count("full_attention"),
        init_from=str(init_from) if init_from is not None else None,
    )
    return model, spec
