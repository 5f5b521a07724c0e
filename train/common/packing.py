"""Pack tokenised documents into uniform rows of ``row_len`` tokens.

Why uniform rows: fla/Triton kernels autotune per shape. With every row exactly ``row_len``
tokens there is a finite set of shapes, compiled once, instead of a re-tune (~15 s) per batch.

Row layout
----------
Documents are laid out back to back; the unused tail of a row is padding, which forms its own
final segment. For every token::

    input_ids     token id (``pad_id`` on padding)
    labels        the token id itself, except -100 at the FIRST token of every document and on
                  every padding token
    position_ids  0, 1, 2, ... restarting at every document start (padding counts 0, 1, ... too)
    seq_idx       index of the segment within the row (documents 0..n-1, padding n)
    task_ids      task index of the document the token belongs to, -1 on padding

``cu_seqlens`` holds the segment boundaries ``[0, len_0, len_0+len_1, ..., row_len]``.

Images (documents of the vision model)
--------------------------------------
A :class:`Document` may carry images: each an :class:`ImageInput` (the vision tower's
``pixel_values`` and patch grid ``grid_thw``) and the span of its placeholder tokens in the
document. Per row, additionally::

    mrope_position_ids  [3, row_len] (temporal, height, width) rotary positions, restarting at
                        every document start: text tokens count up on all three axes; an image
                        of merged grid (t, h, w) starting at position p gets (p+i, p+j, p+k) for
                        its token (i, j, k), and the text after it continues at p + max(h, w)
                        (Qwen3.5's rule, ``Qwen3_5Model.get_rope_index``). Text-only documents:
                        three copies of ``position_ids``.
    images              the row's images, in token order, spans relative to the row

and labels are -100 on image placeholder tokens (their embeddings come from the vision tower,
there is nothing to predict). ``collate`` concatenates the images of all rows in row order into
``pixel_values``/``image_grid_thw``: transformers scatters the vision tower's outputs into the
placeholder tokens in row-major order of ``input_ids``, so the k-th image of the batch must
belong to the k-th run of placeholders. ``model_kwargs`` then passes ``position_ids`` as
``[4, B, T]``: row 0 the per-document text positions (transformers derives the block-diagonal
attention mask from that row), rows 1-3 the mrope positions.

Labels convention (HF internal shift)
-------------------------------------
``labels`` are *unshifted*: transformers' causal-LM loss shifts them, so the logit at position
``t-1`` is scored against ``labels[t]``. Masking the first token of every document therefore
removes exactly the one cross-document prediction (last token of document ``i`` -> first token of
document ``i+1``), and the first token of a row is always masked, so a batch of rows never
predicts across rows either. Per-task loss: the loss term produced at position ``t-1`` belongs to
``task_ids[t]`` (the task of the label), which is never -1 where the label is not -100.

Long documents (``long_doc``)
-----------------------------
``"split"`` (default): a document longer than ``row_len`` is cut into consecutive ``row_len``-token
pieces (the last one shorter), and each piece is packed as a document of its own (positions
restart, its first label is masked). Nothing is thrown away: in stage 1 the prediction targets
(3D codebook tokens) sit at the END of generation documents, so truncation would drop exactly the
tokens being learned. The price is that a later piece does not see the earlier piece as context.
``"truncate"``: keep the first ``row_len`` tokens, drop the rest (counted in ``dropped_tokens``).
A cut never falls inside an image's placeholder span: it moves back to the image's start (the
image goes whole into the next piece, or is dropped with the tail); an image longer than a row is
a ValueError (the data layer bounds image sizes so that this cannot happen).

Placement: bounded first-fit (``fill="first-fit"``, the default)
-----------------------------------------------------------------
Up to ``open_rows`` rows are kept open. Each document (or piece) goes into the first open row
with room for it. When none has room and ``open_rows`` rows are already open, the OLDEST open row
is emitted (padded) and a new row opened. A row that becomes exactly full is emitted at once. At
the end of the input every open row is emitted, oldest first. ``open_rows=1`` is plain sequential
fill. The procedure depends only on the input order, so it is deterministic.

Placement: cut to fill (``fill="cut"``)
---------------------------------------
Documents go into one row in input order; the one that does not fit the rest of the row is cut
there: its head ends the row (a document of its own, labels as usual), its tail is dropped and
counted in ``dropped_tokens``. Rows are therefore full (no padding), except where the cut would
fall inside an image or leave a head shorter than ``min_piece`` tokens: then the row is emitted
padded and the document starts the next row whole. Unlike first-fit, which fills the gaps of a
row with whatever short documents come later, the documents of a row are exactly the ones drawn,
in order, so a caller that keeps only the first rows (a batch) trains on the mixture it drew (the
batch layouts filled this way until the cut tails were measured; they now place whole documents).

Placement: whole documents, a batch at a time (``fill="whole"``, both batch layouts)
------------------------------------------------------------------------------------
Cut to fill trains the head of the document that ends a row and throws its tail away; in stage 1
that tail is the generation target (texture codes after shape codes after SS codes, ``und``'s
caption after its asset), so the trained token shares drifted from the data's (at 4 x 8,192
tokens, flat: 14.6% of the drawn texture codes never trained; rows: 48%). ``whole`` never cuts a
document (only a document longer than ``max_doc_len`` is still split, ``long_doc``). The
``open_rows`` rows of a batch (``rows``: ``batch_rows`` rows; ``flat``: the one stream) are open
together; each document goes, in input order, into the first open row with room for it. The batch
closes, every open row emitted padded, when

* a document fits no open row (it starts the next batch; the data layer's batch never holds it),
  or
* the most room left in any open row is below ``close_below`` tokens: the packer stops before
  it looks at the next document.

Why ``close_below``: a batch that closes only on a document that does not fit leaves out, once
per batch, a document that is long more often than the data's are (a 3D document, ~20% of a
4 x 8,192 batch), which bends the document shares against the 3D tasks (measured: replay_img
+3.4 / +4.4 points, flat / rows). Closing on the room left, a rule that does not look at the next
document, leaves the documents of a batch a prefix of its draws cut at a stopping time, unbiased
(Wald). The data layer passes the length of one 3D asset: a batch closes once no row has room for
one more, and a document that fits no row while one still has that much room is rare (an image
document a little longer than the room). A ``close_below`` above ``max_doc_len`` (an asset
longer than a row, split into pieces anyway) means half a piece's room. ``bench/packing_cost.py`` measures the shares and the
useful tokens given up: the padding where a cut head used to be.

Whole documents with a carry-over buffer (:class:`CarryPacker`, what the data layer packs with)
-----------------------------------------------------------------------------------------------
The streaming whole packer pays for the unbiased close with padding: at 4 x 8,192 tokens a batch
closes once no row has room for one more ~5.8k-token 3D asset, so 9% of the flat stream was
padding. ``CarryPacker`` packs ONE batch at a time and hands back a buffer that opens the next:

* the buffer the last batch left (oldest first), then documents drawn for this batch, each into
  the fullest row with room (best fit); one with no room (or refused by ``admit``, the vision
  budget) goes to the buffer, whole;
* the batch stops drawing once no row has ``close_below`` (32) tokens of room, or once the buffer
  holds ``carry_docs`` (16) documents: a rule that never looks at the next document, so the
  draws are a prefix of the batch's stream cut at a stopping time (unbiased), and every drawn
  document is trained exactly once, in this batch or a later one: the trained shares are the
  drawn shares (bench/packing_cost.py: >= 98% useful tokens flat).

The buffer is bounded (a drawn document enters it only while it holds fewer than ``carry_docs``;
its older documents are placed first, so none waits more than ``carry_docs`` batches), and it is
part of the data state: the data layer saves it as references to its records (``Document.source``
and the ``span`` of a piece), so a resume continues bitwise the same.

The flat layout (one stream per batch)
--------------------------------------
``Packer(row_len=B * T, max_doc_len=T, fill="whole")``: the batch is ONE row of ``B * T`` tokens,
collated to ``[1, B * T]``, with ``cu_seqlens`` over it, so a document no longer has to end where
a row of ``T`` would; documents are still split at ``max_doc_len = T`` (``long_doc``), so no
attention span and no MFU attention term grows with the stream. Every token mixer of the model
takes the flattened batch as varlen (GDN, conv, and varlen attention,
:mod:`train.common.varlen_attention`; sdpa's dense mask over B*T tokens would cost (B*T)^2).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace

import torch

IGNORE_INDEX = -100
PAD_TASK = -1
LONG_DOC_RULES = ("split", "truncate")
FILL_RULES = ("first-fit", "cut", "whole")
LAYOUTS = ("rows", "flat")


@dataclass(frozen=True)
class ImageInput:
    """One image of a document: vision-tower inputs and where its placeholder tokens are."""

    pixel_values: torch.Tensor  # [n_patches, C * temporal_patch * patch * patch], merge-window order
    grid_thw: tuple[int, int, int]  # patch grid (t, h, w) before the spatial merge
    spatial_merge_size: int
    start: int  # index of the first placeholder token (in the document, or in the row)

    @property
    def llm_grid(self) -> tuple[int, int, int]:
        t, h, w = self.grid_thw
        m = self.spatial_merge_size
        return t, h // m, w // m

    @property
    def n_tokens(self) -> int:
        t, h, w = self.llm_grid
        return t * h * w

    @property
    def end(self) -> int:
        return self.start + self.n_tokens


@dataclass
class Document:
    tokens: list[int]
    task: int
    images: list[ImageInput] = field(default_factory=list)  # in token order, spans inside tokens
    # Where the document came from, for a caller that must name it again (the data layer's carry
    # buffer, saved in its state): an opaque ``source`` it sets, and ``span``, the [start, end) of
    # the original document this one is (a piece of a split document keeps its source).
    source: object = None
    span: tuple[int, int] | None = None


def as_document(doc: Document | tuple) -> Document:
    """A :class:`Document` from a ``(tokens, task)`` or ``(tokens, task, images)`` tuple."""
    if isinstance(doc, Document):
        return doc
    return Document(list(doc[0]), int(doc[1]), list(doc[2]) if len(doc) > 2 else [])


def mrope_positions(n_tokens: int, images: list[ImageInput]) -> torch.LongTensor:
    """[3, n_tokens] rotary positions of one document (see the module docstring)."""
    out = torch.empty(3, n_tokens, dtype=torch.long)
    pos = 0  # next position
    at = 0  # next token
    for img in sorted(images, key=lambda i: i.start):
        if img.start < at or img.end > n_tokens:
            raise ValueError(f"image span [{img.start}, {img.end}) overlaps another or leaves the {n_tokens}-token document")
        out[:, at : img.start] = torch.arange(pos, pos + img.start - at)
        pos += img.start - at
        t, h, w = img.llm_grid
        grid = torch.stack(torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"))
        out[:, img.start : img.end] = grid.reshape(3, -1) + pos
        pos += max(h, w)
        at = img.end
    out[:, at:] = torch.arange(pos, pos + n_tokens - at)
    return out


@dataclass
class PackedRow:
    input_ids: torch.LongTensor  # [row_len]
    labels: torch.LongTensor  # [row_len], -100 at every document's first token and on padding
    position_ids: torch.LongTensor  # [row_len], reset to 0 at each document start
    seq_idx: torch.IntTensor  # [row_len], segment index within the row (padding is its own segment)
    cu_seqlens: torch.IntTensor  # [n_segments + 1]
    task_ids: torch.LongTensor  # [row_len], task index per token (-1 on padding)
    n_real_tokens: int
    mrope_position_ids: torch.LongTensor | None = None  # [3, row_len], reset per document
    images: list[ImageInput] = field(default_factory=list)  # in token order, starts relative to the row


@dataclass(eq=False)  # identity: rows are removed by `is`, never by comparing their tensors
class _OpenRow:
    docs: list[Document] = field(default_factory=list)
    used: int = 0


class Packer:
    """Documents ``(token_ids, task_index)`` -> uniform :class:`PackedRow` s (see module docstring)."""

    def __init__(self, row_len: int = 8192, pad_id: int = 0, long_doc: str = "split", open_rows: int = 8,
                 max_doc_len: int | None = None, fill: str = "first-fit", min_piece: int = 16,
                 close_below: int = 0):
        if row_len < 2:
            raise ValueError(f"row_len must be >= 2, got {row_len}")
        if long_doc not in LONG_DOC_RULES:
            raise ValueError(f"long_doc must be one of {LONG_DOC_RULES}, got {long_doc!r}")
        if open_rows < 1:
            raise ValueError(f"open_rows must be >= 1, got {open_rows}")
        if fill not in FILL_RULES:
            raise ValueError(f"fill must be one of {FILL_RULES}, got {fill!r}")
        max_doc_len = row_len if max_doc_len is None else max_doc_len
        if not 2 <= max_doc_len <= row_len:
            raise ValueError(f"max_doc_len must be in [2, row_len={row_len}], got {max_doc_len}")
        self.row_len = row_len
        self.max_doc_len = max_doc_len  # documents are split (or truncated) to this many tokens
        self.fill = fill
        self.min_piece = min_piece
        self.close_below = close_below  # fill="whole": a batch closes once no open row has this much room
        self.deferred_docs = 0  # fill="whole": documents that closed a batch (they start the next one)
        self.pad_id = pad_id
        self.long_doc = long_doc
        self.open_rows = open_rows
        self.real_tokens = 0
        self.total_tokens = 0
        self.rows_emitted = 0
        self.docs_seen = 0
        self.dropped_tokens = 0

    @property
    def efficiency(self) -> float:
        """Real tokens / all tokens (real + padding) over the rows emitted so far."""
        return self.real_tokens / self.total_tokens if self.total_tokens else 0.0

    def _cut(self, doc: Document, start: int, limit: int | None = None) -> int:
        """End of the piece starting at ``start``: at most ``limit`` (``max_doc_len``) tokens, never
        inside an image."""
        end = min(start + (self.max_doc_len if limit is None else limit), len(doc.tokens))
        for img in doc.images:
            if img.start < end < img.end:
                end = img.start
        if end <= start and limit is None:
            raise ValueError(f"an image of {doc.images[0].n_tokens if doc.images else '?'}+ placeholder tokens "
                             f"does not fit a {self.max_doc_len}-token row; bound the image size")
        return end

    def _pieces(self, doc: Document) -> list[Document]:
        n = len(doc.tokens)
        if n <= self.max_doc_len:
            return [doc]
        pieces, start = [], 0
        while start < n:
            end = self._cut(doc, start)
            pieces.append(slice_document(doc, start, end))
            if self.long_doc == "truncate":
                self.dropped_tokens += n - end
                break
            start = end
        return pieces

    def pack(self, docs: Iterable[Document | tuple]) -> Iterator[PackedRow]:
        if self.fill == "cut":
            yield from self._pack_cut(docs)
            return
        if self.fill == "whole":
            yield from self._pack_whole(docs)
            return
        open_rows: list[_OpenRow] = []
        for doc in docs:
            self.docs_seen += 1
            doc = as_document(doc)
            if not doc.tokens:
                continue
            for piece in self._pieces(doc):
                target = next((r for r in open_rows if r.used + len(piece.tokens) <= self.row_len), None)
                if target is None:
                    if len(open_rows) >= self.open_rows:
                        yield self._emit(open_rows.pop(0))
                    target = _OpenRow()
                    open_rows.append(target)
                target.docs.append(piece)
                target.used += len(piece.tokens)
                if target.used == self.row_len:
                    open_rows.remove(target)
                    yield self._emit(target)
        for row in open_rows:
            yield self._emit(row)

    def _pack_cut(self, docs: Iterable[Document | tuple]) -> Iterator[PackedRow]:
        row = _OpenRow()
        for doc in docs:
            self.docs_seen += 1
            doc = as_document(doc)
            if not doc.tokens:
                continue
            pieces = self._pieces(doc)
            for p_i, piece in enumerate(pieces):
                room = self.row_len - row.used
                if len(piece.tokens) <= room:
                    row.docs.append(piece)
                    row.used += len(piece.tokens)
                else:
                    head = self._cut(piece, 0, limit=room)
                    if head >= self.min_piece:  # the head ends this row, the tail is dropped
                        row.docs.append(slice_document(piece, 0, head))
                        row.used += head
                        self.dropped_tokens += len(piece.tokens) - head + sum(len(p.tokens) for p in pieces[p_i + 1:])
                        yield self._emit(row)
                        row = _OpenRow()
                        break  # the document's later pieces are dropped with its tail
                    yield self._emit(row)  # padded; the piece starts the next row whole
                    row = _OpenRow(docs=[piece], used=len(piece.tokens))
                if row.used == self.row_len:
                    yield self._emit(row)
                    row = _OpenRow()
        if row.docs:
            yield self._emit(row)

    def _pack_whole(self, docs: Iterable[Document | tuple]) -> Iterator[PackedRow]:
        # An asset longer than a piece (max_doc_len) is split anyway, and "room for one more" would
        # close every batch after its first piece: then half a piece's room.
        close = max(1, self.close_below if self.close_below <= self.max_doc_len else self.max_doc_len // 2)
        rows = [_OpenRow() for _ in range(self.open_rows)]
        for doc in docs:
            self.docs_seen += 1
            doc = as_document(doc)
            if not doc.tokens:
                continue
            for p_i, piece in enumerate(self._pieces(doc)):
                n = len(piece.tokens)
                target = next((r for r in rows if r.used + n <= self.row_len), None)
                if target is None:  # the batch is full: it closes, this piece opens the next one
                    self.deferred_docs += p_i == 0
                    for row in rows:
                        yield self._emit(row)
                    rows = [_OpenRow() for _ in range(self.open_rows)]
                    target = rows[0]
                target.docs.append(piece)
                target.used += n
                if max(self.row_len - r.used for r in rows) < close:
                    for row in rows:
                        yield self._emit(row)
                    rows = [_OpenRow() for _ in range(self.open_rows)]
        if any(r.docs for r in rows):
            for row in rows:
                yield self._emit(row)

    def _emit(self, row: _OpenRow) -> PackedRow:
        packed = build_row(row.docs, self.row_len, self.pad_id)
        self.real_tokens += packed.n_real_tokens
        self.total_tokens += self.row_len
        self.rows_emitted += 1
        return packed


def slice_document(doc: Document, start: int, end: int) -> Document:
    """Tokens [start, end) of ``doc`` as a document of its own (images inside the span move with it)."""
    images = [replace(i, start=i.start - start) for i in doc.images if start <= i.start < end]
    base = doc.span[0] if doc.span is not None else 0
    return Document(doc.tokens[start:end], doc.task, images, doc.source, (base + start, base + end))


def layout_packer(layout: str, row_len: int, batch_rows: int, *, close_below: int, pad_id: int = 0,
                  long_doc: str = "split") -> Packer:
    """The streaming packer of a batch layout, whole documents (``fill="whole"``): ``rows``
    (``batch_rows`` rows of ``row_len``, open together) or ``flat`` (one stream of ``batch_rows *
    row_len`` tokens, documents of at most ``row_len``). A batch is the packer's next
    ``rows_per_batch(layout, batch_rows)`` rows.

    ``close_below`` is required (>= 1; the data layer's rule is one 3D asset's length): a batch
    that closes only on a document that fits no row puts that document in the NEXT batch, so a
    caller that keeps one batch drops it, and it is more often a long one (the shares bend). The
    data layer itself packs with :class:`CarryPacker`, which keeps such a document for the next
    batch."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown packing layout {layout!r} ({', '.join(LAYOUTS)})")
    if close_below < 1:
        raise ValueError(f"close_below must be >= 1 (the data layer passes one 3D asset's length), got {close_below}")
    if layout == "flat":
        return Packer(row_len=row_len * batch_rows, pad_id=pad_id, long_doc=long_doc, max_doc_len=row_len,
                      fill="whole", open_rows=1, close_below=close_below)
    # All rows of the batch open together: first-fit over more open rows than a batch keeps filled
    # its first rows with later short documents and left the long ones in rows never emitted,
    # which bent the mixture (gen_img 11% of documents against a 22% weight).
    return Packer(row_len=row_len, pad_id=pad_id, long_doc=long_doc, fill="whole", open_rows=batch_rows,
                  close_below=close_below)


# The carry-over buffer's bound (documents) and the room below which a batch closes (tokens):
# measured with bench/packing_cost.py at 4 x 8,192 tokens (bench/RESULTS.md).
CARRY_DOCS = 16
CARRY_CLOSE_BELOW = 32


@dataclass
class PackedBatch:
    rows: list[PackedRow]  # rows_per_batch(layout, batch_rows) rows
    placed: list[Document]  # the documents (or pieces) in the rows, oldest first
    carry: list[Document]  # the buffer after this batch, oldest first: they open the next batch of the stream
    drawn: int  # documents taken from the draws (each one placed or carried, never both, never neither)


class CarryPacker:
    """Whole documents, one batch at a time, with a carry-over buffer (module docstring)."""

    def __init__(self, layout: str, row_len: int, batch_rows: int, *, pad_id: int = 0, long_doc: str = "split",
                 carry_docs: int = CARRY_DOCS, close_below: int = CARRY_CLOSE_BELOW, max_segments: int | None = None):
        if layout not in LAYOUTS:
            raise ValueError(f"unknown packing layout {layout!r} ({', '.join(LAYOUTS)})")
        if carry_docs < 1 or close_below < 1:
            raise ValueError(f"carry_docs and close_below must be >= 1, got {carry_docs} and {close_below}")
        flat = layout == "flat"
        # The splitter of long documents (its _pieces), and the row builder (its _emit and counters).
        self.rows = Packer(row_len=row_len * batch_rows if flat else row_len, max_doc_len=row_len, pad_id=pad_id,
                           long_doc=long_doc, fill="whole")
        self.n_rows = 1 if flat else batch_rows
        self.carry_docs = carry_docs
        self.close_below = close_below
        # Segments a batch may hold (its documents, and a padding segment per row): the GDN kernels'
        # launch limit (train.common.gdn_guard.max_segments); None: unbounded.
        self.max_docs = None if max_segments is None else max_segments - self.n_rows
        if self.max_docs is not None and self.max_docs < 1:
            raise ValueError(f"max_segments={max_segments} leaves no room for a document beside {self.n_rows} padding "
                             "segment(s)")

    def batch(self, carried: Iterable[Document], draws: Iterable[Document | tuple],
              admit: Callable[[Document], bool] | None = None) -> PackedBatch:
        """The next batch: ``carried`` (the last batch's buffer, oldest first) placed first, then
        new documents from ``draws``.

        ``admit(doc)``: whether a document that has room may enter this batch (the data layer's
        vision budget); one it refuses waits in the buffer."""
        rows = [_OpenRow() for _ in range(self.n_rows)]
        placed: list[Document] = []
        carry: list[Document] = []

        def place(doc: Document) -> None:  # into the fullest row with room (best fit), else the buffer
            n = len(doc.tokens)
            fits = [r for r in rows if r.used + n <= self.rows.row_len]
            if self.max_docs is not None and len(placed) >= self.max_docs:
                fits = []
            if fits and (admit is None or admit(doc)):
                row = max(fits, key=lambda r: r.used)
                row.docs.append(doc)
                row.used += n
                placed.append(doc)
            else:
                carry.append(doc)

        for doc in carried:
            place(doc)
        drawn = 0
        it = iter(draws)
        # Draw until no row has close_below tokens of room, or the buffer is full: a rule that
        # never looks at the next document, so the draws are a prefix of the batch's stream cut at
        # a stopping time (unbiased); and each is trained, here or in a later batch.
        while (max(self.rows.row_len - r.used for r in rows) >= self.close_below and len(carry) < self.carry_docs
               and (self.max_docs is None or len(placed) < self.max_docs)):
            doc = next(it, None)
            if doc is None:
                break
            drawn += 1
            self.rows.docs_seen += 1
            doc = as_document(doc)
            for piece in self.rows._pieces(doc) if doc.tokens else []:
                place(piece)
        return PackedBatch([self.rows._emit(r) for r in rows], placed, carry, drawn)

    @property
    def efficiency(self) -> float:
        return self.rows.efficiency


def resolve_layout(requested: str, device_type: str) -> str:
    """``auto``: ``flat`` on CUDA (with varlen attention), ``rows`` on the CPU (the demo and tests)."""
    if requested == "auto":
        return "flat" if device_type == "cuda" else "rows"
    if requested not in LAYOUTS:
        raise ValueError(f"unknown packing layout {requested!r} (auto, {', '.join(LAYOUTS)})")
    return requested


def rows_per_batch(layout: str, batch_rows: int) -> int:
    return 1 if layout == "flat" else batch_rows


def build_row(docs: list[Document | tuple], row_len: int, pad_id: int = 0) -> PackedRow:
    """Lay out ``docs`` (each at most ``row_len`` tokens, together at most ``row_len``) as one row."""
    input_ids = torch.full((row_len,), pad_id, dtype=torch.long)
    mrope = torch.zeros(3, row_len, dtype=torch.long)
    images: list[ImageInput] = []
    labels = torch.full((row_len,), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros(row_len, dtype=torch.long)
    seq_idx = torch.zeros(row_len, dtype=torch.int32)
    task_ids = torch.full((row_len,), PAD_TASK, dtype=torch.long)
    bounds = [0]
    start = 0
    for i, doc in enumerate(docs):
        doc = as_document(doc)
        tokens, task = doc.tokens, doc.task
        n = len(tokens)
        end = start + n
        if n == 0 or end > row_len:
            raise ValueError(f"document {i} of {n} tokens does not fit a {row_len}-token row at offset {start}")
        ids = torch.tensor(tokens, dtype=torch.long)
        input_ids[start:end] = ids
        labels[start:end] = ids
        labels[start] = IGNORE_INDEX
        position_ids[start:end] = torch.arange(n)
        mrope[:, start:end] = mrope_positions(n, doc.images)
        for img in doc.images:
            labels[start + img.start : start + img.end] = IGNORE_INDEX
            images.append(replace(img, start=start + img.start))
        seq_idx[start:end] = i
        task_ids[start:end] = task
        bounds.append(end)
        start = end
    if start < row_len:  # padding tail: its own segment, positions from 0 so no document "continues"
        position_ids[start:] = torch.arange(row_len - start)
        mrope[:, start:] = position_ids[start:]
        seq_idx[start:] = len(docs)
        bounds.append(row_len)
    return PackedRow(
        input_ids=input_ids,
        labels=labels,
        position_ids=position_ids,
        seq_idx=seq_idx,
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        task_ids=task_ids,
        n_real_tokens=start,
        mrope_position_ids=mrope,
        images=images,
    )


def collate(rows: list[PackedRow]) -> dict[str, torch.Tensor]:
    """Stack rows into a batch.

    Per-token tensors get shape ``[B, row_len]``; ``mrope_position_ids`` ``[3, B, row_len]``. When
    a row has images: ``pixel_values`` (every image's patches, rows in order, images in token order
    within a row) and ``image_grid_thw`` ``[n_images, 3]``. ``cu_seqlens`` describes the batch as ONE varlen
    sequence of ``B*row_len`` tokens (what fla's varlen kernels take, with the batch flattened to
    1), and ``seq_idx`` is numbered the same way, globally over the batch, so the last segment of
    row ``r`` and the first of row ``r+1`` never share an index. ``max_seqlen`` is the longest
    segment (for flash-attention style kernels).
    """
    if not rows:
        raise ValueError("collate needs at least one row")
    row_len = rows[0].input_ids.numel()
    if any(r.input_ids.numel() != row_len for r in rows):
        raise ValueError("all rows in a batch must have the same row_len")
    cu = [torch.zeros(1, dtype=torch.int32)]
    seq_idx = []
    n_segments = 0
    for r_i, row in enumerate(rows):
        cu.append(row.cu_seqlens[1:] + r_i * row_len)
        seq_idx.append(row.seq_idx + n_segments)
        n_segments += row.cu_seqlens.numel() - 1
    cu_seqlens = torch.cat(cu).to(torch.int32)
    images = [img for row in rows for img in row.images]
    extra: dict[str, torch.Tensor] = {}
    if images:
        extra["pixel_values"] = torch.cat([img.pixel_values for img in images])
        extra["image_grid_thw"] = torch.tensor([img.grid_thw for img in images], dtype=torch.long)
    mrope = [r.mrope_position_ids if r.mrope_position_ids is not None else r.position_ids.expand(3, -1) for r in rows]
    return {
        **extra,
        "mrope_position_ids": torch.stack(mrope, dim=1),
        "input_ids": torch.stack([r.input_ids for r in rows]),
        "labels": torch.stack([r.labels for r in rows]),
        "position_ids": torch.stack([r.position_ids for r in rows]),
        "seq_idx": torch.stack(seq_idx).to(torch.int32),
        "task_ids": torch.stack([r.task_ids for r in rows]),
        "cu_seqlens": cu_seqlens,
        "max_seqlen": (cu_seqlens[1:] - cu_seqlens[:-1]).max().to(torch.int64),
        "n_real_tokens": torch.tensor(sum(r.n_real_tokens for r in rows), dtype=torch.int64),
    }


def model_kwargs(batch: dict[str, torch.Tensor]) -> dict[str, object]:
    """The keyword arguments a qwen3_5 causal LM takes for a packed batch.

    ``position_ids`` (reset per document) make transformers build a block-diagonal causal mask for
    the full-attention layers under sdpa/eager; ``cu_seq_lens_*``/``max_length_*`` are the
    flash-attention varlen kwargs; ``seq_idx`` and ``cu_seq_lens_q`` are what the gated-delta-net
    layers installed by :func:`train.common.fastpath.install_kernels` read.

    With images (``pixel_values`` in the batch, for ``Qwen3_5ForConditionalGeneration``):
    ``pixel_values``, ``image_grid_thw``, and ``position_ids`` as ``[4, B, T]``: the text positions
    (row 0, what the attention mask is built from) on top of the 3-D mrope positions.
    """
    max_len = int(batch["max_seqlen"])
    kwargs: dict[str, object] = {
        "input_ids": batch["input_ids"],
        "labels": batch["labels"],
        "position_ids": batch["position_ids"],
        "seq_idx": batch["seq_idx"],
        "cu_seq_lens_q": batch["cu_seqlens"],
        "cu_seq_lens_k": batch["cu_seqlens"],
        "max_length_q": max_len,
        "max_length_k": max_len,
    }
    if batch.get("pixel_values") is not None:
        kwargs["position_ids"] = torch.cat([batch["position_ids"][None], batch["mrope_position_ids"]])
        kwargs["pixel_values"] = batch["pixel_values"]
        kwargs["image_grid_thw"] = batch["image_grid_thw"]
    return kwargs
