"""THE ORACLE: a packed row must compute exactly what its documents compute one at a time.

Model: the ``tiny`` Qwen3.5 hybrid (3 GDN + 1 full-attention layer, transformers' own classes),
fp32 on CPU. Packed: the project's reference kernels installed via ``install_kernels``.
Reference: the SAME weights in transformers' stock modules, each document run alone (its torch
fallbacks are correct for a single unpacked sequence). The kernel-level tests compare the chunked
reference recurrence with the token-by-token one and with transformers' own chunked function.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from train.common.fastpath import install_kernels, select_kernels
from train.common.packed_gdn import PackedGatedDeltaNet
from train.common.packing import Packer, collate, layout_packer, model_kwargs
from train.common.reference_kernels import (
    causal_conv1d_varlen,
    chunk_gated_delta_rule_varlen,
    recurrent_gated_delta_rule_varlen,
)
from train.stage1.model import build_model

ROW_LEN = 256


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    stock, _ = build_model("tiny")
    stock.eval()
    packed = copy.deepcopy(stock)
    assert install_kernels(packed, select_kernels("cpu")) == 3
    return stock, packed


@pytest.fixture(scope="module")
def packed_batch():
    g = torch.Generator().manual_seed(1)

    def doc(n: int) -> list[int]:
        return torch.randint(1, 4000, (n,), generator=g).tolist()

    # 300 tokens > ROW_LEN: split into a full 256-token row and a 44-token piece.
    docs = [(doc(60), 0), (doc(300), 1), (doc(100), 2), (doc(5), 3)]
    rows = list(Packer(row_len=ROW_LEN).pack(docs))
    assert [r.n_real_tokens for r in rows] == [256, 209]  # one full row, one row with a padding tail
    return docs, rows, collate(rows)


def documents_of(rows) -> list[tuple[int, int, int]]:
    """(row, start, end) of every real document segment."""
    out = []
    for r_i, row in enumerate(rows):
        cu = row.cu_seqlens.tolist()
        out += [(r_i, a, b) for a, b in zip(cu[:-1], cu[1:], strict=True) if a < row.n_real_tokens]
    return out


def test_packed_logits_and_loss_equal_documents_run_alone(models, packed_batch):
    stock, packed = models
    docs, rows, batch = packed_batch
    with torch.no_grad():
        out = packed(**model_kwargs(batch))
    segments = documents_of(rows)
    assert len(segments) == 5  # 4 documents, one of them split in two
    ce_sum, n_targets = torch.zeros(()), 0
    for r_i, a, b in segments:
        ids = batch["input_ids"][r_i : r_i + 1, a:b]
        with torch.no_grad():
            alone = stock(input_ids=ids).logits
        torch.testing.assert_close(out.logits[r_i : r_i + 1, a:b], alone, atol=1e-5, rtol=1e-4)
        if b - a > 1:
            ce_sum += F.cross_entropy(alone[0, :-1], ids[0, 1:], reduction="sum")
            n_targets += b - a - 1
    assert int((batch["labels"] != -100).sum()) == n_targets
    torch.testing.assert_close(out.loss, ce_sum / n_targets, atol=1e-5, rtol=1e-5)


def test_flat_layout_equals_documents_run_alone(models, packed_batch):
    """The flat layout: the same documents as ONE stream of 2 x ROW_LEN tokens ([1, 512])."""
    stock, packed = models
    docs, _, _ = packed_batch
    rows = list(layout_packer("flat", row_len=ROW_LEN, batch_rows=2, close_below=1).pack(docs))
    assert len(rows) == 1 and rows[0].n_real_tokens == 465  # 60 + 256 + 44 + 100 + 5: docs cross the row boundary
    batch = collate(rows)
    assert batch["input_ids"].shape == (1, 2 * ROW_LEN)
    with torch.no_grad():
        out = packed(**model_kwargs(batch))
    segments = documents_of(rows)
    assert len(segments) == 5 and max(b - a for _, a, b in segments) == ROW_LEN
    ce_sum, n_targets = torch.zeros(()), 0
    for _, a, b in segments:
        ids = batch["input_ids"][:, a:b]
        with torch.no_grad():
            alone = stock(input_ids=ids).logits
        torch.testing.assert_close(out.logits[:, a:b], alone, atol=1e-5, rtol=1e-4)
        ce_sum += F.cross_entropy(alone[0, :-1], ids[0, 1:], reduction="sum")
        n_targets += b - a - 1
    torch.testing.assert_close(out.loss, ce_sum / n_targets, atol=1e-5, rtol=1e-5)


def test_packed_gradients_equal_per_document_gradients(models, packed_batch):
    stock, packed = models
    _, rows, batch = packed_batch
    packed.zero_grad()
    packed(**model_kwargs(batch)).loss.backward()
    stock.zero_grad()
    segments = documents_of(rows)
    n_targets = int((batch["labels"] != -100).sum())
    for r_i, a, b in segments:
        ids = batch["input_ids"][r_i : r_i + 1, a:b]
        if b - a > 1:
            logits = stock(input_ids=ids).logits
            (F.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="sum") / n_targets).backward()
    for name in ("model.layers.0.linear_attn.A_log", "model.layers.1.linear_attn.conv1d.weight",
                 "model.layers.3.self_attn.q_proj.weight", "model.embed_tokens.weight"):
        p_packed = dict(packed.named_parameters())[name].grad
        p_stock = dict(stock.named_parameters())[name].grad
        torch.testing.assert_close(p_packed, p_stock, atol=1e-6, rtol=1e-4, msg=name)
    packed.zero_grad()
    stock.zero_grad()


def test_without_reference_kernels_packing_is_refused_or_wrong(models, packed_batch):
    """The oracle can fail: transformers' fallback refuses the varlen kwargs, and given only
    position_ids (attention masked per document, GDN not) its output differs from the oracle."""
    stock, packed = models
    _, rows, batch = packed_batch
    with pytest.raises(ValueError, match="can't keep packed sequences apart"):
        stock(**model_kwargs(batch))
    with torch.no_grad():
        leaky = stock(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits
        right = packed(**model_kwargs(batch)).logits
    r_i, a, b = documents_of(rows)[2]  # a later document of the second row: sees its predecessors
    assert a > 0
    assert (leaky[r_i, a:b] - right[r_i, a:b]).abs().max() > 1e-3


def test_packed_layer_is_installed_in_place(models):
    stock, packed = models
    layer = packed.model.layers[0].linear_attn
    assert isinstance(layer, PackedGatedDeltaNet)
    assert layer.gdr_impl is chunk_gated_delta_rule_varlen and layer.conv_impl is causal_conv1d_varlen
    assert packed.state_dict().keys() == stock.state_dict().keys()


def random_gdr_inputs(t: int, seed: int, h: int = 2, hv: int = 4, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, t, h, d, generator=g) for _ in range(2))
    v = torch.randn(1, t, hv, d, generator=g)
    decay = -F.softplus(torch.randn(1, t, hv, generator=g))
    beta = torch.rand(1, t, hv, generator=g)
    return q, k, v, decay, beta


def test_chunked_equals_recurrent_with_resets():
    q, k, v, g, beta = random_gdr_inputs(200, seed=2)
    cu = torch.tensor([0, 1, 70, 134, 200], dtype=torch.int32)  # a 1-token doc, a 64-token doc, ragged rest
    chunked = chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    recurrent = recurrent_gated_delta_rule_varlen(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(chunked, recurrent, atol=2e-5, rtol=1e-4)
    # the state really resets: the third document alone gives the same output
    alone = chunk_gated_delta_rule_varlen(*(x[:, 70:134] for x in (q, k, v, g, beta)), use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(chunked[:, 70:134], alone, atol=1e-6, rtol=1e-5)


def test_chunked_matches_transformers_on_one_sequence():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    q, k, v, g, beta = random_gdr_inputs(150, seed=3)
    theirs, _ = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=True)
    ours = chunk_gated_delta_rule_varlen(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-4)


def test_conv_does_not_leak_across_documents():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(1, 8, 30, generator=g)
    w = torch.randn(8, 4, generator=g)
    seq_idx = torch.tensor([[0] * 10 + [1] * 2 + [2] * 18], dtype=torch.int32)
    out = causal_conv1d_varlen(x, w, activation="silu", seq_idx=seq_idx)
    for a, b in ((0, 10), (10, 12), (12, 30)):
        alone = F.silu(F.conv1d(x[..., a:b], w.unsqueeze(1), padding=3, groups=8)[..., : b - a])
        torch.testing.assert_close(out[..., a:b], alone, atol=1e-6, rtol=1e-5)
    unpacked = causal_conv1d_varlen(x, w, activation="silu")
    assert (unpacked[..., 10:13] - out[..., 10:13]).abs().max() > 1e-3


def test_cached_generation_goes_through_transformers_cache_path(models):
    """The packed layer hands a decoding step with a cache to transformers' own GDN forward (the
    kwarg is ``cache`` from transformers 5.24, ``cache_params`` before): greedy generation with
    the cache equals the stock model's, and each cached step's logits equal a full forward's."""
    stock, packed = models
    prompt = torch.randint(1, 4000, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = stock.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True)
        got = packed.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=True, output_logits=True,
                              return_dict_in_generate=True)
        assert torch.equal(got.sequences, want)
        full = stock(input_ids=got.sequences[:, :-1], use_cache=False).logits[0, prompt.shape[1] - 1:]
    torch.testing.assert_close(torch.cat(got.logits), full, atol=1e-4, rtol=1e-4)
