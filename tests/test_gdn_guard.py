"""GDN training guards: no dead decay head at start (fresh init in fp32 above torchtitan's bound; a
checkpoint with a dead head refused in one line), packed documents isolated in the forward AND the
backward on every kernel path this CPU machine runs, and the documents per varlen batch kept under
the GDN kernels' launch limit."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.hf_fixtures import make_checkpoint
from tests.stage1_fixtures import make_data, run
from train.common import gdn_guard, varlen_attention
from train.common.fastpath import install_kernels, select_kernels
from train.common.packed_gdn import PackedGatedDeltaNet
from train.common.packing import IGNORE_INDEX, CarryPacker, Document, collate, model_kwargs
from train.common.reference_kernels import chunk_gated_delta_rule_varlen, recurrent_gated_delta_rule_varlen
from train.stage1.model import build_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_a_fresh_model_has_no_dead_head_even_in_bf16():
    torch.manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        model, _ = build_model("tiny", dtype=dtype)
        layers = gdn_guard.gdn_layers(model)
        assert len(layers) == 3 and gdn_guard.dead_heads(model) == []
        a = torch.cat([m.A_log.detach().float().exp() for _, m in layers])
        # drawn in fp32 from U(0.01, 16), then cast: bf16 rounds log(0.01) by at most 2^-8 relative
        assert a.min() >= gdn_guard.A_INIT_LOW * 0.98 and a.max() <= gdn_guard.A_INIT_HIGH * 1.02
        assert gdn_guard.check_gdn_heads(model, "the random init") == 3
    # the check can fail: a -inf A_log, a NaN dt_bias, an A below the floor, each named
    with torch.no_grad():
        layers[0][1].A_log[1] = float("-inf")
        layers[2][1].dt_bias[0] = float("nan")
        layers[2][1].A_log[3] = -20.0  # exp(-20) = 2e-9 < 1e-6
    bad = gdn_guard.dead_heads(model)
    assert bad == [f"{layers[0][0]} head 1 (A_log -inf)", f"{layers[2][0]} heads 0, 3 (A_log -20, dt_bias nan)"], bad


def test_a_checkpoint_with_a_dead_head_is_refused_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    ckpt = make_checkpoint(tmp_path / "ckpt")
    weights = next(ckpt.glob("*.safetensors"))
    state = load_file(weights)
    key = next(k for k in state if k.endswith("linear_attn.A_log"))
    state[key][2] = float("-inf")  # what a bf16 init of transformers < #47944 left in some heads
    save_file(state, weights, metadata={"format": "pt"})
    capsys.readouterr()  # the checkpoint writer's progress bar
    out = tmp_path / "run"
    rc = run(out, make_data(tmp_path), 1, "--init-from", str(ckpt), "--vision", "off",
             "--weights", '{"gen_txt": 1, "und": 1, "replay_text": 1}')
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert rc == 1 and len(err) == 1, err
    layer = key.removesuffix(".A_log")
    assert err[0].startswith(f"train.stage1: error: --init-from {ckpt}: dead gated-delta-net head(s)")
    assert err[0].endswith(f"{layer} head 2 (A_log -inf)"), err[0]
    assert not (out / "metrics.jsonl").exists() or "step" not in (out / "metrics.jsonl").read_text()
    shutil.rmtree(ckpt)


# ---------------------------------------------------------------------------------------------
# one packed document perturbed: the others' outputs and gradients do not move

ROW = 64


def _docs(first: list[int]) -> list[Document]:
    g = torch.Generator().manual_seed(3)
    rest = [torch.randint(5, 4000, (n,), generator=g).tolist() for n in (24, 40, 20)]
    return [Document(first, 0)] + [Document(t, i + 1) for i, t in enumerate(rest)]


def _batch(docs: list[Document], layout: str) -> dict:
    got = CarryPacker(layout, ROW, 2, carry_docs=1, close_below=1).batch([], iter(docs))
    assert got.carry == [] and len(got.placed) == 4  # all four whole, in one batch
    return collate(got.rows)


def _run(model, batch: dict, first_len: int):
    """Logits, parameter gradients and input-embedding gradients of the loss over every document
    but the first (its labels masked)."""
    kw = model_kwargs(batch)
    ids = kw.pop("input_ids")
    first = (batch["task_ids"] == 0)
    assert int(first.sum()) == first_len
    kw["labels"] = kw["labels"].masked_fill(first, IGNORE_INDEX)
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_()
    model.zero_grad(set_to_none=True)
    out = model(inputs_embeds=embeds, **kw)
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.logits.detach(), grads, embeds.grad, first


@pytest.fixture(scope="module")
def tiny_packed():
    torch.manual_seed(0)
    model, _ = build_model("tiny")
    install_kernels(model, select_kernels("cpu"))
    return model


@pytest.mark.parametrize("layout", ["rows", "flat"])
def test_perturbing_one_document_leaves_the_others_outputs_and_gradients(tiny_packed, layout: str):
    """The first document of a row (its tokens replaced, same length) against the rest of the
    batch, on every CPU kernel path: GDN recurrence chunked and token by token (the project's
    reference kernels), the reference conv, and full attention as sdpa with transformers'
    block-diagonal mask and as sdpa per document (varlen). Same numbers elsewhere, forward and
    backward: the others' logits, the parameter gradients of their loss, the gradient at their input
    embeddings; and no gradient of their loss reaches the perturbed document."""
    model = tiny_packed
    g = torch.Generator().manual_seed(9)
    a, b = (torch.randint(5, 4000, (30,), generator=g).tolist() for _ in range(2))
    gdn = [m for m in model.modules() if isinstance(m, PackedGatedDeltaNet)]
    for gdr in (chunk_gated_delta_rule_varlen, recurrent_gated_delta_rule_varlen):
        for attention in ("sdpa", "varlen"):
            for m in gdn:
                m.gdr_impl = gdr
            varlen_attention.use_attention(model, attention)
            logits_a, grads_a, emb_a, first = _run(model, _batch(_docs(a), layout), 30)
            logits_b, grads_b, emb_b, _ = _run(model, _batch(_docs(b), layout), 30)
            where = f"{layout}, {gdr.__name__}, {attention}"
            others = (~first) & (torch.as_tensor(_batch(_docs(a), layout)["task_ids"]) >= 0)
            assert not torch.equal(logits_a[first], logits_b[first]), where  # the perturbation is real
            torch.testing.assert_close(logits_a[others], logits_b[others], atol=1e-6, rtol=1e-6, msg=where)
            for name in grads_a:
                torch.testing.assert_close(grads_a[name], grads_b[name], atol=1e-7, rtol=1e-5, msg=f"{where}: {name}")
            torch.testing.assert_close(emb_a[others], emb_b[others], atol=1e-7, rtol=1e-5, msg=where)
            assert emb_a[first].abs().max() == 0 and emb_b[first].abs().max() == 0, where
    varlen_attention.use_attention(model, "sdpa")
    for m in gdn:
        m.gdr_impl = chunk_gated_delta_rule_varlen


def test_the_perturbation_check_catches_a_kernel_that_leaks(tiny_packed):
    """The oracle can fail: a GDN recurrence that ignores the document boundaries of a row (the state
    carried from one document into the next) moves the later documents' outputs."""
    model = tiny_packed
    gdn = [m for m in model.modules() if isinstance(m, PackedGatedDeltaNet)]

    def leaky(q, k, v, g, beta, cu_seqlens=None, **kw):
        return chunk_gated_delta_rule_varlen(q, k, v, g, beta, cu_seqlens=None, **kw)

    gen = torch.Generator().manual_seed(9)
    a, b = (torch.randint(5, 4000, (30,), generator=gen).tolist() for _ in range(2))
    try:
        for m in gdn:
            m.gdr_impl = leaky
        logits_a, _, _, first = _run(model, _batch(_docs(a), "flat"), 30)
        logits_b, _, _, _ = _run(model, _batch(_docs(b), "flat"), 30)
    finally:
        for m in gdn:
            m.gdr_impl = chunk_gated_delta_rule_varlen
    others = ~first & (_batch(_docs(a), "flat")["task_ids"] >= 0)
    assert (logits_a[others] - logits_b[others]).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------
# documents per varlen batch


def test_documents_per_varlen_batch_stay_under_the_launch_limit():
    """fla#1077: N * HV <= 65535 blocks on grid axis 1. The bound for the shapes, and the packer
    holding a stream of one-token documents to it (the padding segment counted)."""
    torch.manual_seed(0)
    model, _ = build_model("tiny")
    heads = gdn_guard.gdn_layers(model)[0][1].num_v_heads
    assert gdn_guard.max_segments(model) == 65535 // heads
    assert 65535 // 16 == 4095  # the number: 16 value heads (qwen35-2b)
    packer = CarryPacker("flat", 4096, 2, max_segments=100)
    got = packer.batch([], iter([Document([7], 0)] * 500))
    batch = collate(got.rows)
    assert batch["cu_seqlens"].numel() - 1 <= 100 and len(got.placed) == 99  # 99 documents + the padding
    assert got.carry == [] and got.drawn == 99  # the rest stays in the stream, not drawn
    unbounded = CarryPacker("flat", 4096, 2).batch([], iter([Document([7], 0)] * 500))
    assert len(unbounded.placed) == 500  # the oracle: without the bound the batch takes them all
