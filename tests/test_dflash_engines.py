"""The DFlash export against the serving engines' own code: SGLang's released parsing code executed
(tests/engine_code.py), vLLM's followed at a named commit (tests/dflash_serving.py). For each engine,
fed the exported config, the attention it would run equals the trainer's mask, layer by layer; a
tiny [sliding, full] drafter trained on CPU drafts in the engine-style loader the trainer's tokens.
Also: the published Qwen3.6-27B layout as a preset, sliding layers causal inside the block (a
perturbation test) and the window in both attention paths (dense chunked, block-sparse flex)."""

from __future__ import annotations

import json

import pytest
import torch
from dflash_serving import (
    ServingDrafter,
    flash_mask,
    hf_config,
    layer_layouts,
    sglang_capture_layers,
    sglang_layouts,
    vllm_capture_layers,
    vllm_layer_attention,
    vllm_layouts,
)
from engine_code import EngineCodeUnavailable, SGLangCode, sglang_sources

from train.dflash import train as dflash_train
from train.dflash.export import hf_config as export_config
from train.dflash.export import readme, write_export
from train.dflash.model import (
    FULL,
    SLIDING,
    BlockAttention,
    Drafter,
    DrafterConfig,
    TargetShape,
    block_inputs,
    default_drafter,
    drafter_config,
    sample_anchors,
)
from train.extract.extract import default_layers

# Qwen3.6-27B's text config, as far as the drafter takes it (hidden 5120, 64 layers, MLP 17,408)
QWEN36_27B = TargetShape(hidden_size=5120, num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4,
                         head_dim=256, intermediate_size=17408, vocab_size=248320, rope_theta=1e7,
                         max_position_embeddings=262144)
ENGINES = ("vllm", "sglang")


@pytest.fixture(scope="module")
def sglang() -> SGLangCode:
    """SGLang's parsing code from its release on PyPI (downloaded once into the test cache)."""
    try:
        return SGLangCode(sglang_sources())
    except EngineCodeUnavailable as exc:
        pytest.skip(f"SGLang's released code could not be fetched, so its parsing cannot run: {exc}")


def write_config(cfg: DrafterConfig, out) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(export_config(cfg), indent=2))
    (out / "README.md").write_text(readme(cfg))


def trainer_masks(cfg: DrafterConfig, n_ctx: int) -> list[torch.Tensor]:
    """Per layer [K, n_ctx + K]: what the trainer's BlockAttention lets a block anchored after n_ctx
    context positions see (context, then its own slots)."""
    k = cfg.block_size
    attend = BlockAttention(torch.tensor([[n_ctx]]), torch.tensor([n_ctx + 1]), n_ctx, k)
    masks = []
    for i in range(cfg.num_layers):
        window = cfg.layer_window(i)
        block = attend.see_block(window)
        block = torch.ones(k, k, dtype=torch.bool) if block is None else block
        masks.append(torch.cat([attend.see_context(0, 1, window)[0], block], dim=1))
    return masks


def engine_masks(export_dir, engine: str, sglang: SGLangCode, n_ctx: int, k: int, target_layers: int
                 ) -> tuple[list[torch.Tensor], list[int]]:
    layouts, capture = layer_layouts(export_dir, engine, target_layers, sglang)
    return [flash_mask(layout, n_ctx, k) for layout in layouts], capture


def test_qwen36_27b_preset_is_the_published_layout_and_both_engines_read_its_export(tmp_path, sglang):
    """`--drafter auto` on a Qwen3.6-27B-shaped target: 5 layers, 32 x 128 heads / 8 KV, MLP 17,408,
    [sliding x4, full] with a 2,048 window, block 16, mask 248070, layers [1, 16, 31, 46, 61], untied.
    Its config.json (weights are 1.7 B parameters: the config alone) parsed by transformers, then
    by each engine's code: the sliding layers a causal flash-attn call with window (2047, 0), the
    full one bidirectional and unbounded; capture hidden_states[id + 1]; vLLM refuses the mixed
    layout without the V2 runner, whose flag README.md names. With 2,100 context positions (the
    window bites) every layer's mask equals the trainer's."""
    assert default_drafter(QWEN36_27B) == "qwen3.6-27b"
    layers = default_layers(64, 5)
    cfg = drafter_config(default_drafter(QWEN36_27B), QWEN36_27B, layers, 16)
    cfg.mask_token_id = dflash_train.resolve_mask_token("auto", QWEN36_27B.vocab_size, None)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size) == (
        5, 5120, 32, 8, 128, 17408)
    assert cfg.layer_types == [SLIDING] * 4 + [FULL] and cfg.sliding_window == 2048
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (16, 248070, [1, 16, 31, 46, 61])
    out = tmp_path / "export"
    write_config(cfg, out)
    hf = hf_config(out)
    assert hf.tie_word_embeddings is False and hf.architectures == ["DFlashDraftModel"]
    assert hf.sliding_window == 2048  # transformers keeps it only with use_sliding_window
    # no key sets one causality for every layer (vLLM would apply it to the full layer too)
    assert getattr(hf, "is_causal", None) is None and "causal" not in hf.dflash_config

    served = [(True, (2047, 0))] * 4 + [(False, (-1, -1))]
    assert [vllm_layer_attention(hf, i, v2_runner=True) for i in range(5)] == [(2048, True)] * 4 + [(None, False)]
    assert vllm_layouts(hf) == served
    with pytest.raises(NotImplementedError, match="VLLM_USE_V2_MODEL_RUNNER=1"):
        vllm_layer_attention(hf, 0, v2_runner=False)
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in (out / "README.md").read_text()
    assert vllm_capture_layers(hf) == [2, 17, 32, 47, 62]
    del hf.eagle_aux_hidden_state_layer_ids  # older configs: vLLM adds the 1 itself
    assert vllm_capture_layers(hf) == [2, 17, 32, 47, 62]

    hf = hf_config(out)
    assert sglang_layouts(hf, sglang) == served
    assert [sglang.layer_attention(hf, i)[0] for i in range(5)] == [2047] * 4 + [-1]  # window_left = W - 1
    assert sglang_capture_layers(hf, sglang, 64) == [2, 17, 32, 47, 62]
    parsed = sglang.draft_config(hf)
    assert (parsed.block_size, parsed.mask_token_id, parsed.num_target_layers) == (16, 248070, 64)

    want = trainer_masks(cfg, 2100)
    for engine in ENGINES:
        masks, _ = engine_masks(out, engine, sglang, 2100, 16, 64)
        for i, (got, mine) in enumerate(zip(masks, want, strict=True)):
            assert torch.equal(got, mine), (engine, i)


@pytest.mark.parametrize(("types", "window", "k"), [
    ([SLIDING, FULL], 6, 8),  # the window cuts the block too
    ([SLIDING, SLIDING], 24, 16),
    ([FULL, SLIDING], 3, 4),
    ([FULL, FULL], None, 8),
])
def test_each_engine_fed_the_export_runs_the_trainers_mask(tmp_path, sglang, types, window, k):
    """Layer by layer, the flash-attn call each engine's code makes for the exported config masks
    exactly what the trainer's BlockAttention does, after a 20-position context; and fc reads the
    hidden states the trainer captured (target layer + 1). The control, that this comparison can
    fail: with the keys an earlier export wrote (`is_causal: false`, `dflash_config.causal: false`)
    SGLang's code runs a sliding layer bidirectional within the window (ENCODER_ONLY: (W-1, W-1)),
    while vLLM's FlashAttention backend still runs it causal (right bound 0, whatever `causal`
    says): the engines disagreed, and neither ran the earlier trainer's bidirectional block."""
    cfg = DrafterConfig(**{**drafter_config("tiny", SHAPE, [1, 2], k).__dict__, "layer_types": types,
                           "sliding_window": window})
    out = tmp_path / "export"
    write_config(cfg, out)
    want = trainer_masks(cfg, 20)
    for engine in ENGINES:
        masks, capture = engine_masks(out, engine, sglang, 20, k, SHAPE.num_hidden_layers)
        assert capture == [2, 3], engine
        for i, (got, mine) in enumerate(zip(masks, want, strict=True)):
            assert torch.equal(got, mine), (engine, i, got.int(), mine.int())

    old = json.loads((out / "config.json").read_text())
    old["is_causal"] = False
    old["dflash_config"]["causal"] = False
    (out / "config.json").write_text(json.dumps(old))
    differs = {engine: [not torch.equal(got, mine) for got, mine in
                        zip(engine_masks(out, engine, sglang, 20, k, SHAPE.num_hidden_layers)[0], want, strict=True)]
               for engine in ENGINES}
    assert differs == {"sglang": [t == SLIDING for t in types], "vllm": [False] * len(types)}, differs


SHAPE = TargetShape(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=128, vocab_size=300, rope_theta=1e7)


def windowed(types: list[str], window: int, block: int) -> DrafterConfig:
    cfg = drafter_config("tiny", SHAPE, [1, 2], block)
    cfg.layer_types, cfg.sliding_window = types, window
    return DrafterConfig(**{**cfg.__dict__})  # validated again


@pytest.mark.parametrize("engine", ENGINES)
def test_tiny_sliding_window_export_drafts_the_same_block_in_the_engine_loader_as_in_the_trainer(
        tmp_path, engine, sglang):
    """[sliding (window 6), full] with K=4 after a 30-token context: the window bites (30 > 6). The
    engine-style loader, reading the export as `engine` does, gives the trainer's block states and
    drafts; a drafter with the window left out gives other states (the window is in the mask)."""
    torch.manual_seed(0)
    k, n = 4, 30
    drafter = Drafter(windowed([SLIDING, FULL], 6, k)).eval()
    out = write_export(drafter, tmp_path / "export", dtype=torch.float32)
    embed, lm_head = torch.randn(300, 64), torch.randn(300, 64)
    serving = ServingDrafter(out, embed, lm_head, engine=engine, sglang=sglang)
    assert serving.layouts == [(True, (5, 0)), (False, (-1, -1))] and serving.capture == [2, 3]
    ctx = torch.randn(n, 2 * 64)
    anchor = 17
    hidden = torch.cat([ctx, torch.zeros(1, 128)])[None]  # the anchor's own state: not there yet
    block = embed[torch.tensor([anchor] + [drafter.cfg.mask_token_id] * (k - 1))][None, None]
    with torch.no_grad():
        mine = drafter(hidden, block, torch.tensor([[n]]), torch.tensor([n + 1]))[0, 0]
        theirs = serving.block_states(ctx, anchor)
        full = Drafter(windowed([FULL, FULL], 6, k)).eval()
        full.load_state_dict(drafter.state_dict())
        unwindowed = full(hidden, block, torch.tensor([[n]]), torch.tensor([n + 1]))[0, 0]
    torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=1e-5)
    assert (mine[1:] @ lm_head.T).argmax(-1).tolist() == serving.draft(ctx, anchor)
    assert (unwindowed - mine).abs().max() > 1e-3


@pytest.mark.parametrize("impl", ["dense", "flex"])
def test_sliding_layers_are_causal_in_the_block_and_full_layers_are_not(impl):
    """What the engines serve: in a sliding-window layer (window 24 > K, so only causality narrows
    the block) perturbing block slot 8's input leaves slots 0..7 bitwise unchanged and moves every
    later slot; in a full-attention layer it moves all 16 slots. The other anchor's block never
    moves. Each attention implementation (dense chunked, block-sparse flex: the mask CUDA compiles)."""
    torch.manual_seed(0)
    k, n = 16, 40
    base = drafter_config("tiny", SHAPE, [1, 2], k)
    for types, first_moved in (([SLIDING], 8), ([FULL], 0)):
        cfg = DrafterConfig(**{**base.__dict__, "num_layers": 1, "layer_types": types, "sliding_window": 24})
        drafter = Drafter(cfg).eval()
        hidden, x = torch.randn(1, n, 128), torch.randn(1, 2, k, 64)
        anchors, lengths = torch.tensor([[20, 31]]), torch.tensor([n])
        poked = x.clone()
        poked[0, 0, 8] += 1.0
        with torch.no_grad():
            out = drafter(hidden, x, anchors, lengths, attn_impl=impl)
            moved = (drafter(hidden, poked, anchors, lengths, attn_impl=impl) - out).abs().amax(-1)[0]
        assert moved[0, :first_moved].eq(0).all(), (types, moved[0])
        assert (moved[0, first_moved:] > 1e-4).all(), (types, moved[0])
        assert moved[1].eq(0).all()


@pytest.mark.parametrize("window", [None, 24, 5])
def test_dense_and_flex_agree_in_fp32_with_and_without_sliding_windows(window):
    """The same batch (2 rows of unequal length, a loss mask, 24 anchors, K=16) through the dense
    chunked attention and block-sparse flex (eager on the CPU: the mask's rule, not the kernel), in
    fp32: equal within fp32 rounding. Window 24 cuts the context; 5 (< K) also the block. Under
    an all-sliding drafter, the state W positions before an anchor never reaches its block; the
    one just before it does."""
    torch.manual_seed(0)
    types = [FULL, FULL] if window is None else [SLIDING, SLIDING]
    cfg = windowed(types, window or 1, 16)
    drafter = Drafter(cfg).eval()
    n = 200
    lengths = torch.tensor([n, 90])
    loss_mask = torch.zeros(2, n, dtype=torch.bool)
    loss_mask[0, 40:] = True
    loss_mask[1, 30:90] = True
    anchors = sample_anchors(lengths, 24, 16, torch.Generator().manual_seed(1), loss_mask)
    ids = torch.randint(0, 299, (2, n))
    hidden = torch.randn(2, n, 128)
    blocks, _ = block_inputs(ids, anchors, 16, cfg.mask_token_id, loss_mask, lengths)
    x = torch.nn.Embedding(300, 64)(blocks).detach()
    with torch.no_grad():
        dense = drafter(hidden, x, anchors, lengths, attn_impl="dense", max_scores=1 << 16)
        flex = drafter(hidden, x, anchors, lengths, attn_impl="flex")
        torch.testing.assert_close(flex, dense, atol=2e-5, rtol=1e-4)
        if window is None:
            return
        a = int(anchors[0, 3])
        far, near = hidden.clone(), hidden.clone()
        far[0, a - window] += 5.0
        near[0, a - 1] += 5.0
        # Each implementation against its own unperturbed output: a key outside the window gets
        # exactly zero weight, so that is bitwise; dense against flex differs in fp32's summation
        # order (up to ~3e-7 here), which the tolerance above covers.
        for impl, base in (("dense", dense), ("flex", flex)):
            torch.testing.assert_close(drafter(far, x, anchors, lengths, attn_impl=impl)[0, 3], base[0, 3],
                                       atol=0, rtol=0)
            assert (drafter(near, x, anchors, lengths, attn_impl=impl)[0, 3] - base[0, 3]).abs().max() > 1e-3


def _packed_case(k: int, window: int | None):
    """2 rows of unequal length, one with fewer candidates than anchors (anchor slots -1)."""
    from train.dflash.model import PackedBlockAttention

    lengths = torch.tensor([300, 40])
    loss_mask = torch.zeros(2, 300, dtype=torch.bool)
    loss_mask[0, 30:] = True
    loss_mask[1, 25:40] = True
    anchors = sample_anchors(lengths, 40, k, torch.Generator().manual_seed(2), loss_mask)
    assert (anchors[1] < 0).any() and (anchors[0] >= 0).all()
    return PackedBlockAttention(anchors, lengths, 300, k), anchors, lengths, loss_mask


@pytest.mark.parametrize(("k", "window"), [(16, None), (16, 24), (16, 5), (10, 40)])
def test_packed_block_mask_tiles_hold_every_visible_key_and_full_tiles_are_whole(k, window):
    """The flex path's block mask is made from tile ranges, not from its per-element rule: every
    128 x 128 tile where the rule (the mask's own mask_mod, evaluated on every pair here) sees a
    key is in the mask, a tile marked full is seen whole (flex skips the rule there), and the
    listed tiles that see nothing stay few (at most one per query tile: a row boundary)."""
    from torch.nn.attention.flex_attention import create_mask

    packed, *_ = _packed_case(k, window)
    mask = packed.block_mask(torch.device("cpu"), window)
    q, kv = packed.q_pad, packed.ctx_pad + packed.q_pad
    sees = create_mask(mask.mask_mod, 1, 1, q, kv, device="cpu")[0, 0]
    tiles = sees.view(q // 128, 128, kv // 128, 128)
    any_seen, all_seen = tiles.any(3).any(1), tiles.all(3).all(1)
    partial, full = packed.tile_ranges(window)
    assert not (partial & full).any()
    assert (any_seen <= (partial | full)).all()
    assert (full <= all_seen).all() and full.any() == (window is None or window > 128)
    assert int((partial & ~any_seen).sum()) <= q // 128


@pytest.mark.parametrize("window", [None, 5])
def test_packed_flex_equals_dense_on_valid_anchors_and_drops_the_rest(window):
    """Packed flex (the real tokens of both rows and only the valid anchors' blocks) against the
    dense reference in fp32: equal on every valid anchor's block; the slots of anchors -1 are
    zeros (no label reads them)."""
    torch.manual_seed(0)
    drafter = Drafter(windowed([SLIDING, FULL] if window else [FULL, FULL], window or 1, 16)).eval()
    packed, anchors, lengths, loss_mask = _packed_case(16, window)
    blocks, _ = block_inputs(torch.randint(0, 299, (2, 300)), anchors, 16, drafter.cfg.mask_token_id, loss_mask,
                             lengths)
    x = torch.nn.Embedding(300, 64)(blocks).detach()
    hidden = torch.randn(2, 300, 128)
    with torch.no_grad():
        dense = drafter(hidden, x, anchors, lengths, attn_impl="dense")
        flex = drafter(hidden, x, anchors, lengths, attn_impl="flex")
    valid = anchors >= 0
    torch.testing.assert_close(flex[valid], dense[valid], atol=2e-5, rtol=1e-4)
    assert (flex[~valid] == 0).all() and packed.n_blocks == int(valid.sum())


def test_compiled_regions_and_flex_are_three_graphs_whatever_the_batch(monkeypatch):
    """The compile is bounded: the layer regions (compile_regions) and flex_attention, compiled with
    dynamic sizes, trace once each (dynamo's eager backend here: the graph count, not the kernels)
    over batches of other rows, lengths and anchor counts and over sliding and full layers; no
    batch shape, window or per-step mask recompiles them. In training the two regions too."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.nn.attention.flex_attention import flex_attention

    from train.dflash import model as dflash_model

    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    drafter = Drafter(windowed([SLIDING, FULL], 24, 16)).eval()
    drafter.compile_regions(backend="eager")
    flex = torch.compile(flex_attention, dynamic=True, backend="eager")
    monkeypatch.setattr(dflash_model, "_eager_flex", lambda: flex)
    graphs = []
    for i, (lens, n_anchors) in enumerate([((200, 90), 24), ((150,), 6), ((300, 120, 60), 30)]):
        lengths = torch.tensor(lens)
        loss_mask = torch.arange(max(lens))[None] >= (lengths[:, None] // 4)
        anchors = sample_anchors(lengths, n_anchors, 16, torch.Generator().manual_seed(i), loss_mask)
        with torch.no_grad():
            drafter(torch.randn(len(lens), max(lens), 128), torch.randn(*anchors.shape, 16, 64), anchors, lengths,
                    attn_impl="flex")
        graphs.append(int(counters["stats"]["unique_graphs"]))
    torch._dynamo.reset()
    assert graphs == [3, 3, 3]
    # training (the dense path: flex has no CPU backward): the first layer's input requires grad
    # like the others', so each region still traces once
    counters.clear()
    train = Drafter(windowed([SLIDING, FULL], 24, 16))
    train.compile_regions(backend="eager")
    for i, lens in enumerate([(200, 90), (150, 120, 60)]):
        lengths = torch.tensor(lens)
        loss_mask = torch.arange(max(lens))[None] >= (lengths[:, None] // 4)
        anchors = sample_anchors(lengths, 12, 16, torch.Generator().manual_seed(i), loss_mask)
        train(torch.randn(len(lens), max(lens), 128), torch.randn(*anchors.shape, 16, 64), anchors,
              lengths).sum().backward()
    assert int(counters["stats"]["unique_graphs"]) == 2
    torch._dynamo.reset()


def test_layer_types_are_checked():
    with pytest.raises(ValueError, match="sliding_window"):
        windowed([SLIDING, FULL], 0, 4)
    with pytest.raises(ValueError, match="layer_types"):
        windowed([SLIDING], 8, 4)


def test_export_layout_round_trips_and_engine_layouts_agree(tmp_path, sglang):
    from train.dflash.export import load_export

    torch.manual_seed(0)
    drafter = Drafter(windowed([SLIDING, FULL], 6, 4))
    out = write_export(drafter, tmp_path / "e")
    back = load_export(out)
    assert back.cfg.layer_types == [SLIDING, FULL] and back.cfg.sliding_window == 6
    assert layer_layouts(out, "vllm", 4) == layer_layouts(out, "sglang", 4, sglang)


def test_dense_path_is_refused_up_front_with_the_budget_that_fits():
    """The issue's case (qwen3.5 drafter on a 2B-shaped target, 512 anchors, 16k tokens in 8 rows,
    bf16) needs more than an H200 has: one line naming the need and a budget that fits; that
    budget's estimate fits, and a little more does not. 4 anchors fit."""
    from train.dflash.model import DENSE_HEADROOM, dense_attention_bytes, dense_budget_refusal

    target = TargetShape(hidden_size=2048, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=256, intermediate_size=6144, vocab_size=248320)
    cfg = drafter_config("qwen3.5", target, [1, 6, 11, 16, 21], 16)
    free = 130 << 30
    assert dense_budget_refusal(cfg, 16384, 4, True, free, rows=8) is None
    line = dense_budget_refusal(cfg, 16384, 512, True, free, rows=8)
    assert line is not None and "\n" not in line and "--attn-impl flex" in line
    fits = int(line.rsplit("--token-budget <= ", 1)[1].replace(",", ""))
    assert 0 < fits < 16384
    per_row = 16384 // 8
    usable = free * DENSE_HEADROOM
    assert dense_attention_bytes(cfg, fits, 512, True, fits // per_row) <= usable
    assert dense_attention_bytes(cfg, int(fits * 1.05), 512, True, int(fits * 1.05) // per_row) > usable
    # the estimate counts what it says: 5 layers' saved scores (6 B each under bf16) + one chunk
    scores = 32 * 512 * 16 * (16384 + 8 * 16)
    assert dense_attention_bytes(cfg, 16384, 512, True, 8) == 5 * 6 * scores + (1 << 27) * 12


def test_compiled_layer_regions_equal_eager_and_compile_once_per_dynamic_shape():
    """Drafter.compile_regions (what CUDA runs with inductor; here a counting backend that runs
    the captured graphs): outputs and gradients equal the eager drafter's on three batch shapes
    (rows, context, anchors all vary, a sliding layer included); the layers share the regions'
    graphs and, once sizes are dynamic, new shapes compile nothing more."""
    from torch._dynamo.testing import CompileCounter

    torch._dynamo.reset()
    torch.manual_seed(0)
    cfg = windowed([SLIDING, FULL], 6, 4)
    eager = Drafter(cfg)
    compiled = Drafter(cfg)
    compiled.load_state_dict(eager.state_dict())
    counter = CompileCounter()
    compiled.compile_regions(backend=counter)
    counts = []
    for rows, t, a in ((2, 30, 3), (3, 41, 5), (1, 52, 7), (4, 23, 2)):
        hidden = torch.randn(rows, t, 128)
        x = torch.randn(rows, a, 4, 64)
        anchors = torch.sort(torch.randint(1, t - 1, (rows, a)), dim=1).values
        lengths = torch.full((rows,), t)
        outs = []
        for model in (eager, compiled):
            model.zero_grad()
            out = model(hidden, x, anchors, lengths)
            out.square().mean().backward()
            outs.append((out.detach(), [p.grad.clone() for p in model.parameters()]))
        torch.testing.assert_close(outs[1][0], outs[0][0], atol=1e-5, rtol=1e-5)
        for g1, g0 in zip(outs[1][1], outs[0][1], strict=True):
            torch.testing.assert_close(g1, g0, atol=1e-5, rtol=1e-5)
        counts.append(counter.frame_count)
    # one graph per region (dynamic sizes, every layer's input requiring grad), and one more each
    # for the 1-row batch (the dense path's rows; dynamo specialises a size-1 dimension): none for a 4th
    assert counts == [2, 2, 4, 4], counts


K_SERVE, WINDOW_SERVE, PROMPTS = 8, 6, 12


@pytest.fixture(scope="module")
def served_run(tmp_path_factory):
    """A tiny Qwen3.5 target (save_pretrained, a ChatML BPE), chat data whose replies copy the
    prompt, its shards (layers 1, 2), a [sliding (window 6), full] drafter with K=8 trained offline
    on them, exported by `launch export`'s code (bf16)."""
    from dflash_fixtures import make_tokenizer, write_conversations
    from transformers import Qwen3_5ForCausalLM

    from train.common.shapes import get_shape
    from train.dflash.export import export_checkpoint
    from train.extract import extract as ex
    from train.stage1.model import text_config

    root = tmp_path_factory.mktemp("served")
    target = root / "target"
    torch.manual_seed(0)
    Qwen3_5ForCausalLM(text_config(get_shape("tiny"))).save_pretrained(str(target))
    make_tokenizer(target)
    chat = write_conversations(root / "chat.jsonl", 16, n_words=8)
    shards = root / "shards"
    assert ex.main(["--out", str(shards), "--data", str(chat), "--init-from", str(target), "--layers", "1,2",
                    "--token-budget", "512", "--max-len", "128"], guard=False) == 0
    layout = root / "drafter.json"
    layout.write_text(json.dumps({"num_layers": 2, "intermediate_size": 512, "layer_types": [SLIDING, FULL],
                                  "sliding_window": WINDOW_SERVE}))
    run = root / "dflash"
    assert dflash_train.main(["--data", str(shards), "--out", str(run), "--drafter", str(layout), "--steps", "30",
                              "--block-size", str(K_SERVE), "--token-budget", "512", "--anchors", "32",
                              "--lr", "5e-3", "--warmup", "2"], guard=False) == 0
    return target, chat, run, export_checkpoint(run, None, None)


def drafts_and_tau(draft, prompts) -> tuple[list[list[int]], float]:
    """Each prompt's K-1 drafts (draft(ctx_feats, hidden_states, anchor)) and tau over the prompts:
    1 + the drafts accepted in a row against the data's own next tokens, averaged."""
    blocks, accepted = [], []
    for hidden_states, anchor, truth in prompts:
        tokens = draft(hidden_states, anchor)
        run = next((i for i, (a, b) in enumerate(zip(tokens, truth, strict=True)) if a != b), len(truth))
        blocks.append(tokens)
        accepted.append(1 + run)
    return blocks, sum(accepted) / len(accepted)


@pytest.fixture(scope="module")
def served_prompts(served_run):
    """12 prompts (a conversation's prompt and its first reply tokens, the anchor inside the reply)
    run through the target, and the trainer's drafts and tau on them: its drafter at the exported
    bf16 weights, fed hidden_states[id + 1] of the layers it captured."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from train.dflash.export import load_export

    target, chat, run, out = served_run
    model = AutoModelForCausalLM.from_pretrained(str(target), local_files_only=True, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(str(target), local_files_only=True)
    embed, lm_head = model.get_input_embeddings().weight.detach(), model.lm_head.weight.detach()
    prompts = []
    for line in chat.read_text().splitlines()[:PROMPTS]:
        conv = json.loads(line)["conversations"]
        prompt = tok.apply_chat_template(conv[:2], add_generation_prompt=True, tokenize=True, return_dict=True)
        ids = tok.apply_chat_template(conv, tokenize=True, return_dict=True)["input_ids"]
        anchor = len(prompt["input_ids"]) + 3  # a token of the reply, as the target just sampled it
        with torch.no_grad():
            hidden_states = model(input_ids=torch.tensor([ids[:anchor]]), output_hidden_states=True).hidden_states
        prompts.append((hidden_states, ids[anchor], ids[anchor + 1:anchor + K_SERVE]))

    state = torch.load(run / "checkpoints" / sorted(p.name for p in (run / "checkpoints").glob("step_*"))[-1]
                       / "drafter.pt", weights_only=False)
    drafter = Drafter(DrafterConfig(**state["drafter_config"])).eval()
    drafter.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in state["model"].items()})
    assert drafter.cfg.layer_types == [SLIDING, FULL] and load_export(out).cfg.sliding_window == WINDOW_SERVE

    def trainer_draft(hidden_states, anchor: int) -> list[int]:
        ctx = torch.cat([hidden_states[i + 1][0] for i in drafter.cfg.target_layer_ids], -1)
        n = ctx.shape[0]
        hidden = torch.cat([ctx, torch.zeros(1, ctx.shape[1])])[None]  # the anchor's own state: not there yet
        block = embed[torch.tensor([anchor] + [drafter.cfg.mask_token_id] * (K_SERVE - 1))][None, None]
        with torch.no_grad():
            states = drafter(hidden, block, torch.tensor([[n]]), torch.tensor([n + 1]))[0, 0]
        return (states[1:] @ lm_head.T).argmax(-1).tolist()

    return (out, embed, lm_head, prompts, *drafts_and_tau(trainer_draft, prompts))


@pytest.mark.slow  # the fixtures extract a tiny target's shards and train 30 steps (shared by both engines)
@pytest.mark.parametrize("engine", ENGINES)
def test_a_trained_sliding_drafter_drafts_the_trainers_tokens_in_the_engine_loader(served_prompts, sglang, engine):
    """The acceptance of issue 42: on 12 prompts the engine-style loader, reading the export as
    `engine`'s code does (layer attention, window, captured layers), drafts the trainer's 7 tokens
    in 12 of 12, so its tau equals the trainer's, and the trained drafter accepts more than the
    target's own token. The control: the keys an earlier export wrote make SGLang's code serve the
    sliding layer bidirectionally, and its drafts then differ."""
    out, embed, lm_head, prompts, mine, tau = served_prompts
    serving = ServingDrafter(out, embed, lm_head, engine=engine, sglang=sglang)
    assert serving.layouts == [(True, (WINDOW_SERVE - 1, 0)), (False, (-1, -1))]
    theirs, tau_engine = drafts_and_tau(lambda hs, a: serving.draft(serving.context(hs), a), prompts)
    assert sum(a == b for a, b in zip(mine, theirs, strict=True)) == PROMPTS, (mine, theirs)
    assert tau_engine == tau and tau > 1.0, (tau_engine, tau)

    if engine == "sglang":
        old = json.loads((out / "config.json").read_text())
        old["is_causal"] = False
        (out.parent / "earlier").mkdir(exist_ok=True)
        (out.parent / "earlier" / "config.json").write_text(json.dumps(old))
        (out.parent / "earlier" / "model.safetensors").write_bytes((out / "model.safetensors").read_bytes())
        earlier = ServingDrafter(out.parent / "earlier", embed, lm_head, engine=engine, sglang=sglang)
        assert earlier.layouts[0] == (False, (WINDOW_SERVE - 1, WINDOW_SERVE - 1))
        wrong, _ = drafts_and_tau(lambda hs, a: earlier.draft(earlier.context(hs), a), prompts)
        assert sum(a == b for a, b in zip(mine, wrong, strict=True)) < PROMPTS
