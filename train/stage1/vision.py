"""Image -> vision-tower inputs for Qwen3.5 (``pixel_values`` + patch grid), without a hub processor.

Same layout as transformers' Qwen2-VL/Qwen3-VL image processors, so a checkpoint's vision tower
sees what it was trained on:

1. RGB, resized (bicubic, aspect kept) so that H and W are multiples of
   ``patch_size * spatial_merge_size`` and H*W lies in ``[min_pixels, max_pixels]`` (:func:`smart_resize`);
2. scaled to [0, 1] and normalised with mean 0.5, std 0.5 per channel (Qwen3-VL's constants);
3. the frame repeated ``temporal_patch_size`` times (a still image is a 1-step video), and cut
   into patches ordered by 2x2 merge window: ``(t, h/m, w/m, m, m)``, each patch flattened as
   ``(C, temporal, patch, patch)``, which is what ``Qwen3_5VisionPatchEmbed`` views it as and
   what the patch merger groups (m*m consecutive patches -> one placeholder token).

tests/test_vision.py checks this against transformers' own ``Qwen2VLImageProcessorPil``.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from train.common.packing import ImageInput
from train.stage1.model import VisionPresetConfig

IMAGE_MEAN = 0.5
IMAGE_STD = 0.5


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(H, W): multiples of ``factor``, aspect ratio about kept, H*W within [min_pixels, max_pixels]."""
    if min(height, width) < 1 or max(height, width) / min(height, width) > 200:
        raise ValueError(f"image of {width}x{height}: empty or aspect ratio above 200")
    h = max(factor, round(height / factor) * factor)
    w = max(factor, round(width / factor) * factor)
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def patchify(pixels: np.ndarray, cfg: VisionPresetConfig) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Normalised ``[C, H, W]`` float image -> (``[n_patches, C*T*P*P]``, patch grid (t, h, w))."""
    c, height, width = pixels.shape
    p, m, tp = cfg.patch_size, cfg.spatial_merge_size, cfg.temporal_patch_size
    if height % (p * m) or width % (p * m):
        raise ValueError(f"image {width}x{height} is not a multiple of patch*merge = {p * m}")
    gh, gw = height // p, width // p
    frames = np.broadcast_to(pixels[None], (tp, c, height, width))  # a still image: one temporal patch
    x = frames.reshape(1, tp, c, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # t, h/m, w/m, m, m, C, T, P, P
    return np.ascontiguousarray(x.reshape(gh * gw, c * tp * p * p)), (1, gh, gw)


class ImagePreprocessor:
    """PNG/JPEG path -> :class:`ImageInput` (placeholder span at 0; the tokenizer places it)."""

    def __init__(self, cfg: VisionPresetConfig) -> None:
        self.cfg = cfg
        self.factor = cfg.patch_size * cfg.spatial_merge_size

    @property
    def max_tokens(self) -> int:
        """Placeholder tokens of the largest image this preprocessor emits."""
        return self.cfg.max_pixels // self.factor**2

    def __call__(self, path: Path) -> ImageInput:
        from PIL import Image

        with Image.open(path) as im:
            im.load()
            rgb = im.convert("RGB")
        h, w = smart_resize(rgb.height, rgb.width, self.factor, self.cfg.min_pixels, self.cfg.max_pixels)
        if (w, h) != rgb.size:
            rgb = rgb.resize((w, h), Image.BICUBIC)
        pixels = (np.asarray(rgb, dtype=np.float32).transpose(2, 0, 1) / 255.0 - IMAGE_MEAN) / IMAGE_STD
        patches, grid = patchify(pixels, self.cfg)
        return ImageInput(torch.from_numpy(patches), grid, self.cfg.spatial_merge_size, start=0)
