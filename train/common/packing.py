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

Placement: bounded first-fit
----------------------------
Up to ``open_rows`` rows are kept open. Each document (or piece) goes into the first open row
with room for it. When none has room and ``open_rows`` rows are already open, the OLDEST open row
is emitted (padded) and a new row opened. A row that becomes exactly full is emitted at once. At
the end of the input every open row is emitted, oldest first. ``open_rows=1`` is plain sequential
fill. The procedure depends only on the input order, so it is deterministic.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

import torch

IGNORE_INDEX = -100
PAD_TASK = -1
LONG_DOC_RULES = ("split", "truncate")


@dataclass
class PackedRow:
    input_ids: torch.LongTensor  # [row_len]
    labels: torch.LongTensor  # [row_len], -100 at every document's first token and on padding
    position_ids: torch.LongTensor  # [row_len], reset to 0 at each document start
    seq_idx: torch.IntTensor  # [row_len], segment index within the row (padding is its own segment)
    cu_seqlens: torch.IntTensor  # [n_segments + 1]
    task_ids: torch.LongTensor  # [row_len], task index per token (-1 on padding)
    n_real_tokens: int


@dataclass
class _OpenRow:
    docs: list[tuple[list[int], int]] = field(default_factory=list)
    used: int = 0


class Packer:
    """Documents ``(token_ids, task_index)`` -> uniform :class:`PackedRow` s (see module docstring)."""

    def __init__(self, row_len: int = 8192, pad_id: int = 0, long_doc: str = "split", open_rows: int = 8):
        if row_len < 2:
            raise ValueError(f"row_len must be >= 2, got {row_len}")
        if long_doc not in LONG_DOC_RULES:
            raise ValueError(f"long_doc must be one of {LONG_DOC_RULES}, got {long_doc!r}")
        if open_rows < 1:
            raise ValueError(f"open_rows must be >= 1, got {open_rows}")
        self.row_len = row_len
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

    def _pieces(self, tokens: list[int]) -> list[list[int]]:
        if len(tokens) <= self.row_len:
            return [tokens]
        if self.long_doc == "truncate":
            self.dropped_tokens += len(tokens) - self.row_len
            return [tokens[: self.row_len]]
        return [tokens[i : i + self.row_len] for i in range(0, len(tokens), self.row_len)]

    def pack(self, docs: Iterable[tuple[list[int], int]]) -> Iterator[PackedRow]:
        open_rows: list[_OpenRow] = []
        for tokens, task in docs:
            self.docs_seen += 1
            tokens = list(tokens)
            if not tokens:
                continue
            for piece in self._pieces(tokens):
                target = next((r for r in open_rows if r.used + len(piece) <= self.row_len), None)
                if target is None:
                    if len(open_rows) >= self.open_rows:
                        yield self._emit(open_rows.pop(0))
                    target = _OpenRow()
                    open_rows.append(target)
                target.docs.append((piece, int(task)))
                target.used += len(piece)
                if target.used == self.row_len:
                    open_rows.remove(target)
                    yield self._emit(target)
        for row in open_rows:
            yield self._emit(row)

    def _emit(self, row: _OpenRow) -> PackedRow:
        packed = build_row(row.docs, self.row_len, self.pad_id)
        self.real_tokens += packed.n_real_tokens
        self.total_tokens += self.row_len
        self.rows_emitted += 1
        return packed


def build_row(docs: list[tuple[list[int], int]], row_len: int, pad_id: int = 0) -> PackedRow:
    """Lay out ``docs`` (each at most ``row_len`` tokens, together at most ``row_len``) as one row."""
    input_ids = torch.full((row_len,), pad_id, dtype=torch.long)
    labels = torch.full((row_len,), IGNORE_INDEX, dtype=torch.long)
    position_ids = torch.zeros(row_len, dtype=torch.long)
    seq_idx = torch.zeros(row_len, dtype=torch.int32)
    task_ids = torch.full((row_len,), PAD_TASK, dtype=torch.long)
    bounds = [0]
    start = 0
    for i, (tokens, task) in enumerate(docs):
        n = len(tokens)
        end = start + n
        if n == 0 or end > row_len:
            raise ValueError(f"document {i} of {n} tokens does not fit a {row_len}-token row at offset {start}")
        ids = torch.tensor(tokens, dtype=torch.long)
        input_ids[start:end] = ids
        labels[start:end] = ids
        labels[start] = IGNORE_INDEX
        position_ids[start:end] = torch.arange(n)
        seq_idx[start:end] = i
        task_ids[start:end] = task
        bounds.append(end)
        start = end
    if start < row_len:  # padding tail: its own segment, positions from 0 so no document "continues"
        position_ids[start:] = torch.arange(row_len - start)
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
    )


def collate(rows: list[PackedRow]) -> dict[str, torch.Tensor]:
    """Stack rows into a batch.

    Per-token tensors get shape ``[B, row_len]``. ``cu_seqlens`` describes the batch as ONE varlen
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
    return {
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
    """
    max_len = int(batch["max_seqlen"])
    return {
        "input_ids": batch["input_ids"],
        "labels": batch["labels"],
        "position_ids": batch["position_ids"],
        "seq_idx": batch["seq_idx"],
        "cu_seq_lens_q": batch["cu_seqlens"],
        "cu_seq_lens_k": batch["cu_seqlens"],
        "max_length_q": max_len,
        "max_length_k": max_len,
    }
