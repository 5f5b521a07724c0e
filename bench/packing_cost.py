"""What the batch packers train of what was drawn (CPU; the data pipeline only, no model).

For each batch index, the documents the stage-1 data layer draws for it (``MixtureSampler``,
``tokenize_record``: the real tokenizer layout of the shape, the image processor's placeholder
counts) are packed three ways: the cut-to-fill packers the layouts used before (``cut``: the
document that ends a row is cut there, its tail dropped), the streaming whole-document packers
(``layout_packer``, closing a batch once no row has room for one more 3D asset, as ``build_batch``
did until the carry-over buffer), and the carry packers ``build_batch`` uses now (``CarryPacker``:
a document without room waits in a buffer and opens the next batch, one packer over all batches).

Columns: documents per batch; of the drawn tokens of each kind (documents whose first token
entered the batch: SS, shape, texture codes, captions after an asset or image) the share trained;
batches whose last document lost its tail; useful tokens (non-padding); the largest gap, in
points, between a task's share of the trained documents / trained tokens and the data's (the
weights; the weights x each task's mean document length over its records), with the gap per
task; and the packer's own part of the gaps: trained against the documents the batches looked
at (their draws up to a stopping time, unbiased), which the draws' noise does not blur.

    python bench/packing_cost.py [--batches 1000] [--samples 200] [--data-dir DIR]

``--data-dir``: a stage-1 data set (default: ``generate_synthetic(DIR, samples, shape=...)`` in a
temp dir, ``qwen35-2b``'s 3D format, 448-1024 px images). The images are tokenized once per record.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import replace
from itertools import islice
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from train.common.packing import (  # noqa: E402
    CARRY_CLOSE_BELOW,
    CARRY_DOCS,
    CarryPacker,
    Document,
    Packer,
    layout_packer,
    rows_per_batch,
)

KINDS = ("ss", "shape", "tex", "caption")


def token_kinds(doc: Document, task: str, vocab, caption_after: set[int]) -> np.ndarray:
    """Per token of ``doc``: 0 ss, 1 shape, 2 tex, 3 caption, -1 other. Captions: the text after
    the last token in ``caption_after`` (``<|3d_end|>``, ``<|vision_end|>``) of ``und`` and
    ``replay_img`` documents, the end-of-document token left out."""
    ids = np.asarray(doc.tokens)
    out = np.full(ids.shape, -1)
    for k, name in enumerate(("ss", "shape", "tex")):
        lo = vocab.offsets[name]
        out[(ids >= lo) & (ids < lo + vocab.sizes[name])] = k
    if task in ("und", "replay_img"):
        ends = np.nonzero(np.isin(ids, list(caption_after)))[0]
        if len(ends):
            out[ends[-1] + 1 : len(ids) - 1] = 3
    return out


def measure(batch_docs: Callable[[int], Iterator[tuple[str, Document]]], n_batches: int,
            make_packer: Callable[[], Packer], rows_in_batch: int, tasks: list[str], vocab,
            caption_after: set[int]) -> dict:
    """Pack each batch's draws with a fresh ``make_packer()``; what of the drawn was trained."""
    drawn_kind, trained_kind = Counter(), Counter()
    doc_count, tok_count = Counter(), Counter()
    seen_doc, seen_tok = Counter(), Counter()  # every document the packer looked at (the trained + the closer)
    useful = total = cut_batches = 0
    kinds_of: dict[int, np.ndarray] = {}  # id(document) -> its token kinds (documents repeat across batches)
    for k in range(n_batches):
        seen: list[tuple[str, Document]] = []

        def stream(k: int = k, seen: list = seen) -> Iterator[Document]:
            for task, doc in batch_docs(k):
                seen.append((task, doc))
                yield doc

        rows = list(islice(make_packer().pack(stream()), rows_in_batch))
        unmatched = list(seen)
        last_cut = False
        for row in rows:
            useful += row.n_real_tokens
            total += row.input_ids.numel()
            cu = row.cu_seqlens.tolist()
            for a, b in zip(cu[:-1], cu[1:], strict=True):
                if a >= row.n_real_tokens:
                    continue
                seg = row.input_ids[a:b].tolist()
                i = next(i for i, (_, d) in enumerate(unmatched)
                         if len(d.tokens) >= len(seg) and d.tokens[len(seg) - 1] == seg[-1] and d.tokens[: len(seg)] == seg)
                task, doc = unmatched.pop(i)
                if id(doc) not in kinds_of:
                    kinds_of[id(doc)] = token_kinds(doc, task, vocab, caption_after)
                kinds = kinds_of[id(doc)]
                for c in range(len(KINDS)):
                    drawn_kind[c] += int((kinds == c).sum())
                    trained_kind[c] += int((kinds[: len(seg)] == c).sum())
                doc_count[task] += 1
                tok_count[task] += len(seg)
                last_cut = len(seg) < len(doc.tokens)
        cut_batches += last_cut
        for task, doc in seen:
            seen_doc[task] += 1
            seen_tok[task] += len(doc.tokens)
    n_docs, n_tok = sum(doc_count.values()), sum(tok_count.values())
    return {
        "docs_per_batch": n_docs / n_batches,
        "trained": {KINDS[c]: trained_kind[c] / max(1, drawn_kind[c]) for c in range(len(KINDS))},
        "cut_batches": cut_batches,
        "useful": useful / total,
        "doc_share": {t: doc_count[t] / n_docs for t in tasks},
        "tok_share": {t: tok_count[t] / n_tok for t in tasks},
        # The documents a batch looked at are its draws up to a stopping time (the closing rule
        # decides after each one): unbiased by Wald's identity. Against them the packer's own
        # bias shows without the draws' noise.
        "seen_doc_share": {t: seen_doc[t] / sum(seen_doc.values()) for t in tasks},
        "seen_tok_share": {t: seen_tok[t] / sum(seen_tok.values()) for t in tasks},
    }


def measure_carry(batch_docs: Callable[[int], Iterator[tuple[str, Document]]], n_batches: int,
                  make_packer: Callable[[], CarryPacker], tasks: list[str], vocab, caption_after: set[int]) -> dict:
    """One ``CarryPacker`` over batches 0..n-1, its buffer carried from each batch to the next, as
    the data layer packs a stream; the same columns as :func:`measure`. A document counts as
    drawn when the packer took it from the draws; the buffer left after the last batch is drawn,
    not trained (it opens the batch after)."""
    packer = make_packer()
    drawn_kind, trained_kind = Counter(), Counter()
    doc_count, tok_count, seen_doc, seen_tok = Counter(), Counter(), Counter(), Counter()
    useful = total = max_carry = 0
    kinds_of: dict[int, np.ndarray] = {}
    carry: list[Document] = []
    for k in range(n_batches):
        def stream(k: int = k) -> Iterator[Document]:
            for task, doc in batch_docs(k):
                if id(doc) not in kinds_of:
                    kinds_of[id(doc)] = token_kinds(doc, task, vocab, caption_after)
                kinds = kinds_of[id(doc)]
                for c in range(len(KINDS)):
                    drawn_kind[c] += int((kinds == c).sum())
                seen_doc[task] += 1
                seen_tok[task] += len(doc.tokens)
                yield replace(doc, source=(task, doc))

        got = packer.batch(carry, stream())
        carry = got.carry
        max_carry = max(max_carry, len(carry))
        for row in got.rows:
            useful += row.n_real_tokens
            total += row.input_ids.numel()
        for piece in got.placed:
            task, doc = piece.source
            a, b = piece.span or (0, len(doc.tokens))
            kinds = kinds_of[id(doc)][a:b]
            for c in range(len(KINDS)):
                trained_kind[c] += int((kinds == c).sum())
            doc_count[task] += a == 0
            tok_count[task] += b - a
    n_docs, n_tok = sum(doc_count.values()), sum(tok_count.values())
    return {
        "docs_per_batch": n_docs / n_batches,
        "trained": {KINDS[c]: trained_kind[c] / max(1, drawn_kind[c]) for c in range(len(KINDS))},
        "cut_batches": 0,  # never: whole documents
        "useful": useful / total,
        "max_carry": max_carry,
        "doc_share": {t: doc_count[t] / n_docs for t in tasks},
        "tok_share": {t: tok_count[t] / n_tok for t in tasks},
        "seen_doc_share": {t: seen_doc[t] / sum(seen_doc.values()) for t in tasks},
        "seen_tok_share": {t: seen_tok[t] / sum(seen_tok.values()) for t in tasks},
    }


def data_shares(weights: dict[str, float], mean_len: dict[str, float]) -> tuple[dict, dict]:
    """The data's document shares (the weights) and token shares (weights x mean length)."""
    norm = sum(weights[t] * mean_len[t] for t in weights)
    return dict(weights), {t: weights[t] * mean_len[t] / norm for t in weights}


def packers(row_len: int, batch_rows: int, close_below: int) -> dict[str, tuple[Callable[[], Packer], int]]:
    """The packers compared: name -> (factory, rows a batch keeps)."""
    return {
        "rows, cut (before)": (lambda: Packer(row_len=row_len, fill="cut"), batch_rows),
        "flat, cut (before)": (lambda: Packer(row_len=row_len * batch_rows, max_doc_len=row_len, fill="cut"), 1),
        "rows, whole (before)": (lambda: layout_packer("rows", row_len, batch_rows, close_below=close_below),
                                 rows_per_batch("rows", batch_rows)),
        "flat, whole (before)": (lambda: layout_packer("flat", row_len, batch_rows, close_below=close_below),
                                 rows_per_batch("flat", batch_rows)),
    }


def table(results: dict[str, dict], data_doc: dict, data_tok: dict, tasks: list[str]) -> str:
    head = ("| packing | docs/batch | SS | shape | tex | caption | last doc cut | useful tokens | doc share gap | "
            "token share gap | token share gap per task (" + ", ".join(tasks) + ") | packer's part (doc, token) |")
    lines = [head, "|" + "---|" * 12]
    for name, r in results.items():
        doc_gap = max(abs(r["doc_share"][t] - data_doc[t]) for t in tasks) * 100
        tok_gaps = [(r["tok_share"][t] - data_tok[t]) * 100 for t in tasks]
        tr = r["trained"]
        lines.append(f"| {name} | {r['docs_per_batch']:.1f} | " + " | ".join(f"{100 * tr[k]:.1f}%" for k in KINDS)
                     + f" | {r['cut_batches']} | {100 * r['useful']:.1f}% | {doc_gap:.1f} | "
                     f"{max(map(abs, tok_gaps)):.1f} | " + " ".join(f"{g:+.1f}" for g in tok_gaps) + " | "
                     f"{max(abs(r['doc_share'][t] - r['seen_doc_share'][t]) for t in tasks) * 100:.1f}, "
                     f"{max(abs(r['tok_share'][t] - r['seen_tok_share'][t]) for t in tasks) * 100:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from train.common.shapes import get_shape
    from train.stage1.data import MixtureSampler, load_manifests, normalized_weights, tokenize_record
    from train.stage1.synthetic import generate_synthetic
    from train.stage1.tokenizer import build_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="qwen35-2b")
    ap.add_argument("--row-len", type=int, default=8192)
    ap.add_argument("--batch-rows", type=int, default=4)
    ap.add_argument("--batches", type=int, default=1000)
    ap.add_argument("--samples", type=int, default=200)
    ap.add_argument("--data-dir")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(args.data_dir) if args.data_dir else Path(tmp) / "data"
        if not args.data_dir:
            generate_synthetic(data, args.samples, seed=0, shape=args.shape)
        tok = build_tokenizer(get_shape(args.shape), None, vision=True)
        man = load_manifests(data)
        weights = normalized_weights(None, man)
        sampler = MixtureSampler(man, weights, seed=0, rank=0)
        cache: dict[tuple[str, int], Document] = {}

        def doc_of(task: str, line_no: int, rec: dict) -> Document:
            if (task, line_no) not in cache:
                cache[(task, line_no)] = tokenize_record(tok, data, task, rec)
            return cache[(task, line_no)]

        def batch_docs(k: int) -> Iterator[tuple[str, Document]]:
            for task, line_no, rec in sampler.draws(k):
                yield task, doc_of(task, line_no, rec)

        tasks = list(weights)
        mean_len = {t: float(np.mean([len(doc_of(t, n, r).tokens) for n, r in man.records[t]])) for t in tasks}
        data_doc, data_tok = data_shares(weights, mean_len)
        close_below = sum(n or 0 for n in tok.codebooks.lengths)
        caption_after = {tok.vocab.special_ids["<|3d_end|>"], tok.vision_ids["vision_end_token_id"]}
        results = {name: measure(batch_docs, args.batches, factory, keep, tasks, tok.vocab, caption_after)
                   for name, (factory, keep) in packers(args.row_len, args.batch_rows, close_below).items()}
        for layout in ("rows", "flat"):  # what the data layer packs with now
            results[f"{layout}, whole + carry (now)"] = measure_carry(
                batch_docs, args.batches, lambda layout=layout: CarryPacker(layout, args.row_len, args.batch_rows),
                tasks, tok.vocab, caption_after)
    print(f"# {args.batches} batches of {args.batch_rows} x {args.row_len} tokens, {args.shape}'s 3D format, vision "
          f"on, {len(cache)} records; the streaming whole packers close once no row has {close_below} tokens of "
          f"room; the carry packers keep up to {CARRY_DOCS} documents for the next batch and close below "
          f"{CARRY_CLOSE_BELOW} tokens of room (a CPU measurement)")
    print(table(results, data_doc, data_tok, tasks))
    return 0


if __name__ == "__main__":
    sys.exit(main())
