"""Regional compile and varlen attention against the stock model (the oracle), on the CPU.

The compiled regions re-state transformers' decoder-layer forward; the oracle is the same
weights with the stock modules. torch.compile runs with the ``aot_eager`` backend here (dynamo
graphs and AOT autograd as with inductor, no C++ build), which is what decides recompiles.
"""

from __future__ import annotations

import copy

import pytest
import torch

from train.common import varlen_attention
from train.common.fastpath import install_kernels, select_kernels
from train.common.metrics import compile_counts
from train.common.packing import Packer, collate, model_kwargs
from train.common.regional_compile import apply_regional_compile, compile_enabled, configure_cache_dir
from train.stage1.model import build_model

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def batches(n: int, row_len: int = 128, rows: int = 2, seed: int = 1, flat: bool = False) -> list[dict]:
    """``n`` packed batches of different document boundaries (the shapes stay fixed)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lengths = torch.randint(5, row_len, (12,), generator=g).tolist()
        docs = [(torch.randint(1, 4000, (m,), generator=g).tolist(), i % 5) for i, m in enumerate(lengths)]
        packer = Packer(row_len=row_len * rows if flat else row_len, open_rows=1)
        out.append(collate(list(packer.pack(docs))[:1 if flat else rows]))
    return out


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    stock, _ = build_model("tiny")
    install_kernels(stock, select_kernels("cpu"))
    compiled = copy.deepcopy(stock)
    torch._dynamo.reset()
    assert apply_regional_compile(compiled, backend="aot_eager") == 4
    return stock, compiled


def loss_and_grads(model, batch) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad()
    out = model(**model_kwargs(batch))
    out.loss.backward()
    return out.logits.detach(), out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                                     if p.grad is not None}


def test_compiled_regions_match_the_stock_model_without_recompiles(models):
    stock, compiled = models
    seen = batches(4)
    _, recompiles0 = compile_counts()
    for i, batch in enumerate(seen):
        want = loss_and_grads(stock, batch)
        got = loss_and_grads(compiled, batch)
        torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)
        assert got[2].keys() == want[2].keys()
        for name in want[2]:
            torch.testing.assert_close(got[2][name], want[2][name], atol=1e-5, rtol=1e-3, msg=name)
        if i == 0:
            graphs_after_first, _ = compile_counts()
    graphs, recompiles = compile_counts()
    assert recompiles == recompiles0  # new document boundaries every batch, never a recompile
    assert graphs == graphs_after_first and graphs >= 6  # every region compiled at the first step, once


def test_varlen_attention_matches_the_block_diagonal_mask(models):
    stock, _ = models
    model = copy.deepcopy(stock)
    varlen_attention.use_attention(model, "varlen")
    for flat in (False, True):
        for batch in batches(2, flat=flat):
            varlen_attention.use_attention(stock, "sdpa")
            want = loss_and_grads(stock, batch)
            got = loss_and_grads(model, batch)
            torch.testing.assert_close(got[0], want[0], atol=2e-5, rtol=1e-4)
            for name in ("model.layers.3.self_attn.q_proj.weight", "model.layers.3.self_attn.k_proj.weight"):
                torch.testing.assert_close(got[2][name], want[2][name], atol=1e-5, rtol=1e-3, msg=name)


def test_varlen_attention_keeps_documents_apart():
    """The oracle can fail: attention over the whole row (no boundaries) gives other outputs."""
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 4, 40, 16, generator=g), torch.randn(1, 2, 40, 16, generator=g), torch.randn(1, 2, 40, 16,
                                                                                                        generator=g)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32)
    out, _ = varlen_attention.varlen_attention_forward(None, q, k, v, None, cu_seq_lens_q=cu, max_length_q=25)
    for a, b in ((0, 15), (15, 40)):
        alone = torch.nn.functional.scaled_dot_product_attention(q[..., a:b, :], k[..., a:b, :], v[..., a:b, :],
                                                                 is_causal=True, enable_gqa=True)
        torch.testing.assert_close(out[:, a:b], alone.transpose(1, 2), atol=1e-6, rtol=1e-5)
    whole, _ = varlen_attention.varlen_attention_forward(None, q, k, v, None)
    assert (whole[:, 15:] - out[:, 15:]).abs().max() > 1e-3


def test_compile_and_attention_defaults_by_device(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert not compile_enabled("auto", cpu) and compile_enabled("auto", cuda)  # the tiny demo never compiles
    assert compile_enabled("on", cpu) and not compile_enabled("off", cuda)
    assert varlen_attention.select_attention("auto", cpu) == "sdpa"
    assert varlen_attention.select_attention("auto", cuda) == "varlen"
    with pytest.raises(ValueError, match="unknown compile mode"):
        compile_enabled("maybe", cpu)
    env = {"TRITON_CACHE_DIR": "/scratch/cache/alice/triton"}
    assert configure_cache_dir(env) == "/scratch/cache/alice/torchinductor"
    env = {"TRITON_CACHE_DIR": "/a/triton", "TORCHINDUCTOR_CACHE_DIR": "/b/inductor"}
    assert configure_cache_dir(env) == "/b/inductor"


def test_activation_checkpointing_recomputes_and_keeps_gradients(models):
    from train.common.regional_compile import apply_activation_checkpointing, checkpointed_layers

    assert checkpointed_layers(24, 6) == [0, 4, 8, 12, 16, 20] and checkpointed_layers(4, 0) == []
    assert checkpointed_layers(4, 9) == [0, 1, 2, 3]
    stock, compiled = models
    ckpt = copy.deepcopy(stock)
    assert apply_activation_checkpointing(ckpt, 2) == [0, 2]
    calls = []
    ckpt.model.layers[0].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    batch = batches(1)[0]
    want = loss_and_grads(stock, batch)
    got = loss_and_grads(ckpt, batch)
    assert len(calls) == 2  # forward, then the recompute in the backward
    torch.testing.assert_close(got[1], want[1])
    for name in want[2]:
        torch.testing.assert_close(got[2][name], want[2][name], atol=1e-6, rtol=1e-5, msg=name)


def test_checkpointing_over_compiled_regions(models):
    """--compile and --act-ckpt together: the recompute runs the compiled regions again (last test of
    the module: it wraps the shared compiled model's layers)."""
    from train.common.regional_compile import apply_activation_checkpointing

    stock, compiled = models
    apply_activation_checkpointing(compiled, 4)
    _, recompiles0 = compile_counts()
    for batch in batches(2, seed=7):
        want, got = loss_and_grads(stock, batch), loss_and_grads(compiled, batch)
        torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)
        for name in want[2]:
            torch.testing.assert_close(got[2][name], want[2][name], atol=1e-5, rtol=1e-3, msg=name)
    assert compile_counts()[1] == recompiles0


def test_torch_varlen_check_reports_why_it_is_not_used():
    """Where torch's varlen kernel cannot run (here: a CPU), the check says why, and the layer
    falls back to sdpa per document, which the header names."""
    problem = varlen_attention.check_torch_varlen(torch.device("cpu"))
    assert problem  # torch's flash-attention varlen kernel is CUDA-only
    assert varlen_attention.describe("varlen", torch.device("cpu")).startswith("varlen: sdpa per document")


def test_compiled_vision_tower_on_varlen_equals_transformers_tower():
    """The tower's blocks compiled around one varlen attention call (the patch dimension dynamic)
    against transformers' stock tower (per-image sdpa): outputs and gradients, over steps whose
    image counts and grids vary, through the graphs of step 1 alone. Step 1's patch total is the
    tower's width (64) and step 4's its head size (32): with every dimension dynamic, dynamo's
    duck sizing tied the patch count to the width in step 1 and compiled again in step 2."""
    from train.common.regional_compile import apply_vision_regional_compile
    from train.common.shapes import get_shape
    from train.stage1.tokenizer import build_tokenizer

    torch._dynamo.reset()
    tok = build_tokenizer(get_shape("tiny"), None, vision=True)
    ref, _ = build_model("tiny", vision=True, vision_ids=tok.vision_ids)
    fast = copy.deepcopy(ref)
    assert apply_vision_regional_compile(fast, backend="aot_eager") == 0  # not on varlen: left as it is
    assert varlen_attention.use_vision_varlen(fast)
    assert apply_vision_regional_compile(fast, backend="aot_eager") == len(fast.model.visual.blocks) == 2
    g = torch.Generator().manual_seed(0)
    base = compile_counts()  # the counters are the process's: other tests' graphs are in them
    compiles = []
    for grid in ([[1, 8, 8]], [[1, 4, 4], [1, 6, 4], [1, 8, 8]], [[1, 8, 4], [1, 4, 4]], [[1, 4, 8]], [[1, 4, 4]] * 4):
        grid = torch.tensor(grid)
        pixels = torch.randn(int(grid.prod(-1).sum()), 3 * 2 * 8 * 8, generator=g)
        outs, grads = [], []
        for m in (fast, ref):
            m.zero_grad()
            out = m.model.visual(pixels, grid_thw=grid).pooler_output
            out.square().sum().backward()
            outs.append(out)
            grads.append({n: p.grad.clone() for n, p in m.model.visual.named_parameters() if p.grad is not None})
        torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
        for name in grads[1]:
            torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-4, atol=1e-5, msg=name)
        compiles.append(compile_counts())
    assert all(c == compiles[0] for c in compiles)  # no graph and no recompile after step 1
    assert compiles[0][0] - base[0] <= 4  # vision_pre and vision_post, each at most for a view and a tensor input
