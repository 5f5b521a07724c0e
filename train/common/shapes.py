"""Model shapes: the one registry of Qwen3.5 hybrid shapes that the trainers and the job specs name.

A MODEL SHAPE (``tiny``, ``qwen35-0.8b``, ``qwen35-2b``) is the architecture: layer counts and
widths, the base text vocabulary, the 3D codebooks and asset format, and the vision tower. It is
what ``--shape`` of stage 1 and the target's ``--shape`` of DFlash and extraction pick. A JOB
PRESET (``launch submit stage1 --preset tiny``) is something else: resources plus trainer
arguments, defined in ``launch/jobs/*.yaml`` only; a job preset names a model shape in its args.

Every shape is a Qwen3.5 hybrid: gated-delta-net (GDN, linear attention) layers with one full
attention layer every ``full_attention_interval`` layers (transformers' qwen3_5 classes).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from train.common.codebooks import CodebookConfig


@dataclass(frozen=True)
class VisionShape:
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
    # Images are resized to sides in multiples of this (px; 0: off), so a run meets few patch
    # grids (train.stage1.vision.ImageEncoder).
    size_bucket: int = 0


@dataclass(frozen=True)
class ModelShape:
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
    vision: VisionShape | None = None  # the tower built when the model is asked for vision

    @property
    def layer_types(self) -> list[str]:
        k = self.full_attention_interval
        return ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(self.num_layers)]


# The Qwen3.5 vision tower shape of transformers' Qwen3_5VisionConfig defaults (27 blocks of 1152,
# patch 16), random-init; images up to 1024x1024 (1024 placeholder tokens).
QWEN35_VISION = VisionShape(
    depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, patch_size=16,
    num_position_embeddings=2304, min_pixels=64 * 64, max_pixels=1024 * 1024, size_bucket=128,
)

SHAPES: dict[str, ModelShape] = {
    # ~5M parameters, 3 GDN + 1 full attention; small vocab, codebooks and assets (8 + 10 + 10
    # codes of 256 entries each: a 3D document fits a 128-token test row with its caption), so a
    # step is fast on 2 CPU cores. Same code path as the big shapes.
    "tiny": ModelShape(
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
        codebooks=CodebookConfig(ss=256, shape=256, tex=256, lengths=(8, 10, 10)),
        # ~0.23M parameters: the synthetic 32x32 images become a 4x4 patch grid, 4 placeholder
        # tokens after the 2x2 merge, so a step costs about what the text-only model did.
        vision=VisionShape(
            depth=2, hidden_size=64, num_heads=2, intermediate_size=128, patch_size=8,
            num_position_embeddings=64, min_pixels=32 * 32, max_pixels=64 * 64,
        ),
    ),
    "qwen35-0.8b": ModelShape(
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
    "qwen35-2b": ModelShape(
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


def get_shape(name: str) -> ModelShape:
    if name not in SHAPES:
        raise ValueError(f"unknown model shape {name!r}; valid shapes: {', '.join(SHAPES)}")
    return SHAPES[name]
