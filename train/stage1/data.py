"""Stage-1 data: per-task jsonl manifests, a deterministic mixture, packing in loader workers.

Format (a data directory)
-------------------------
    gen_img.jsonl      {"id", "image": "images/<id>.png", "tokens3d": "tokens3d/<id>.npz"}   image -> 3D
    gen_txt.jsonl      {"id", "text", "tokens3d"}                                            text  -> 3D
    und.jsonl          {"id", "tokens3d", "text"}                                            3D    -> text
    replay_img.jsonl   {"id", "image", "text"}                                               image -> caption
    replay_text.jsonl  {"id", "text"}                                                        plain text
Paths are relative to the data directory. A `tokens3d` file is an .npz with three 1-D integer
arrays `ss`, `shape`, `tex`: the codes of the three 3D codebooks, each below its codebook size
(full model 1728/2048/2048; the tiny preset scales them down, see train.stage1.model.PRESETS).

Malformed records (bad JSON, missing keys, missing/corrupt image or token file, codes out of
range) are skipped, counted and reported as `file:line: reason`; when they exceed
`max_bad_fraction` of the records seen, the run stops with a DataError.

Determinism and resume
----------------------
Batch k of rank r is a pure function of (seed, r, k): its documents are drawn (task by mixture
weight, then a record of that task, with replacement) from an RNG seeded with (seed, r, k) and
packed into `batch_rows` rows of `row_len` tokens. So loader workers build batches in parallel
(worker w builds k = w, w+W, ...; the DataLoader returns them in k order), and the whole data
position is the next k.

Tokenization of this CPU path is a deterministic stand-in needing no download: text is UTF-8
bytes and 3D codes go through train.common.codebooks. An image, with the vision tower on
(`DataConfig.vision`, the model's Qwen3_5ForConditionalGeneration), is
`<img> <|image_pad|> x n </img>`: the placeholders are replaced by the vision tower's outputs for
the image's `pixel_values` (train.stage1.vision), which travel with the document through the
packer. Without it (a text-only model) an image is 16 stand-in tokens: its 4x4 mean colours, 4
levels per channel.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from train.common.codebooks import CodebookVocab
from train.common.packing import Document, ImageInput, Packer, collate

if TYPE_CHECKING:
    from train.stage1.vision import ImagePreprocessor

TASKS: tuple[str, ...] = ("gen_img", "gen_txt", "und", "replay_img", "replay_text")
REQUIRED_KEYS: dict[str, tuple[str, ...]] = {
    "gen_img": ("id", "image", "tokens3d"),
    "gen_txt": ("id", "text", "tokens3d"),
    "und": ("id", "tokens3d", "text"),
    "replay_img": ("id", "image", "text"),
    "replay_text": ("id", "text"),
}
# Sample counts of the reference run (1.35M samples), used as default mixture weights.
REFERENCE_COUNTS: dict[str, int] = {
    "gen_img": 294_000, "gen_txt": 293_000, "und": 293_000, "replay_img": 320_000, "replay_text": 150_000,
}
# Codebook sizes of the full model; the tiny preset scales them down (train.stage1.model.PRESETS).
CODEBOOK_SIZES: dict[str, int] = {"ss": 1728, "shape": 2048, "tex": 2048}
IMAGE_GRID = 4  # image stand-in: IMAGE_GRID x IMAGE_GRID cells
IMAGE_LEVELS = 4  # per channel -> 64 image tokens


class DataError(RuntimeError):
    """Data that cannot be trained on; message is one line saying what and where."""


class MalformedRecord(ValueError):
    pass


# ---------------------------------------------------------------------------------------------
# tokenizer


class TinyTokenizer:
    """Byte-level text + image stand-in in the base vocabulary; task/3D tokens from the codebook vocab.

    Base-vocabulary ids used: [<pad> <bos> <eos> <img> </img> <|image_pad|> <|video_pad|>, 1 unused]
    [256 bytes] [64 image stand-ins]. `<img>`/`</img>` are the vision start/end tokens and
    `<|image_pad|>` the image placeholder of the vision model's config
    (train.stage1.model.multimodal_config). Task tokens, 3D boundaries and the SS/shape/tex
    codebook tokens come from `vocab` (train.common.codebooks.CodebookVocab), so the ids match the
    model's extended embeddings.

    `vision`: an ImagePreprocessor (train.stage1.vision) makes images vision-tower inputs; None
    keeps the 16-token colour stand-in.
    """

    SPECIALS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>", "<img>", "</img>", "<|image_pad|>", "<|video_pad|>")
    BYTE_BASE = 8
    IMAGE_BASE = BYTE_BASE + 256

    def __init__(self, vocab: CodebookVocab, vision: ImagePreprocessor | None = None) -> None:
        needed = self.IMAGE_BASE + IMAGE_LEVELS**3
        if vocab.base_vocab < needed:
            raise ValueError(f"base vocab {vocab.base_vocab} too small for the byte tokenizer (needs {needed})")
        self.vocab = vocab
        self.vision = vision

    @classmethod
    def vision_token_ids(cls) -> dict[str, int]:
        """The ids the vision model's config names (image/video placeholder, vision start/end)."""
        return {"image": cls.SPECIALS.index("<|image_pad|>"), "video": cls.SPECIALS.index("<|video_pad|>"),
                "vision_start": cls.SPECIALS.index("<img>"), "vision_end": cls.SPECIALS.index("</img>")}

    @property
    def vocab_size(self) -> int:
        return self.vocab.padded_vocab

    @property
    def codebook_sizes(self) -> dict[str, int]:
        return dict(self.vocab.sizes)

    def special(self, name: str) -> int:
        if name in self.SPECIALS:
            return self.SPECIALS.index(name)
        return self.vocab.special_ids[name]

    def task_token(self, task: str) -> int:
        return self.vocab.special_ids[f"<|task_{task}|>"]

    @property
    def pad_id(self) -> int:
        return 0

    def text(self, s: str) -> list[int]:
        return [self.BYTE_BASE + b for b in s.encode("utf-8")]

    def image(self, path: Path) -> list[int]:
        from PIL import Image

        with Image.open(path) as im:
            im.load()
            cells = np.asarray(im.convert("RGB").resize((IMAGE_GRID, IMAGE_GRID), Image.BOX), dtype=np.int64)
        q = cells * IMAGE_LEVELS // 256  # [g, g, 3] in 0..LEVELS-1
        codes = (q[..., 0] * IMAGE_LEVELS + q[..., 1]) * IMAGE_LEVELS + q[..., 2]
        return [self.IMAGE_BASE + int(c) for c in codes.reshape(-1)]

    def codes3d(self, ss: Sequence[int], shape: Sequence[int], tex: Sequence[int]) -> list[int]:
        """<3d_start> <ss_start> ss.. <ss_end> <shape_start> .. <tex_end> <3d_end>."""
        return self.vocab.encode_3d(list(ss), list(shape), list(tex))


def tokenizer_for_preset(preset: str, vision: bool = False) -> TinyTokenizer:
    """The preset's tokenizer; `vision`: images become inputs of the preset's vision tower."""
    from train.stage1.model import get_preset

    cfg = get_preset(preset)
    preprocess = None
    if vision:
        from train.stage1.vision import ImagePreprocessor

        if cfg.vision is None:
            raise ValueError(f"preset {preset!r} has no vision tower")
        preprocess = ImagePreprocessor(cfg.vision)
    return TinyTokenizer(CodebookVocab(cfg.base_vocab, cfg.codebooks), preprocess)


# ---------------------------------------------------------------------------------------------
# manifests


@dataclass
class Manifest:
    """Valid records per task (with their line numbers) and the malformed lines found."""

    root: Path
    records: dict[str, list[tuple[int, dict[str, Any]]]] = field(default_factory=dict)
    bad: list[str] = field(default_factory=list)  # "file:line: reason"
    total_lines: int = 0


def _check_record(task: str, rec: Any) -> None:
    if not isinstance(rec, dict):
        raise MalformedRecord("not a JSON object")
    missing = [k for k in REQUIRED_KEYS[task] if k not in rec]
    if missing:
        raise MalformedRecord(f"missing key(s) {', '.join(missing)}")
    for key in ("image", "tokens3d", "text"):
        if key in REQUIRED_KEYS[task] and not (isinstance(rec[key], str) and rec[key]):
            raise MalformedRecord(f"{key!r} must be a non-empty string")
    for key in ("image", "tokens3d"):
        if key in rec and (os.path.isabs(rec[key]) or ".." in Path(rec[key]).parts):
            raise MalformedRecord(f"{key!r} must be a path inside the data directory")


def load_manifests(root: str | os.PathLike[str], tasks: Sequence[str] = TASKS) -> Manifest:
    root = Path(root)
    man = Manifest(root)
    for task in tasks:
        path = root / f"{task}.jsonl"
        man.records[task] = []
        if not path.exists():
            continue
        with open(path, encoding="utf-8", errors="replace") as f:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue
                man.total_lines += 1
                try:
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise MalformedRecord(f"invalid JSON ({exc.msg})") from None
                    _check_record(task, rec)
                except MalformedRecord as exc:
                    man.bad.append(f"{path}:{line_no}: {exc}")
                    continue
                man.records[task].append((line_no, rec))
    return man


def _load_codes(path: Path, sizes: dict[str, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    try:
        with np.load(path) as z:
            arrays = tuple(np.asarray(z[k]) for k in CODEBOOK_SIZES)
    except (OSError, ValueError, KeyError, EOFError) as exc:
        raise MalformedRecord(f"unreadable 3D token file {path} ({type(exc).__name__}: {exc})") from None
    for (name, size), arr in zip(sizes.items(), arrays, strict=True):
        if arr.ndim != 1 or arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
            raise MalformedRecord(f"{path}: {name} codes must be a non-empty 1-D integer array")
        if arr.min() < 0 or arr.max() >= size:
            raise MalformedRecord(f"{path}: {name} codes out of range [0, {size})")
    return arrays  # type: ignore[return-value]


def tokenize_record(tok: TinyTokenizer, root: Path, task: str, rec: dict[str, Any]) -> Document:
    """One document (tokens, task, images); MalformedRecord if a referenced file is missing or bad."""
    head = [tok.special("<bos>"), tok.task_token(task)]
    images: list[ImageInput] = []

    def image() -> list[int]:
        path = root / rec["image"]
        try:
            if tok.vision is None:
                return [tok.special("<img>"), *tok.image(path), tok.special("</img>")]
            img = tok.vision(path)
        except (OSError, ValueError, SyntaxError) as exc:
            raise MalformedRecord(f"unreadable image {path} ({type(exc).__name__})") from None
        images.append(dataclasses.replace(img, start=len(head) + 1))
        return [tok.special("<img>"), *[tok.special("<|image_pad|>")] * img.n_tokens, tok.special("</img>")]

    def codes() -> list[int]:
        return tok.codes3d(*_load_codes(root / rec["tokens3d"], tok.codebook_sizes))

    # The image, when there is one, comes first in the body: its span starts after the head.
    body = {
        "gen_img": lambda: image() + codes(),
        "gen_txt": lambda: tok.text(rec["text"]) + codes(),
        "und": lambda: codes() + tok.text(rec["text"]),
        "replay_img": lambda: image() + tok.text(rec["text"]),
        "replay_text": lambda: tok.text(rec["text"]),
    }[task]()
    return Document(head + body + [tok.special("<eos>")], TASKS.index(task), images)


# ---------------------------------------------------------------------------------------------
# mixture + packing


def normalized_weights(weights: dict[str, float] | None, man: Manifest) -> dict[str, float]:
    """Mixture weights over the tasks that have data; a weighted task with no records is an error."""
    weights = dict(REFERENCE_COUNTS if weights is None else weights)
    unknown = sorted(set(weights) - set(TASKS))
    if unknown:
        raise DataError(f"unknown task(s) in mixture weights: {', '.join(unknown)}; known: {', '.join(TASKS)}")
    if any(w < 0 or not math.isfinite(w) for w in weights.values()):
        raise DataError(f"mixture weights must be finite and >= 0, got {weights}")
    for task, w in weights.items():
        if w > 0 and not man.records.get(task):
            raise DataError(f"task {task} has weight {w} but {man.root / (task + '.jsonl')} has no valid records")
    total = sum(weights.values())
    if total <= 0:
        raise DataError("mixture weights sum to 0; give at least one task a positive weight")
    return {t: weights[t] / total for t in TASKS if weights.get(t, 0) > 0}


class MixtureSampler:
    """Documents of batch k for rank r, drawn from an RNG seeded by (seed, r, k)."""

    def __init__(self, man: Manifest, weights: dict[str, float], seed: int, rank: int) -> None:
        self.man = man
        self.tasks = list(weights)
        self.probs = np.array([weights[t] for t in self.tasks])
        self.seed = seed
        self.rank = rank

    def draws(self, batch_index: int) -> Iterator[tuple[str, int, dict[str, Any]]]:
        """Infinite (task, line_no, record) stream of batch `batch_index`."""
        rng = np.random.default_rng([self.seed, self.rank, batch_index])
        while True:
            task = self.tasks[int(rng.choice(len(self.tasks), p=self.probs))]
            line_no, rec = self.man.records[task][int(rng.integers(len(self.man.records[task])))]
            yield task, line_no, rec


@dataclass
class DataConfig:
    data_dir: str
    preset: str = "tiny"  # model preset: its vocab layout and codebook sizes
    row_len: int = 512
    batch_rows: int = 4
    seed: int = 0
    weights: dict[str, float] | None = None
    max_bad_fraction: float = 0.01
    num_workers: int = 1
    prefetch_factor: int = 4
    vision: bool = False  # images as vision-tower inputs (the model is Qwen3_5ForConditionalGeneration)


def build_batch(
    sampler: MixtureSampler, tok: TinyTokenizer, cfg: DataConfig, batch_index: int
) -> dict[str, Any]:
    """Pack documents of batch `batch_index` into cfg.batch_rows rows; collated, plus bookkeeping."""
    bad: list[str] = []
    docs_used = 0

    def documents() -> Iterator[Document]:
        nonlocal docs_used
        for task, line_no, rec in sampler.draws(batch_index):
            try:
                doc = tokenize_record(tok, sampler.man.root, task, rec)
                if any(img.n_tokens + 2 > cfg.row_len for img in doc.images):
                    raise MalformedRecord(f"image of {doc.images[0].n_tokens} tokens does not fit a {cfg.row_len}-token row")
            except MalformedRecord as exc:
                bad.append(f"{sampler.man.root / (task + '.jsonl')}:{line_no}: {exc}")
                if len(bad) > 1000 and len(bad) > 10 * docs_used:
                    raise DataError(
                        f"batch {batch_index}: {len(bad)} malformed records against {docs_used} good; last: {bad[-1]}"
                    ) from None
                continue
            docs_used += 1
            yield doc

    packer = Packer(row_len=cfg.row_len, pad_id=tok.pad_id, long_doc="split")
    rows = []
    for row in packer.pack(documents()):
        rows.append(row)
        if len(rows) == cfg.batch_rows:
            break
    batch: dict[str, Any] = collate(rows)
    batch.update(
        batch_index=batch_index, n_docs=docs_used, bad_records=bad,
        packing_efficiency=sum(r.n_real_tokens for r in rows) / (cfg.row_len * len(rows)),
    )
    return batch


class PackedBatches(IterableDataset):
    """Infinite stream of packed batches start, start+1, ... split over loader workers."""

    def __init__(self, cfg: DataConfig, rank: int, start_batch: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.rank = rank
        self.start_batch = start_batch
        self.tok = tokenizer_for_preset(cfg.preset, vision=cfg.vision)
        self.man = load_manifests(cfg.data_dir)
        check_bad_fraction(len(self.man.bad), self.man.total_lines, cfg.max_bad_fraction, self.man.bad)
        self.sampler = MixtureSampler(self.man, normalized_weights(cfg.weights, self.man), cfg.seed, rank)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, n_workers = (0, 1) if info is None else (info.id, info.num_workers)
        k = self.start_batch + worker
        while True:
            yield build_batch(self.sampler, self.tok, self.cfg, k)
            k += n_workers


def check_bad_fraction(n_bad: int, n_seen: int, limit: float, examples: Sequence[str]) -> None:
    if n_seen and n_bad / n_seen > limit:
        raise DataError(
            f"{n_bad} of {n_seen} records malformed ({100 * n_bad / n_seen:.1f}% > {100 * limit:.1f}% allowed); "
            f"first: {examples[0] if examples else '?'}"
        )


def _passthrough(x: Any) -> Any:
    return x


class Stage1Data:
    """The loader the trainer iterates: batches in order, malformed-record accounting, position."""

    def __init__(self, cfg: DataConfig, rank: int = 0, start_batch: int = 0, report=print) -> None:
        self.cfg = cfg
        self.dataset = PackedBatches(cfg, rank, start_batch)
        self.report = report
        self.next_batch = start_batch
        self.docs_seen = 0
        self.bad_seen = 0
        self._reported: set[str] = set()  # each bad record is reported once, counted every time
        for line in self.dataset.man.bad:
            report(f"malformed record: {line}")
        loader_kwargs: dict[str, Any] = {}
        if cfg.num_workers > 0:
            loader_kwargs = dict(prefetch_factor=cfg.prefetch_factor, persistent_workers=False)
        self.loader = DataLoader(
            self.dataset, batch_size=None, num_workers=cfg.num_workers, collate_fn=_passthrough, **loader_kwargs
        )
        self._it: Iterator[dict[str, Any]] | None = None

    @property
    def manifest(self) -> Manifest:
        return self.dataset.man

    @property
    def tokenizer(self) -> TinyTokenizer:
        return self.dataset.tok

    def __next__(self) -> dict[str, Any]:
        if self._it is None:
            self._it = iter(self.loader)
        batch = next(self._it)
        assert batch["batch_index"] == self.next_batch, (batch["batch_index"], self.next_batch)
        self.next_batch += 1
        self.docs_seen += batch["n_docs"] + len(batch["bad_records"])
        self.bad_seen += len(batch["bad_records"])
        for line in batch["bad_records"]:
            if line not in self._reported:
                self._reported.add(line)
                self.report(f"malformed record: {line}")
        man = self.dataset.man
        check_bad_fraction(
            len(man.bad) + self.bad_seen, man.total_lines + self.docs_seen, self.cfg.max_bad_fraction,
            man.bad + batch["bad_records"],
        )
        return batch

    def __iter__(self) -> Stage1Data:
        return self

    def state_dict(self) -> dict[str, Any]:
        return {"next_batch": self.next_batch, "seed": self.cfg.seed, "docs_seen": self.docs_seen,
                "bad_seen": self.bad_seen}

    def close(self) -> None:
        self._it = None  # drops the iterator; its workers shut down


# ---------------------------------------------------------------------------------------------
# synthetic dataset

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


def _object_codes(
    prim: int, color: int, size: int, rng: np.random.Generator, sizes: dict[str, int]
) -> dict[str, np.ndarray]:
    """3D codes with structure a model can learn: a function of the object, plus 5% noise."""
    n = 6 + 3 * size
    i = np.arange(n)
    ss = (prim * 211 + i * (size + 1) * 13) % sizes["ss"]
    shape = (prim * 331 + (i * i) * 7 + size * 29) % sizes["shape"]
    tex = (color * 251 + i * 5) % sizes["tex"]
    out = {"ss": ss, "shape": shape, "tex": tex}
    for name, arr in out.items():
        noise = rng.random(n) < 0.05
        arr[noise] = rng.integers(0, sizes[name], int(noise.sum()))
    return {k: v.astype(np.int16 if k == "ss" else np.int32) for k, v in out.items()}


def _draw_image(path: Path, prim: int, color: tuple[int, int, int], size: int, rng: np.random.Generator) -> None:
    from PIL import Image, ImageDraw

    side = 32
    bg = tuple(int(c) for c in rng.integers(90, 140, 3))
    im = Image.new("RGB", (side, side), bg)
    d = ImageDraw.Draw(im)
    r = 4 + 3 * size
    cx, cy = side // 2 + int(rng.integers(-3, 4)), side // 2 + int(rng.integers(-3, 4))
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
    out: str | os.PathLike[str], samples: int, seed: int = 0, malformed: int = 0, preset: str = "tiny"
) -> dict[str, int]:
    """Write a small dataset in the stage-1 format; return records written per task.

    3D codes lie within the codebook sizes of model preset `preset`.
    `malformed` extra broken lines are spread over the manifests (for tests and demos of the
    malformed-record accounting).
    """
    from toolkit.fsutil import atomic_write_text

    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    (out / "tokens3d").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    sizes = tokenizer_for_preset(preset).codebook_sizes
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
                _draw_image(out / rec["image"], prim, COLORS[color_names[color]], size, rng)
            if task in ("gen_img", "gen_txt", "und"):
                rec["tokens3d"] = f"tokens3d/{sid}.npz"
                np.savez(out / rec["tokens3d"], **_object_codes(prim, color, size, rng, sizes))
            if task == "gen_txt":
                rec["text"] = f"make {caption}"
            elif task == "und":
                rec["text"] = f"this is {caption}"
            elif task == "replay_img":
                rec["text"] = f"a picture of {caption}"
            elif task == "replay_text":
                rec["text"] = REPLAY_SENTENCES[int(rng.integers(len(REPLAY_SENTENCES)))]
            lines[task].append(json.dumps(rec))
    broken = ['{"id": "broken", ', '["not", "an", "object"]', '{"id": "no-payload"}']
    for m in range(malformed):
        task = TASKS[m % len(TASKS)]
        lines[task].insert(int(rng.integers(len(lines[task]) + 1)), broken[m % len(broken)])
    for task in TASKS:
        atomic_write_text(out / f"{task}.jsonl", "\n".join(lines[task]) + "\n")
    return {t: len(lines[t]) for t in TASKS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.stage1.data", description="generate a synthetic stage-1 dataset")
    p.add_argument("--out", required=True, help="data directory to write")
    p.add_argument("--samples", type=int, default=2000, help="records over all tasks (default 2000)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--preset", default="tiny", help="model preset whose codebook sizes bound the codes")
    p.add_argument("--malformed", type=int, default=0, help="extra broken lines to include (for tests)")
    args = p.parse_args(argv)
    if args.samples < len(TASKS):
        print(f"error: --samples must be at least {len(TASKS)} (one per task)", file=sys.stderr)
        return 2
    try:
        counts = generate_synthetic(args.out, args.samples, args.seed, args.malformed, args.preset)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {sum(counts.values())} records to {args.out}: " + ", ".join(f"{t}={n}" for t, n in counts.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
