"""Image -> vision-tower inputs (``pixel_values`` + patch grid) through transformers' own processor.

With ``--init-from DIR`` the processor is DIR's own (``AutoImageProcessor``, local files); for a
random-init shape it is transformers' Qwen2-VL image processor (what Qwen3.5 checkpoints name)
configured from the shape's vision tower (:func:`image_processor_for_shape`): patch and merge
sizes of the tower, H*W in ``[min_pixels, max_pixels]``, mean/std 0.5 (Qwen3-VL's constants).
Either way the export writes that processor's config next to the weights.

Images are opened with a size check before any pixel is decoded: a PNG whose header claims more
than ``MAX_IMAGE_PIXELS`` pixels (a decompression bomb) is a bad image, not an allocation of
gigabytes. The caller turns :class:`BadImage` into a malformed record.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from PIL import Image
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil, smart_resize

from train.common.packing import ImageInput
from train.common.shapes import VisionShape

IMAGE_MEAN = 0.5
IMAGE_STD = 0.5
# Far above what a vision tower sees (the processors resize to <= ~1M pixels) and far below what
# exhausts a loader worker's memory (64M RGB pixels = 192 MiB decoded).
MAX_IMAGE_PIXELS = 64 * 1024 * 1024


class BadImage(ValueError):
    """An image file that cannot be used; one line."""


def image_processor_for_shape(v: VisionShape) -> Qwen2VLImageProcessorPil:
    """The Qwen2-VL image processor configured for vision tower ``v`` (random-init shapes)."""
    return Qwen2VLImageProcessorPil(
        patch_size=v.patch_size, merge_size=v.spatial_merge_size, temporal_patch_size=v.temporal_patch_size,
        min_pixels=v.min_pixels, max_pixels=v.max_pixels, image_mean=[IMAGE_MEAN] * 3, image_std=[IMAGE_STD] * 3,
    )


def check_processor(processor: Any, vision_config: Any, where: str) -> None:
    """ValueError unless the processor cuts patches the way the vision tower reads them."""
    pairs = [("patch_size", "patch_size"), ("merge_size", "spatial_merge_size"),
             ("temporal_patch_size", "temporal_patch_size")]
    for p_key, v_key in pairs:
        theirs, ours = getattr(processor, p_key, None), getattr(vision_config, v_key)
        if theirs != ours:
            raise ValueError(f"{where}: image processor {p_key}={theirs} but the vision tower's {v_key}={ours}")


def _check_size(path: Path, w: int, h: int) -> None:
    if w * h > MAX_IMAGE_PIXELS:
        raise BadImage(f"image {path} is {w}x{h} pixels, above the {MAX_IMAGE_PIXELS} limit (a decompression bomb?)")


def image_size(path: Path) -> tuple[int, int]:
    """(width, height) of the image at ``path`` from its header, nothing decoded; BadImage for an
    unreadable file or a decompression bomb."""
    try:
        with Image.open(path) as im:
            w, h = im.size
    except Image.DecompressionBombError as exc:  # PIL's own limit, hit at open for the largest claims
        raise BadImage(f"image {path}: {exc} (a decompression bomb?)") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise BadImage(f"unreadable image {path} ({type(exc).__name__})") from None
    _check_size(path, w, h)
    return w, h


def open_rgb(path: Path) -> Image.Image:
    """The image at ``path`` as RGB; BadImage for an unreadable file or a decompression bomb."""
    try:
        with Image.open(path) as im:
            _check_size(path, *im.size)  # from the header: nothing decoded yet
            im.load()
            return im.convert("RGB")
    except BadImage:
        raise
    except Image.DecompressionBombError as exc:  # PIL's own limit, hit at open for the largest claims
        raise BadImage(f"image {path}: {exc} (a decompression bomb?)") from None
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise BadImage(f"unreadable image {path} ({type(exc).__name__})") from None


def _pixel_bounds(processor: Any) -> tuple[int, int]:
    size = processor.size
    get = size.get if isinstance(size, dict) else lambda k: getattr(size, k)
    return int(get("shortest_edge")), int(get("longest_edge"))  # Qwen2-VL: min / max pixels


def bucketed_size(height: int, width: int, bucket: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(h, w) snapped to multiples of ``bucket`` px, aspect kept as closely as that allows, with
    h*w in [min_pixels, max_pixels] (steps of ``bucket`` down or up until it is)."""
    h, w = (max(bucket, round(x / bucket) * bucket) for x in (height, width))
    while h * w > max_pixels and max(h, w) > bucket:
        if h >= w:
            h -= bucket
        else:
            w -= bucket
    while h * w < min_pixels:
        if h <= w:
            h += bucket
        else:
            w += bucket
    return h, w


class ImageEncoder:
    """PNG/JPEG path -> :class:`ImageInput` (placeholder span at 0; the tokenizer places it).

    ``bucket`` (px, a multiple of patch x merge; 0: off): each image is first resized to sides
    that are multiples of it, so a run's images come in a small set of patch grids (square
    448-1024 px images at 128: 5 grids instead of 19). The vision tower's kernels and the
    allocator's blocks then see few shapes, all met early in a run.
    """

    def __init__(self, processor: Any, bucket: int = 0) -> None:
        self.processor = processor
        self.merge = int(processor.merge_size)
        unit = int(processor.patch_size) * self.merge
        if bucket % unit:
            raise ValueError(f"image size bucket {bucket} px is not a multiple of patch x merge = {unit}")
        self.bucket = bucket

    @property
    def max_tokens(self) -> int:
        """Placeholder tokens of the largest image this processor emits."""
        return _pixel_bounds(self.processor)[1] // (int(self.processor.patch_size) * self.merge) ** 2

    @property
    def min_tokens(self) -> int:
        """Placeholder tokens of the smallest image this processor emits."""
        unit = int(self.processor.patch_size) * self.merge
        return max(1, -(-_pixel_bounds(self.processor)[0] // unit**2))

    def tokens_for(self, path: Path) -> int:
        """Placeholder tokens the image at ``path`` will have, from its header alone (nothing
        decoded): the vision budget turns away images that would not fit before paying their
        decode. The same resizes as ``__call__`` (bucket, then the processor's smart_resize)."""
        w, h = image_size(path)
        lo, hi = _pixel_bounds(self.processor)
        if self.bucket:
            h, w = bucketed_size(h, w, self.bucket, lo, hi)
        unit = int(self.processor.patch_size) * self.merge
        try:
            h, w = smart_resize(h, w, factor=unit, min_pixels=lo, max_pixels=hi)
        except ValueError as exc:
            raise BadImage(f"image {path}: {exc}") from None
        return (h // unit) * (w // unit)

    def __call__(self, path: Path) -> ImageInput:
        rgb = open_rgb(path)
        if self.bucket:
            w, h = rgb.size
            hb, wb = bucketed_size(h, w, self.bucket, *_pixel_bounds(self.processor))
            if (hb, wb) != (h, w):
                rgb = rgb.resize((wb, hb), Image.Resampling.BICUBIC)
        try:
            out = self.processor(images=[rgb], return_tensors="pt")
        except (ValueError, OSError) as exc:  # e.g. an aspect ratio the resize refuses
            raise BadImage(f"image {path}: {' '.join(str(exc).split())[:200]}") from None
        grid = tuple(int(x) for x in out["image_grid_thw"][0].tolist())
        return ImageInput(out["pixel_values"].float(), grid, self.merge, start=0)
