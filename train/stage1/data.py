"""Stage-1 data: per-task jsonl manifests, a deterministic mixture, packing in loader workers.

Format (a data directory)
-------------------------
    gen_img.jsonl      {"id", "image": "images/<id>.png", "tokens3d": "tokens3d/<id>.npz"}   image -> 3D
    gen_txt.jsonl      {"id", "text", "tokens3d"}                                            text  -> 3D
    und.jsonl          {"id", "tokens3d", "text"}                                            3D    -> text
    replay_img.jsonl   {"id", "image", "text"}                                               image -> caption
    replay_text.jsonl  {"id", "text"}                                                        plain text
Paths are relative to the data directory. A `tokens3d` file is an .npz with three 1-D integer
arrays `ss`, `shape`, `tex`: ONE 3D asset, its codes in the three codebooks. For the Qwen3.5
shapes an asset is 1,728 SS + 2,048 shape + 2,048 tex codes (5,824 tokens), each code in
[0, 8192); both the lengths and the codebook sizes are per model shape and per job
(train.common.codebooks.CodebookConfig; a length may be "any").

Malformed records (bad JSON, missing keys, a missing/corrupt image or token file, a decompression
bomb, an asset of the wrong length, codes out of range) are skipped, counted and reported as
`file:line: reason`; when they exceed `max_bad_fraction` of the records seen, the run stops with
a DataError.

Determinism and resume
----------------------
Batch k of rank r is a function of (seed, r, k) and the carry-over buffer its chain's previous
batch left: its new documents are drawn (task by mixture weight, then a record of that task, with
replacement) from an RNG seeded with (seed, r, k) and packed after the buffer's
(train.common.packing.CarryPacker: whole documents; one without room waits in the buffer and opens
the chain's next batch, so every drawn document is trained exactly once). Batch k belongs to chain
k % streams (streams: the run's loader workers at its start); a worker builds whole chains, so
workers build batches in parallel (the DataLoader returns them in k order) and each buffer stays
in one process. The data position is the next k and each chain's buffer, as references to its
records (task, manifest line, piece): a resume tokenizes them again, bitwise the same.

Tokenization is train.stage1.tokenizer: the checkpoint's own tokenizer and image processor, or
the byte stand-in for random-init shapes. An image, with the vision tower on, is
`<vision_start> <image_pad> x n <vision_end>` with the ids of the model's config: the
placeholders are replaced by the vision tower's outputs for the image's `pixel_values`, which
travel with the document through the packer. The byte stand-in without a vision tower makes an
image 16 colour tokens; a checkpoint tokenizer without one cannot tokenize images, so a mixture
that weights the image tasks (the default one does) is refused, never silently narrowed.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import zipfile
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from train.common.codebooks import CODEBOOK_NAMES, CodebookConfig
from train.common.packing import CarryPacker, Document, ImageInput, collate, slice_document
from train.common.vision_budget import BudgetGate, VisionBudget
from train.stage1.tasks import (  # noqa: F401 - re-exported: the trainer and the tests name them here
    IMAGE_TASKS,
    REFERENCE_COUNTS,
    REQUIRED_KEYS,
    TASKS,
    DataError,
    check_data_dir,
    check_weights,
    image_tasks_weighted,
)
from train.stage1.tokenizer import Stage1Tokenizer
from train.stage1.vision import BadImage

# An .npz member above this (uncompressed) is refused before it is read: a 5,824-code asset is
# ~23 KB as int32, so this is generous for any asset and small against a loader's memory.
MAX_NPZ_MEMBER_BYTES = 64 * 1024 * 1024


class MalformedRecord(ValueError):
    pass


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
        if key in rec and not isinstance(rec[key], str):  # a key this task does not read, of the wrong type
            raise MalformedRecord(f"{key!r} must be a string, got {type(rec[key]).__name__}")
    for key, value in rec.items():
        if isinstance(value, str):
            try:  # JSON's \ud800 escape: a lone surrogate no tokenizer or file system takes
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise MalformedRecord(f"{key!r} holds a lone surrogate (U+{ord(value[exc.start]):04X} at "
                                      f"character {exc.start + 1})") from None
    for key in ("image", "tokens3d"):
        if key in rec and "\0" in rec[key]:
            raise MalformedRecord(f"{key!r} holds a NUL character (no file has that name)")
        if key in rec and (os.path.isabs(rec[key]) or ".." in Path(rec[key]).parts):
            raise MalformedRecord(f"{key!r} must be a path inside the data directory")


MAX_RECORD_DEPTH = 64  # a record is flat (a few keys of strings); its nesting is bounded whatever the parser allows


def _depth(text: str) -> int:
    """The deepest nesting of [ and { in a JSON text (outside strings). Called only for lines with
    more brackets than MAX_RECORD_DEPTH, so its Python loop never runs over ordinary records."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in text:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def load_manifests(root: str | os.PathLike[str], tasks: Sequence[str] = TASKS) -> Manifest:
    root = check_data_dir(root)
    man = Manifest(root)
    for task in tasks:
        path = root / f"{task}.jsonl"
        man.records[task] = []
        if not path.exists():
            continue
        if not path.is_file():
            raise DataError(f"{path} is not a file")
        with open(path, "rb") as f:
            for line_no, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                man.total_lines += 1
                try:
                    try:  # strict: a byte that is not UTF-8 is a malformed record, never U+FFFD trained on
                        line = raw.decode("utf-8")
                    except UnicodeDecodeError as exc:
                        raise MalformedRecord(f"not UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})") from None
                    if raw.count(b"[") + raw.count(b"{") > MAX_RECORD_DEPTH and _depth(line) > MAX_RECORD_DEPTH:
                        # bounded here, not by the interpreter's recursion limit (torch's compiler raises it)
                        raise MalformedRecord(f"invalid JSON (nested too deeply: more than {MAX_RECORD_DEPTH} levels)")
                    try:
                        rec = json.loads(line)
                    except json.JSONDecodeError as exc:
                        raise MalformedRecord(f"invalid JSON ({exc.msg})") from None
                    except RecursionError:  # [[[[...]]]] thousands deep: the parser's stack, not a record
                        raise MalformedRecord("invalid JSON (nested too deeply)") from None
                    _check_record(task, rec)
                except MalformedRecord as exc:
                    man.bad.append(f"{path}:{line_no}: {exc}")
                    continue
                man.records[task].append((line_no, rec))
    return man


def load_asset(path: Path, codebooks: CodebookConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (ss, shape, tex) codes of one 3D asset file; MalformedRecord (one line) if unusable."""
    try:
        loaded = np.load(path, allow_pickle=False)  # a plain .npy loads as an array: not an asset
        if not isinstance(loaded, np.lib.npyio.NpzFile):
            raise MalformedRecord(f"3D token file {path} is not an .npz archive")
        with loaded as z:
            missing = [k for k in CODEBOOK_NAMES if k not in z.files]
            if missing:
                raise MalformedRecord(f"3D token file {path} lacks array(s) {', '.join(missing)}")
            for k in CODEBOOK_NAMES:
                size = z.zip.getinfo(f"{k}.npy").file_size
                if size > MAX_NPZ_MEMBER_BYTES:
                    raise MalformedRecord(f"3D token file {path}: {k} is {size} bytes uncompressed, above "
                                          f"{MAX_NPZ_MEMBER_BYTES}")
                _check_npy_header(path, k, z.zip, size)
            arrays = {k: np.asarray(z[k]) for k in CODEBOOK_NAMES}
    except MalformedRecord:
        raise
    except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        raise MalformedRecord(f"unreadable 3D token file {path} ({type(exc).__name__})") from None
    try:
        codebooks.check_asset(arrays)
    except ValueError as exc:
        raise MalformedRecord(f"{path}: {exc}") from None
    return arrays["ss"], arrays["shape"], arrays["tex"]


def _check_npy_header(path: Path, name: str, archive: zipfile.ZipFile, size: int) -> None:
    """MalformedRecord when member `name`'s .npy header claims more data than the member holds: numpy
    allocates what the header says before reading (10^11 int64 entries: 745 GiB)."""
    with archive.open(f"{name}.npy") as member:
        version = np.lib.format.read_magic(member)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(member, max_header_size=10000)
    claimed = math.prod(shape) * dtype.itemsize
    if claimed > size:
        raise MalformedRecord(f"3D token file {path}: {name}'s header claims {math.prod(shape)} entries "
                              f"({claimed} bytes), the file holds {size}")


def data_path(root: Path, rec: dict[str, Any], key: str) -> Path:
    """The file a record's `key` names, after following symlinks: MalformedRecord when a link
    loops or leads out of the data directory (a manifest may only read the data it ships)."""
    path = root / rec[key]
    try:
        real = path.resolve()
    except (RuntimeError, OSError) as exc:  # RuntimeError: Python < 3.13's "Symlink loop"
        raise MalformedRecord(f"{key} {rec[key]!r}: {path} is a symlink loop ({exc})") from None
    if not real.is_relative_to(root.resolve()):
        raise MalformedRecord(f"{key} {rec[key]!r}: {path} is a symlink out of the data directory (to {real})")
    if real.exists() and not real.is_file():  # a FIFO would block the loader forever, a directory is no file
        raise MalformedRecord(f"{key} {rec[key]!r}: {path} is not a regular file")
    return path


def tokenize_record(tok: Stage1Tokenizer, root: Path, task: str, rec: dict[str, Any]) -> Document:
    """One document (tokens, task, images); MalformedRecord if a referenced file is missing or bad."""
    head = [*tok.bos_ids, tok.task_token(task)]
    images: list[ImageInput] = []
    ids = tok.vision_ids

    def image() -> list[int]:
        path = data_path(root, rec, "image")
        try:
            if tok.encoder is None:
                return [ids["vision_start_token_id"], *tok.image_standin(path), ids["vision_end_token_id"]]
            img = tok.encoder(path)
        except BadImage as exc:
            raise MalformedRecord(str(exc)) from None
        images.append(dataclasses.replace(img, start=len(head) + 1))
        return [ids["vision_start_token_id"], *[ids["image_token_id"]] * img.n_tokens, ids["vision_end_token_id"]]

    def codes() -> list[int]:
        return tok.codes3d(*load_asset(data_path(root, rec, "tokens3d"), tok.codebooks))

    # The image, when there is one, comes first in the body: its span starts after the head.
    body = {
        "gen_img": lambda: image() + codes(),
        "gen_txt": lambda: tok.text(rec["text"]) + codes(),
        "und": lambda: codes() + tok.text(rec["text"]),
        "replay_img": lambda: image() + tok.text(rec["text"]),
        "replay_text": lambda: tok.text(rec["text"]),
    }[task]()
    return Document(head + body + [tok.eos_id], TASKS.index(task), images)


# ---------------------------------------------------------------------------------------------
# mixture + packing


def normalized_weights(weights: dict[str, float] | None, man: Manifest, images: bool = True) -> dict[str, float]:
    """Mixture weights over the tasks that have data; a weighted task with no records is an error.

    ``images``: the tokenizer can tokenize images. If not, the default mixture leaves the image
    tasks out and explicit weight on them is an error.
    """
    weights = dict(REFERENCE_COUNTS if weights is None else weights)
    check_weights(weights)
    if not images:  # never dropped silently: the default mixture holds them too
        weighted = image_tasks_weighted(weights)
        if weighted:
            raise DataError(f"task(s) {', '.join(weighted)} need images, and this model has no vision tower to "
                            "read them with its checkpoint's tokenizer: use --vision on (a checkpoint with a vision "
                            "tower), or --weights without them")
    for task, w in weights.items():
        if w > 0 and not man.records.get(task):
            raise DataError(f"task {task} has weight {w} but {man.root / (task + '.jsonl')} has no valid records")
    total = sum(weights.values())
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
    row_len: int = 512
    batch_rows: int = 4
    seed: int = 0
    weights: dict[str, float] | None = None
    max_bad_fraction: float = 0.01
    num_workers: int = 1
    prefetch_factor: int = 4
    packing: str = "rows"  # rows: batch_rows rows of row_len; flat: one stream of batch_rows*row_len (packing.py)
    vision_budget: VisionBudget | None = None  # images and vision tokens a batch may hold (None: unbounded)
    max_segments: int | None = None  # segments (documents + padding) a varlen batch may hold (gdn_guard.max_segments)


# Documents drawn in a row that the vision budget turned away (their images alone exceed it)
# before the batch closes (its rest padded): a mixture of such images only would draw forever.
MAX_BUDGET_WAITS = 64


def image_tokens(tok: Stage1Tokenizer, root: Path, rec: dict[str, Any]) -> int:
    """Vision tokens of a record's image, from its header (MalformedRecord for a bad image)."""
    try:
        return tok.encoder.tokens_for(data_path(root, rec, "image"))
    except BadImage as exc:
        raise MalformedRecord(str(exc)) from None


CarryRef = tuple[str, int, "tuple[int, int] | None"]  # (task, manifest line, span of a piece or None)


def carry_ref(doc: Document) -> CarryRef:
    """How the data state names a carried document: its record, and the piece of it."""
    task, line_no = doc.source
    return (task, line_no, None if doc.span is None else (int(doc.span[0]), int(doc.span[1])))


def build_batch(
    sampler: MixtureSampler, tok: Stage1Tokenizer, cfg: DataConfig, batch_index: int,
    carried: Sequence[Document] = (),
) -> dict[str, Any]:
    """Batch ``batch_index``: ``carried`` (the buffer the stream's previous batch left) first, then
    documents drawn for this index (packing.CarryPacker); collated, plus bookkeeping. ``carry_docs``:
    the buffer this batch leaves (the next batch of the stream opens with them); ``carry``: the
    same as the references the data state saves."""
    bad: list[str] = []
    over_budget: list[str] = []  # documents whose images alone exceed the vision budget (dropped)
    docs_used = 0
    budget = cfg.vision_budget
    gate = BudgetGate(budget) if budget is not None else None

    def alone_over(n_images: int, n_tokens: int) -> bool:
        return budget is not None and n_images > 0 and (n_images > budget.images or n_tokens > budget.tokens)

    def documents() -> Iterator[Document]:
        nonlocal docs_used
        turned_away = 0  # documents in a row whose images alone exceed the budget
        for task, line_no, rec in sampler.draws(batch_index):
            where = f"{sampler.man.root / (task + '.jsonl')}:{line_no}"
            try:
                counted = 0
                if budget is not None and task in IMAGE_TASKS:  # one image per document; its header says its
                    counted = image_tokens(tok, sampler.man.root, rec)  # size, so a dropped one is never decoded
                doc = None
                if not alone_over(1 if counted else 0, counted):
                    doc = tokenize_record(tok, sampler.man.root, task, rec)
                    if any(img.n_tokens + 2 > cfg.row_len for img in doc.images):
                        raise MalformedRecord(f"image of {doc.images[0].n_tokens} tokens does not fit a "
                                              f"{cfg.row_len}-token row")
                    counted = sum(img.n_tokens for img in doc.images)  # the header may mislead: the truth
                    if alone_over(len(doc.images), counted):
                        doc = None
            except MalformedRecord as exc:
                bad.append(f"{where}: {exc}")
                if len(bad) > 1000 and len(bad) > 10 * docs_used:
                    raise DataError(
                        f"batch {batch_index}: {len(bad)} malformed records against {docs_used} good; last: {bad[-1]}"
                    ) from None
                continue
            if doc is None:
                over_budget.append(f"{where}: its image(s) of {counted} vision tokens exceed the step's vision "
                                   f"budget ({budget.images} images, {budget.tokens} tokens)")
                turned_away += 1
                if turned_away >= MAX_BUDGET_WAITS:
                    return  # the batch closes here, its rest padded
                continue
            turned_away = 0
            docs_used += 1
            doc.source = (task, line_no)
            yield doc

    def admit(doc: Document) -> bool:  # a document the budget cannot take now waits in the buffer
        return gate is None or gate.admit(len(doc.images), sum(img.n_tokens for img in doc.images)) == "ok"

    # Whole documents; one that has no room (or no budget) left waits in the carry-over buffer and
    # opens the stream's next batch (packing.py: every drawn document trained once, the shares kept).
    packer = CarryPacker(cfg.packing, cfg.row_len, cfg.batch_rows, pad_id=tok.pad_id, long_doc="split",
                         max_segments=cfg.max_segments)
    got = packer.batch(carried, documents(), admit=admit)
    rows = got.rows
    batch: dict[str, Any] = collate(rows)
    batch.update(
        batch_index=batch_index, n_docs=got.drawn, docs_placed=len(got.placed), bad_records=bad,
        over_budget=over_budget, budget_waits=gate.waited if gate is not None else 0,
        vision_tokens=sum(img.n_tokens for r in rows for img in r.images),
        packing_efficiency=sum(r.n_real_tokens for r in rows) / sum(r.input_ids.numel() for r in rows),
        placed=[carry_ref(d) for d in got.placed], carry=[carry_ref(d) for d in got.carry], carry_docs=got.carry,
    )
    return batch


def carried_documents(refs: Sequence[CarryRef], man: Manifest, tok: Stage1Tokenizer,
                      report: Any = print) -> list[Document]:
    """The documents a saved carry-over buffer names, tokenized again (bitwise the ones carried:
    tokenization is a pure function of the record). One the data no longer has is named and left
    out (a resume with --allow-data-change)."""
    lines = {task: dict(recs) for task, recs in man.records.items()}
    docs = []
    for task, line_no, span in refs:
        rec = lines.get(task, {}).get(line_no)
        try:
            if rec is None:
                raise MalformedRecord("no such record in this data")
            doc = tokenize_record(tok, man.root, task, rec)
        except MalformedRecord as exc:
            report(f"carried document {man.root / (task + '.jsonl')}:{line_no} left out: {exc}")
            continue
        doc.source = (task, line_no)
        docs.append(doc if span is None else slice_document(doc, int(span[0]), int(span[1])))
    return docs


def loader_workers(streams: int, requested: int) -> int:
    """Loader workers for ``streams`` carry chains: batch k belongs to chain k % streams, and every
    batch of a chain must be built by one worker (its buffer lives there), so the worker count
    divides the chain count: the largest divisor not above ``requested`` (0: the main process)."""
    if requested <= 0:
        return 0
    return max(w for w in range(1, min(streams, requested) + 1) if streams % w == 0)


class PackedBatches(IterableDataset):
    """Infinite stream of packed batches start, start+1, ... split over loader workers.

    Batch k belongs to carry chain ``k % streams``: it opens with the buffer the chain's previous
    batch (k - streams) left. A worker builds whole chains (``loader_workers``), so each buffer
    stays in one process; ``carry`` (chain -> references) is the saved state at ``start_batch``."""

    def __init__(self, cfg: DataConfig, tok: Stage1Tokenizer, rank: int, start_batch: int = 0,
                 streams: int | None = None, carry: dict[int, list[CarryRef]] | None = None,
                 report: Any = print) -> None:
        super().__init__()
        self.cfg = cfg
        self.rank = rank
        self.start_batch = start_batch
        self.streams = max(1, cfg.num_workers) if streams is None else streams
        self.carry = {int(s): list(refs) for s, refs in (carry or {}).items()}
        self.report = report
        self.tok = tok
        self.man = load_manifests(cfg.data_dir)
        check_bad_fraction(len(self.man.bad), self.man.total_lines, cfg.max_bad_fraction, self.man.bad)
        weights = normalized_weights(cfg.weights, self.man, images=tok.can_tokenize_images)
        self.sampler = MixtureSampler(self.man, weights, cfg.seed, rank)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        info = get_worker_info()
        worker, n_workers = (0, 1) if info is None else (info.id, info.num_workers)
        if self.streams % n_workers:
            raise ValueError(f"{n_workers} loader workers cannot share {self.streams} carry chains (loader_workers)")
        buffers: dict[int, list[Document]] = {}
        k = self.start_batch + worker
        while True:
            chain = k % self.streams
            try:
                if chain not in buffers:
                    buffers[chain] = carried_documents(self.carry.get(chain, []), self.man, self.tok, self.report)
                batch = build_batch(self.sampler, self.tok, self.cfg, k, buffers[chain])
            except DataError as exc:
                # Handed over as data: the DataLoader would re-raise it with the worker's traceback.
                yield {"data_error": str(exc), "batch_index": k}
                return
            buffers[chain] = batch.pop("carry_docs")  # stays in this process; the state keeps `carry`
            batch["chain"] = chain
            yield batch
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

    def __init__(self, cfg: DataConfig, tok: Stage1Tokenizer, rank: int = 0, start_batch: int = 0,
                 report=print, state: dict[str, Any] | None = None) -> None:
        """``state``: a saved :meth:`state_dict` to continue from (its ``next_batch`` and carry-over
        buffers; ``start_batch`` is then ignored)."""
        self.cfg = cfg
        state = state or {"next_batch": start_batch}
        start_batch = int(state["next_batch"])
        # Carry chains: the loader workers of the run's start, kept on resume (a checkpoint from
        # before the buffer existed has none).
        streams = int(state.get("streams", max(1, cfg.num_workers)))
        workers = loader_workers(streams, cfg.num_workers)
        if workers != cfg.num_workers:
            report(f"# data: {workers} loader worker(s), not {cfg.num_workers}: the run's batches are {streams} "
                   "carry chains, and each worker builds whole chains")
        self.dataset = PackedBatches(cfg, tok, rank, start_batch, streams=streams, carry=state.get("carry"),
                                     report=report)
        self.carry = dict(self.dataset.carry)  # chain -> the buffer after its last batch handed out
        self.report = report
        self.next_batch = start_batch
        self.docs_seen = 0
        self.bad_seen = 0
        self.over_budget = 0  # documents dropped because their images alone exceed the vision budget
        self._reported: set[str] = set()  # each bad record is reported once, counted every time
        for line in self.dataset.man.bad:
            report(f"malformed record: {line}")
        loader_kwargs: dict[str, Any] = {}
        if workers > 0:
            loader_kwargs = dict(prefetch_factor=cfg.prefetch_factor, persistent_workers=False)
        self.loader = DataLoader(
            self.dataset, batch_size=None, num_workers=workers, collate_fn=_passthrough, **loader_kwargs
        )
        self._it: Iterator[dict[str, Any]] | None = None

    @property
    def manifest(self) -> Manifest:
        return self.dataset.man

    @property
    def tokenizer(self) -> Stage1Tokenizer:
        return self.dataset.tok

    def __next__(self) -> dict[str, Any]:
        if self._it is None:
            self._it = iter(self.loader)
        batch = next(self._it)
        if "data_error" in batch:
            raise DataError(batch["data_error"])
        assert batch["batch_index"] == self.next_batch, (batch["batch_index"], self.next_batch)
        self.next_batch += 1
        self.carry[batch["chain"]] = batch["carry"]
        self.docs_seen += batch["n_docs"] + len(batch["bad_records"])
        self.bad_seen += len(batch["bad_records"])
        for line in batch["over_budget"]:  # not malformed: counted apart, never toward --max-bad-fraction
            self.over_budget += 1
            if line not in self._reported:
                self._reported.add(line)
                self.report(f"dropped (over the vision budget): {line}")
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
                "bad_seen": self.bad_seen, "streams": self.dataset.streams,
                "carry": {s: [list(r) for r in refs] for s, refs in sorted(self.carry.items())}}

    def close(self) -> None:
        self._it = None  # drops the iterator; its workers shut down
