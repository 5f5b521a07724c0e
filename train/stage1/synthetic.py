"""A synthetic stage-1 dataset in the real format (train.stage1.data), for demos, tests and benches.

`python -m train.stage1.synthetic --out DIR [--samples N] [--shape tiny|qwen35-2b ...]`

Assets have the real shape of the model shape's asset format (Qwen3.5: 1,728 SS + 2,048 shape +
2,048 tex codes of 8,192 entries; ``tiny`` scales both down) and the reference run's length mix:
replay text of a few hundred tokens, 3D samples of about 5.8k-6.9k tokens (an asset plus its
caption, or plus an image of up to ~1k vision tokens). The codes are a function of the object
(primitive, colour, size) plus 5% noise, so a model can learn them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from toolkit.fsutil import atomic_write_text
from train.common.codebooks import CODEBOOK_NAMES, CodebookConfig, parse_lengths, parse_sizes
from train.common.shapes import get_shape
from train.stage1.tasks import REFERENCE_COUNTS, TASKS  # not .data: generating needs no torch

PRIMITIVES = ("cube", "sphere", "cone", "cylinder", "torus", "pyramid")
COLORS = {
    "red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40),
    "purple": (140, 50, 170), "orange": (240, 140, 30), "white": (240, 240, 240), "black": (20, 20, 20),
}
SIZES = ("tiny", "small", "large", "huge")
REPLAY_SENTENCES = (
    "the quick brown fox jumps over the lazy dog.",
    "a model that sees many shapes learns to name them.",
    "light falls on the table and the shadows grow long.",
    "every object has a shape, a size and a colour.",
    "she placed the cup next to the small wooden box.",
)
ANY_LENGTH = (8, 64)  # codes per codebook when the format says "any"


def object_codes(prim: int, color: int, size: int, rng: np.random.Generator,
                 codebooks: CodebookConfig) -> dict[str, np.ndarray]:
    """One asset's codes in the format's lengths: a function of the object, plus 5% noise."""
    out = {}
    for k, (name, length) in enumerate(zip(CODEBOOK_NAMES, codebooks.lengths, strict=True)):
        n = int(rng.integers(*ANY_LENGTH)) if length is None else length
        i = np.arange(n)
        base = {"ss": prim * 211 + i * (size + 1) * 13, "shape": prim * 331 + (i * i) * 7 + size * 29,
                "tex": color * 251 + i * 5 + k}[name]
        arr = base % codebooks.sizes[name]
        noise = rng.random(n) < 0.05
        arr[noise] = rng.integers(0, codebooks.sizes[name], int(noise.sum()))
        out[name] = arr.astype(np.int16 if codebooks.sizes[name] < 2**15 else np.int32)
    return out


def draw_image(path: Path, side: int, prim: int, color: tuple[int, int, int], size: int,
               rng: np.random.Generator) -> None:
    bg = tuple(int(c) for c in rng.integers(90, 140, 3))
    im = Image.new("RGB", (side, side), bg)
    d = ImageDraw.Draw(im)
    r = side * (4 + 3 * size) // 32
    jitter = max(1, side // 10)
    cx, cy = side // 2 + int(rng.integers(-jitter, jitter + 1)), side // 2 + int(rng.integers(-jitter, jitter + 1))
    box = (cx - r, cy - r, cx + r, cy + r)
    name = PRIMITIVES[prim]
    if name in ("cube", "cylinder"):
        d.rectangle(box, fill=color)
    elif name in ("sphere", "torus"):
        d.ellipse(box, fill=color)
        if name == "torus":
            d.ellipse((cx - r // 3, cy - r // 3, cx + r // 3, cy + r // 3), fill=bg)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=color)
    im.save(path, format="PNG")


def generate_synthetic(
    out: str | os.PathLike[str], samples: int, seed: int = 0, malformed: int = 0, shape: str = "tiny",
    codebooks: CodebookConfig | None = None,
) -> dict[str, int]:
    """Write a small dataset in the stage-1 format; return records written per task.

    Assets follow ``codebooks`` (default: model shape ``shape``'s format); images are sized for
    the shape's vision tower (up to its max_pixels). ``malformed`` extra broken lines are spread
    over the manifests (for tests and demos of the malformed-record accounting).
    """
    model_shape = get_shape(shape)
    codebooks = codebooks or model_shape.codebooks
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "tokens3d").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    v = model_shape.vision
    # Images from 7/16 of the tower's largest side up to it (qwen35: 448-1024 px, 196-1024
    # vision tokens, the reference run's range); a small CPU tower (tiny) gets its smallest
    # image, so its step costs about what a text-only one does.
    hi = int(math.isqrt(v.max_pixels)) if v else 32
    lo = int(math.isqrt(v.min_pixels)) if v else 32
    lo, hi = (max(lo, hi * 7 // 16), hi) if hi >= 512 else (lo, lo)
    asset_len = sum(n if n is not None else sum(ANY_LENGTH) // 2 for n in codebooks.lengths)
    replay_sentences = max(1, asset_len // 4 // 45)  # ~1/4 of an asset's length in characters
    total_ref = sum(REFERENCE_COUNTS.values())
    counts = {t: max(1, round(samples * c / total_ref)) for t, c in REFERENCE_COUNTS.items()}
    color_names = list(COLORS)
    lines: dict[str, list[str]] = {t: [] for t in TASKS}
    for task in TASKS:
        for j in range(counts[task]):
            prim, color, size = int(rng.integers(len(PRIMITIVES))), int(rng.integers(len(COLORS))), int(rng.integers(4))
            sid = f"{task}-{j:06d}"
            caption = f"a {SIZES[size]} {color_names[color]} {PRIMITIVES[prim]}."
            rec: dict[str, Any] = {"id": sid}
            if task in ("gen_img", "replay_img"):
                rec["image"] = f"images/{sid}.png"
                draw_image(out / rec["image"], int(rng.integers(lo, hi + 1)), prim, COLORS[color_names[color]], size,
                           rng)
            if task in ("gen_img", "gen_txt", "und"):
                rec["tokens3d"] = f"tokens3d/{sid}.npz"
                np.savez(out / rec["tokens3d"], **object_codes(prim, color, size, rng, codebooks))
            if task == "gen_txt":
                rec["text"] = f"make {caption}"
            elif task == "und":
                rec["text"] = f"this is {caption}"
            elif task == "replay_img":
                rec["text"] = f"a picture of {caption}"
            elif task == "replay_text":
                n = int(rng.integers(max(1, replay_sentences // 2), replay_sentences * 3 // 2 + 2))
                rec["text"] = " ".join(REPLAY_SENTENCES[int(i)] for i in rng.integers(len(REPLAY_SENTENCES), size=n))
            lines[task].append(json.dumps(rec))
    broken = ['{"id": "broken", ', '["not", "an", "object"]', '{"id": "no-payload"}']
    for m in range(malformed):
        task = TASKS[m % len(TASKS)]
        lines[task].insert(int(rng.integers(len(lines[task]) + 1)), broken[m % len(broken)])
    for task in TASKS:
        atomic_write_text(out / f"{task}.jsonl", "\n".join(lines[task]) + "\n")
    return {t: len(lines[t]) for t in TASKS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m train.stage1.synthetic",
                                description="generate a synthetic stage-1 dataset")
    p.add_argument("--out", required=True, help="data directory to write")
    p.add_argument("--samples", type=int, default=2000, help="records over all tasks (default 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shape", default="tiny", help="model shape whose asset format and image sizes to follow")
    p.add_argument("--codebook-sizes", default=None, help="SS,SHAPE,TEX codebook vocab sizes (default: the shape's)")
    p.add_argument("--asset-lengths", default=None, help="SS,SHAPE,TEX codes per asset, or any (default: the shape's)")
    p.add_argument("--malformed", type=int, default=0, help="extra broken lines to include (for tests)")
    args = p.parse_args(argv)
    if args.samples < len(TASKS):
        print(f"error: --samples must be at least {len(TASKS)} (one per task)", file=sys.stderr)
        return 2
    try:
        codebooks = get_shape(args.shape).codebooks
        if args.codebook_sizes:
            ss, shape, tex = parse_sizes(args.codebook_sizes)
            codebooks = dataclasses.replace(codebooks, ss=ss, shape=shape, tex=tex)
        if args.asset_lengths:
            codebooks = dataclasses.replace(codebooks, lengths=parse_lengths(args.asset_lengths))
        counts = generate_synthetic(args.out, args.samples, args.seed, args.malformed, args.shape, codebooks)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {sum(counts.values())} records to {args.out}: " + ", ".join(f"{t}={n}" for t, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
