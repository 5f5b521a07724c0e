"""Packer invariants, the long-document rule, determinism, efficiency and collate."""

from __future__ import annotations

import random

import pytest
import torch

from train.common.packing import IGNORE_INDEX, Packer, build_row, collate, model_kwargs


def random_docs(n: int, seed: int, max_len: int = 300, n_tasks: int = 5) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    docs = []
    for _ in range(n):
        length = rng.randint(1, max_len)
        docs.append(([rng.randint(1, 999) for _ in range(length)], rng.randrange(n_tasks)))
    return docs


def segments(row) -> list[tuple[int, int]]:
    cu = row.cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:], strict=True))


def check_row_invariants(row, row_len: int, pad_id: int) -> None:
    assert row.input_ids.shape == row.labels.shape == row.position_ids.shape == (row_len,)
    assert row.seq_idx.dtype == torch.int32 and row.cu_seqlens.dtype == torch.int32
    assert row.cu_seqlens[0] == 0 and row.cu_seqlens[-1] == row_len
    assert (row.cu_seqlens[1:] > row.cu_seqlens[:-1]).all()
    n_real = row.n_real_tokens
    for s_i, (a, b) in enumerate(segments(row)):
        assert (row.seq_idx[a:b] == s_i).all()
        assert torch.equal(row.position_ids[a:b], torch.arange(b - a))
        is_padding = a >= n_real
        if is_padding:
            assert (row.input_ids[a:b] == pad_id).all()
            assert (row.labels[a:b] == IGNORE_INDEX).all()
            assert (row.task_ids[a:b] == -1).all()
        else:
            assert b <= n_real
            assert row.labels[a] == IGNORE_INDEX  # no prediction across a document boundary
            assert torch.equal(row.labels[a + 1 : b], row.input_ids[a + 1 : b])
            assert (row.task_ids[a:b] == row.task_ids[a]).all() and row.task_ids[a] >= 0


def test_row_invariants_and_no_token_lost():
    docs = random_docs(200, seed=1)
    packer = Packer(row_len=512, pad_id=0)
    rows = list(packer.pack(docs))
    for row in rows:
        check_row_invariants(row, 512, 0)
    # every document appears exactly once, intact (all docs < row_len here)
    packed_docs = sorted(
        tuple(row.input_ids[a:b].tolist()) for row in rows for a, b in segments(row) if a < row.n_real_tokens
    )
    assert packed_docs == sorted(tuple(d) for d, _ in docs)
    assert packer.real_tokens == sum(len(d) for d, _ in docs)


def test_long_document_is_split_into_row_sized_documents():
    long_doc = list(range(1, 1301))  # 1300 tokens, row_len 512 -> 512 + 512 + 276
    rows = list(Packer(row_len=512, open_rows=1).pack([(long_doc, 3)]))
    assert [r.n_real_tokens for r in rows] == [512, 512, 276]
    assert torch.cat([r.input_ids[: r.n_real_tokens] for r in rows]).tolist() == long_doc
    for row in rows:
        check_row_invariants(row, 512, 0)
        assert row.position_ids[0] == 0 and row.labels[0] == IGNORE_INDEX


def test_truncate_rule_drops_the_tail_and_counts_it():
    packer = Packer(row_len=64, long_doc="truncate")
    rows = list(packer.pack([(list(range(1, 101)), 0)]))
    assert len(rows) == 1 and rows[0].input_ids.tolist() == list(range(1, 65))
    assert packer.dropped_tokens == 36


def test_padding_is_its_own_segment():
    row = build_row([([5, 6, 7], 1), ([8, 9], 2)], row_len=8, pad_id=0)
    assert row.cu_seqlens.tolist() == [0, 3, 5, 8]
    assert row.seq_idx.tolist() == [0, 0, 0, 1, 1, 2, 2, 2]
    assert row.position_ids.tolist() == [0, 1, 2, 0, 1, 0, 1, 2]
    assert row.labels.tolist() == [-100, 6, 7, -100, 9, -100, -100, -100]
    assert row.task_ids.tolist() == [1, 1, 1, 2, 2, -1, -1, -1]
    full = build_row([([5, 6, 7, 8], 0)], row_len=4)
    assert full.cu_seqlens.tolist() == [0, 4] and full.n_real_tokens == 4


def test_deterministic():
    docs = random_docs(300, seed=7)
    a = list(Packer(row_len=1024).pack(docs))
    b = list(Packer(row_len=1024).pack(docs))
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x.input_ids, y.input_ids) and torch.equal(x.cu_seqlens, y.cu_seqlens)


def test_efficiency_first_fit_beats_sequential_fill():
    docs = random_docs(400, seed=3, max_len=700)
    seq = Packer(row_len=1024, open_rows=1)
    ff = Packer(row_len=1024, open_rows=8)
    n_seq, n_ff = len(list(seq.pack(docs))), len(list(ff.pack(docs)))
    total = sum(len(d) for d, _ in docs)
    assert ff.efficiency == pytest.approx(total / (n_ff * 1024))
    assert seq.efficiency == pytest.approx(total / (n_seq * 1024))
    assert ff.efficiency > seq.efficiency
    assert ff.efficiency > 0.9


def test_bad_arguments():
    with pytest.raises(ValueError, match="long_doc"):
        Packer(long_doc="drop")
    with pytest.raises(ValueError, match="does not fit"):
        build_row([([1] * 5, 0)], row_len=4)


def test_collate_flattens_segments_over_the_batch():
    r0 = build_row([([1, 2, 3, 4], 0)], row_len=4)  # one segment, no padding
    r1 = build_row([([5, 6], 1)], row_len=4)  # doc + padding
    batch = collate([r0, r1])
    assert batch["input_ids"].shape == (2, 4)
    assert batch["cu_seqlens"].tolist() == [0, 4, 6, 8]
    assert batch["cu_seqlens"].dtype == torch.int32
    # global numbering: row 1's first segment must not share row 0's index
    assert batch["seq_idx"].tolist() == [[0, 0, 0, 0], [1, 1, 2, 2]]
    assert int(batch["max_seqlen"]) == 4 and int(batch["n_real_tokens"]) == 6
    kwargs = model_kwargs(batch)
    assert kwargs["cu_seq_lens_q"] is batch["cu_seqlens"] and kwargs["max_length_q"] == 4


def test_filling_a_later_open_row_with_image_documents():
    """A row that fills up is removed from the open rows by identity: comparing rows compares
    their documents, and two equal documents compare their images' tensors (a crash seen in a
    2-rank stage-1 run)."""
    from train.common.packing import Document, ImageInput

    def doc(n: int) -> Document:
        img = ImageInput(torch.zeros(4, 3), (1, 2, 2), 2, start=0)  # 1 placeholder token, own tensor
        return Document(list(range(1, n + 1)), 0, [img])

    # rows of 10: A+X leave row 1 one token short; a second A opens row 2; Z fits only row 2 and
    # fills it, so row 2 is removed while row 1 (two documents, the first equal to row 2's) is open
    rows = list(Packer(row_len=10, open_rows=4).pack([doc(4), doc(5), doc(4), doc(6)]))
    assert sorted(r.n_real_tokens for r in rows) == [9, 10]
