"""DFlash drafter: offline training from shards, anchor-only logits, block masking, resume, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from train.dflash import train as dflash_train
from train.dflash.model import (
    Drafter,
    DrafterConfig,
    TargetHead,
    TargetShape,
    block_inputs,
    drafter_config,
    drafter_loss,
    gather_block_positions,
    sample_anchors,
)
from train.extract import extract as ex
from train.extract.data import generate_synthetic

# A 64-wide target with 4 query / 2 key-value heads of 16: the drafter's GQA shape comes from it.
SHAPE = TargetShape(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    intermediate_size=128, vocab_size=300, rope_theta=1e7)
FAST = ["--block-size", "8", "--token-budget", "160", "--lr", "1e-2", "--warmup", "2"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("extract")
    data = generate_synthetic(root / "data.jsonl", 24, seed=3, vocab=4096, min_len=12, max_len=40, median=24)
    out = root / "shards"
    assert ex.main(["--out", str(out), "--data", str(data), "--layers", "1,2", "--token-budget", "160",
                    "--max-len", "40"], guard=False) == 0
    return out


LEARN_STEPS = 30
LEARN = ["--token-budget", "320", "--lr", "5e-3"]
CHANCE = 1 / 64  # generate_synthetic's alphabet: a drafter that knows only the alphabet
MARGIN = 0.13


def assert_slot1_above_chance(recs: list[dict]) -> None:
    acc1 = sum(r["acc_slot"][0] for r in recs) / len(recs)
    assert acc1 > CHANCE + MARGIN, [round(r["acc_slot"][0], 3) for r in recs]


def _metrics(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("event") == "step"]


def test_offline_training_loss_falls_and_logits_only_at_anchor_blocks(shards, tmp_path, monkeypatch):
    seen: list[tuple[int, ...]] = []

    class WatchedHead(TargetHead):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.lm_head.register_forward_pre_hook(lambda m, inp: seen.append(tuple(inp[0].shape)))

    monkeypatch.setattr(dflash_train, "TargetHead", WatchedHead)
    out = tmp_path / "run"
    assert dflash_train.main(["--data", str(shards), "--out", str(out), "--steps", str(LEARN_STEPS), *FAST, *LEARN],
                             guard=False) == 0
    recs = _metrics(out)
    assert len(recs) == LEARN_STEPS
    first = sum(r["loss"] for r in recs[:5]) / 5
    last = sum(r["loss"] for r in recs[-5:]) / 5
    assert last < first - 2.0, (first, last)  # ~7.5 -> ~3 in 30 steps
    # The learning test under the strict mask: slot-1 accuracy, pooled over the last 5 steps, above
    # chance (1/64: the synthetic alphabet) by a margin of 0.13 (README: measured 0.3 here).
    assert_slot1_above_chance(recs[-5:])
    assert all(len(r["acc_slot"]) == 7 and r["tau"] >= 1.0 for r in recs)
    # lm_head saw only [rows, hidden] inputs: the anchor-block rows, never a [batch, seq, hidden] tensor.
    max_rows = max(r["anchors"] for r in recs) * 7
    assert seen and all(len(s) == 2 and s[0] <= max_rows for s in seen)
    assert max(r["anchors"] for r in recs) > 3 * max(r["batch_rows"] for r in recs)  # many anchors per row
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == LEARN_STEPS and (out / "drafter.pt").is_file()
    # Padding is measured per step; the epochs of the bucketed shuffle advanced.
    assert max(r["epoch"] for r in recs) >= 1


def test_resume_continues_at_the_saved_step(shards, tmp_path, capsys):
    out = tmp_path / "run"
    # --loss-impl onepass: the frozen head's one-pass CE trains and resumes like the others
    args = ["--data", str(shards), "--out", str(out), "--ckpt-every", "3", "--acc-rows", "5", "--loss-impl", "onepass",
            *FAST]
    assert dflash_train.main([*args, "--steps", "3"], guard=False) == 0
    assert dflash_train.main([*args, "--steps", "5"], guard=False) == 0
    printed = capsys.readouterr().out
    assert "resumed from" in printed
    steps = [r["step"] for r in _metrics(out)]
    assert steps == [1, 2, 3, 4, 5]
    # the compact step line: n/N of this job's total and an ETA, under the header's legend (38.9)
    assert "# step line: step n/N, loss, acc1" in printed
    lines = [ln for ln in printed.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in lines] == ["1/3", "2/3", "3/3", "4/5", "5/5"], lines
    assert all(len(ln) <= 120 and " acc1 " in ln and " tau " in ln and " eta " in ln for ln in lines)
    assert " eta 0s" in lines[2] and " eta 0s" in lines[-1]  # (a STALL(cause) may follow: CPU noise)
    assert [r["steps_total"] for r in _metrics(out)] == [3, 3, 3, 5, 5]
    # --acc-rows: the accuracy metrics on 5 rows of each step's (more than 5) labelled slots
    assert all(r["acc_rows"] == 5 < r["anchors"] for r in _metrics(out))
    header = [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if r.get("event") == "header"]
    assert header and all(h["loss_impl"] == "onepass" for h in header)


def test_block_sees_context_strictly_before_its_anchor():
    """The inference-true mask: the target state AT the anchor does not exist yet at inference
    (the anchor is the token just sampled), so changing it must not move the block's output;
    changing a state before the anchor must."""
    torch.manual_seed(0)
    cfg = drafter_config("tiny", SHAPE, [1, 2], 4)
    drafter = Drafter(cfg).eval()
    head = TargetHead(torch.randn(300, 64), torch.randn(300, 64))
    ids = torch.randint(0, 299, (1, 20))
    hidden = torch.randn(1, 20, 128)
    anchors = torch.tensor([[3, 10]])
    lengths = torch.tensor([20])
    blocks, labels = block_inputs(ids, anchors, 4, cfg.mask_token_id)
    assert blocks[0, 0].tolist() == [int(ids[0, 3])] + [cfg.mask_token_id] * 3
    assert labels[0, 1].tolist() == ids[0, 11:14].tolist()
    emb = head.embed_tokens(blocks)
    base = drafter(hidden, emb, anchors, lengths)

    def moved(pos: int) -> torch.Tensor:
        h = hidden.clone()
        h[:, pos] += 5.0
        return drafter(h, emb, anchors, lengths)

    at_anchor = moved(10)
    torch.testing.assert_close(base[0, 1], at_anchor[0, 1])  # the state at anchor 10: unseen
    before = moved(9)
    assert not torch.allclose(base[0, 1], before[0, 1])  # the state at 9: seen by anchor 10's block
    torch.testing.assert_close(base[0, 0], before[0, 0])  # ... and not by anchor 3's
    assert not torch.allclose(base[0, 0], moved(2)[0, 0])


def test_512_anchors_in_one_forward_equal_each_block_alone():
    """The default 512 anchors on a 600-token row with a loss mask: every anchor on a response
    token, one batched drafter forward (chunked attention), and each block's output equal to that
    block computed on its own (the oracle: one anchor per forward)."""
    torch.manual_seed(0)
    cfg = drafter_config("tiny", SHAPE, [1, 2], 16)
    drafter = Drafter(cfg).eval()
    n = 600
    lengths = torch.tensor([n, 200])
    loss_mask = torch.zeros(2, n, dtype=torch.bool)
    loss_mask[0, 40:] = True  # a 40-token prompt, then the response
    loss_mask[1, 100:200] = True
    anchors = sample_anchors(lengths, 512, 16, torch.Generator().manual_seed(1), loss_mask)
    assert anchors.shape == (2, 512) and (anchors[0] >= 40).all() and (anchors[0] <= n - 2).all()
    row1 = anchors[1][anchors[1] >= 0]
    assert len(row1) == 99 and (row1 >= 100).all()  # clamped to the positions available (100..198)
    ids = torch.randint(0, 299, (2, n))
    hidden = torch.randn(2, n, 128)
    emb = torch.nn.Embedding(300, 64)
    blocks, labels = block_inputs(ids, anchors, 16, cfg.mask_token_id, loss_mask, lengths)
    assert (labels[1][anchors[1] < 0] == -100).all()
    with torch.no_grad():
        # max_scores small enough that the 512 x 16 queries run in several attention chunks
        out = drafter(hidden, emb(blocks), anchors, lengths, max_scores=1 << 20)
        for r, j in [(0, 0), (0, 255), (0, 511), (1, 7)]:
            alone = drafter(hidden[r:r + 1], emb(blocks[r:r + 1, j:j + 1]), anchors[r:r + 1, j:j + 1], lengths[r:r + 1])
            torch.testing.assert_close(out[r, j], alone[0, 0], atol=2e-5, rtol=1e-4)


def _candidates_by_rule(length: int, mask: list[bool]) -> set[int]:
    """SpecForge's anchor rule, spelled out: a and a+1 are response tokens, a context state before a."""
    return {a for a in range(1, length - 1) if mask[a] and mask[a + 1]}


def test_anchor_sampling_and_gather():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.tensor([20, 5, 9])
    anchors = sample_anchors(lengths, 4, 8, gen)
    for r, n in enumerate(lengths.tolist()):
        picked = [a for a in anchors[r].tolist() if a >= 0]
        want = _candidates_by_rule(n, [True] * n)
        assert set(picked) <= want and len(picked) == min(4, len(want)) == len(set(picked))
    final = torch.arange(3 * 20, dtype=torch.float32).view(3, 20, 1)
    got = gather_block_positions(final, anchors, 8)
    assert got.shape == (3, 4, 7, 1)
    a = int(anchors[0, 1])
    assert got[0, 1, :, 0].tolist() == [float(a + j) for j in range(7)]


def test_short_final_answers_get_anchors_up_to_their_last_token_and_labels_stop_at_the_end():
    """K=16 and final answers of 10 and 18 tokens (the row ends with the answer): every a with a and
    a+1 in the answer is a candidate (9 and 17 of them), where a full block after the anchor allowed
    0 and 3; labels past the row's end and on the prompt are masked, the rest are the true tokens."""
    k = 16
    prompt = 30
    lengths = torch.tensor([prompt + 10, prompt + 18])
    width = int(lengths.max())
    loss_mask = torch.zeros(2, width, dtype=torch.bool)
    for r, n in enumerate(lengths.tolist()):
        loss_mask[r, prompt:n] = True
    ok = sample_anchors(lengths, 512, k, torch.Generator().manual_seed(0), loss_mask)
    for r, (n, answer) in enumerate(zip(lengths.tolist(), (10, 18), strict=True)):
        picked = sorted(a for a in ok[r].tolist() if a >= 0)
        assert picked == sorted(_candidates_by_rule(n, loss_mask[r].tolist()))
        assert len(picked) == answer - 1  # the answer's last token has no next token
    ids = torch.randint(5, 200, (2, width))
    blocks, labels = block_inputs(ids, ok, k, 3, loss_mask, lengths)
    for r in range(2):
        for j, a in enumerate(ok[r].tolist()):
            if a < 0:
                assert (labels[r, j] == -100).all()
                continue
            for s in range(1, k):
                pos = a + s
                want = int(ids[r, pos]) if pos < int(lengths[r]) and loss_mask[r, pos] else -100
                assert int(labels[r, j, s - 1]) == want, (r, a, s)
    # the last candidate of the 10-token answer: one label (the answer's last token), 14 masked
    last = max(a for a in ok[0].tolist())
    row = labels[0, ok[0].tolist().index(last)]
    assert (row != -100).sum() == 1 and int(row[0]) == int(ids[0, last + 1])


def test_default_gamma_and_published_drafter_layout():
    from train.dflash.model import default_drafter, default_gamma

    assert [default_gamma(k) for k in (16, 10, 8)] == [7.0, 5.0, 4.0]
    assert default_gamma(32) == 14.0
    big = TargetShape(hidden_size=2048, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                      head_dim=256, intermediate_size=6144, vocab_size=248320)
    cfg = drafter_config(default_drafter(big), big, [1, 6, 11, 16, 21], 16)
    assert (cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.num_kv_heads) == (5, 32, 128, 8)
    assert cfg.vocab_size == 248320 and cfg.intermediate_size == 6144
    assert default_drafter(SHAPE) == "tiny"
    args = ["--mode", "offline", "--data", "x"]
    assert dflash_train.slot_gamma(dflash_train.parse_args([*args, "--block-size", "8"])) == 4.0
    assert dflash_train.slot_gamma(dflash_train.parse_args([*args, "--gamma", "3"])) == 3.0
    assert dflash_train.slot_gamma(dflash_train.parse_args([*args, "--gamma", "0"])) is None


def test_online_target_side_never_calls_lm_head(tmp_path):
    cfg = dflash_train.DFlashConfig(mode="online", layers="1,2", block_size=4, anchors=2, out=str(tmp_path))
    target, layers, capture = dflash_train.build_target(cfg, torch.device("cpu"))
    assert not any("lm_head" in n for n, _ in target.base.named_modules())  # the decoder stack alone
    import numpy as np

    samples = [np.arange(32, 52), np.arange(40, 50)]
    batch = dflash_train.target_batch(target.base, capture, samples, cfg, step=0, device=torch.device("cpu"))
    assert batch["hidden"].shape == (2, 20, 2 * 256)
    assert batch["final_blocks"].shape == (2, 2, 3, 256)


def test_corrupt_shard_is_one_clear_line(shards, tmp_path, capsys):
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(shards, broken)
    victim = sorted(broken.glob("shard_*.safetensors"))[0]
    victim.write_bytes(victim.read_bytes()[:-100])
    code = dflash_train.main(["--data", str(broken), "--out", str(tmp_path / "o"), "--steps", "2", *FAST],
                             guard=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1
    assert str(victim) in err[0] and "corrupt shard" in err[0]


def test_config_errors(tmp_path, capsys):
    assert dflash_train.main(["--mode", "offline", "--out", str(tmp_path)], guard=False) == 2
    assert "needs --data" in capsys.readouterr().err
    assert dflash_train.main(["--mode", "online", "--topology", "2-2", "--out", str(tmp_path)], guard=False) == 1
    assert "--topology 2-2 needs 4 ranks, this job has 1" in capsys.readouterr().err
    assert dflash_train.main(["--mode", "online", "--topology", "2-0"], guard=False) == 2
    assert "k-m" in capsys.readouterr().err
    assert dflash_train.main(["--data", str(tmp_path / "nope"), "--out", str(tmp_path)], guard=False) == 1
    assert "no such extraction directory" in capsys.readouterr().err
    assert dflash_train.main(["--data", str(tmp_path), "--out", str(tmp_path), "--acc-rows", "-1"], guard=False) == 2
    assert "--acc-rows must be >= 0" in capsys.readouterr().err


def test_bf16_autocast_drafter_learns_like_fp32(shards, tmp_path):
    """--amp bf16 (the CUDA default) on CPU: the same run in bf16 matmuls, fp32 weights, learns
    as the fp32 run does (the first losses agree to bf16 precision, both fall)."""
    runs = {}
    for amp in ("off", "bf16"):
        out = tmp_path / amp
        assert dflash_train.main(["--data", str(shards), "--out", str(out), "--steps", "12", "--amp", amp, *FAST],
                                 guard=False) == 0
        runs[amp] = _metrics(out)
    header = (tmp_path / "bf16" / "metrics.jsonl").read_text().splitlines()[0]
    assert '"amp": "bf16"' in header
    off, bf16 = runs["off"], runs["bf16"]
    assert abs(off[0]["loss"] - bf16[0]["loss"]) < 0.05 * off[0]["loss"]
    assert bf16[-1]["loss"] < bf16[0]["loss"] - 1.0 and off[-1]["loss"] < off[0]["loss"] - 1.0
    drafter = torch.load(tmp_path / "bf16" / "drafter.pt", weights_only=False)
    weights = drafter["model"] if "model" in drafter else drafter
    assert all(t.dtype == torch.float32 for t in weights.values() if torch.is_tensor(t) and t.is_floating_point())


def _copy(shards: Path, tmp_path: Path) -> tuple[Path, Path]:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(shards, broken)
    return broken, sorted(broken.glob("shard_*.safetensors"))[0]


def test_bit_flipped_shard_is_refused(shards, tmp_path, capsys):
    """Same size, one bit changed in a hidden state: only the sha256 the index recorded shows it."""
    broken, victim = _copy(shards, tmp_path)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x10
    victim.write_bytes(bytes(data))
    code = dflash_train.main(["--data", str(broken), "--out", str(tmp_path / "o"), "--steps", "6", *FAST], guard=False)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1, err
    assert f"{victim}: corrupt shard (sha256" in err[0] and "--max-bad-fraction" in err[0]


def _nan_shard(victim: Path) -> None:
    """Rewrite a shard with NaN hidden states and index it as if extraction had written it so."""
    from train.extract.shards import index_name, read_shard, write_shard

    samples = read_shard(victim)
    for t in samples.values():
        t["hidden"] = torch.full_like(t["hidden"], float("nan"))
    size, digest = write_shard(victim, samples)
    index_path = victim.parent / index_name(0)
    index = json.loads(index_path.read_text())
    index["shards"][victim.name].update(bytes=size, sha256=digest)
    index_path.write_text(json.dumps(index))


def test_nan_shard_is_refused_or_skipped_within_the_threshold(shards, tmp_path, capsys):
    broken, victim = _copy(shards, tmp_path)
    _nan_shard(victim)
    args = ["--data", str(broken), "--steps", "8", *FAST]
    assert dflash_train.main([*args, "--out", str(tmp_path / "o")], guard=False) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{victim}: non-finite hidden states" in err[0], err
    # 1 bad shard of 5 is 20%: allowed with --max-bad-fraction 0.25, skipped and reported once.
    out = tmp_path / "skip"
    assert dflash_train.main([*args, "--out", str(out), "--max-bad-fraction", "0.25"], guard=False) == 0
    log = capsys.readouterr().out
    assert log.count(f"# skipping {victim}: non-finite") == 1
    recs = _metrics(out)
    assert recs and all(torch.isfinite(torch.tensor(r["loss"])) for r in recs)
    weights = torch.load(out / "drafter.pt", weights_only=False)["state_dict"]
    assert all(torch.isfinite(t).all() for t in weights.values())


def test_export_reloads_with_equal_outputs_and_the_serving_loaders_fields(shards, tmp_path):
    """`launch export` for a DFlash run: config.json + model.safetensors in the published DFlash
    layout. The project's loader reloads it with outputs equal to the checkpoint's drafter (at the
    exported bf16 weights); transformers parses the config as a Qwen3 config carrying the DFlash
    fields that SGLang's parse_dflash_draft_config and vLLM's qwen3_dflash read; the weight names
    are the ones their load_weights map (q/k/v/gate/up_proj stacked, fc, hidden_norm, norm)."""
    from safetensors import safe_open
    from transformers import AutoConfig

    from train.dflash.export import export_checkpoint, load_export

    run = tmp_path / "run"
    assert dflash_train.main(["--data", str(shards), "--out", str(run), "--steps", "3", *FAST], guard=False) == 0
    out = export_checkpoint(run, None, None)
    assert out == run / "export" / "step_00000003"
    state = torch.load(run / "checkpoints" / "step_00000003" / "drafter.pt", weights_only=False)
    original = Drafter(DrafterConfig(**state["drafter_config"]))
    original.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in state["model"].items()})
    reloaded = load_export(out)
    torch.manual_seed(0)
    cfg = original.cfg
    hidden = torch.randn(2, 30, cfg.n_target_layers * cfg.hidden_size)
    emb = torch.randn(2, 3, cfg.block_size, cfg.hidden_size)
    anchors, lengths = torch.tensor([[2, 9, 20], [5, -1, -1]]), torch.tensor([30, 17])
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(hidden, emb, anchors, lengths),
                                   original.eval()(hidden, emb, anchors, lengths), atol=0, rtol=0)

    hf = AutoConfig.from_pretrained(str(out), local_files_only=True)
    assert hf.model_type == "qwen3" and hf.architectures == ["DFlashDraftModel"]
    assert hf.dflash_config == {"target_layer_ids": [1, 2], "block_size": 8, "mask_token_id": cfg.vocab_size - 1}
    assert hf.num_target_layers == 4 and hf.eagle_aux_hidden_state_layer_ids == [2, 3]
    assert (hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (2, 4, 2, 64)
    assert hf.hidden_size == 256 and hf.rope_parameters["rope_theta"] == 1e7
    assert getattr(hf, "is_causal", None) is None  # each engine's per-layer default is this drafter's mask
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
        f"layers.{i}.{name}.weight" for i in range(2) for name in (
            "input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
            "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm", "self_attn.k_norm",
            "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == expected
        assert f.get_tensor("fc.weight").shape == (256, 2 * 256) and f.get_tensor("fc.weight").dtype == torch.bfloat16
        assert f.get_tensor("layers.0.self_attn.k_proj.weight").shape == (2 * 64, 256)  # GQA: 2 kv heads


def test_chunked_loss_equals_one_chunk():
    """lm_head in checkpointed chunks: loss, gradients and stats equal the single-chunk computation."""
    torch.manual_seed(0)
    head = TargetHead(torch.randn(300, 64), torch.randn(300, 64) * 0.1)
    hidden = torch.randn(2, 5, 8, 64, requires_grad=True)
    labels = torch.randint(0, 300, (2, 5, 7))
    labels[1, 3:] = -100
    final = torch.randn(2, 5, 7, 64)
    results = []
    for chunk in (None, 7):
        hidden.grad = None
        loss, stats = drafter_loss(head, hidden, labels, final, kl_weight=0.5, gamma=7.0, chunk_rows=chunk)
        loss.backward()
        results.append((loss.detach(), hidden.grad.clone(), stats))
    (l1, g1, s1), (l2, g2, s2) = results
    torch.testing.assert_close(l1, l2)
    torch.testing.assert_close(g1, g2)
    assert s1["acc_slot"] == s2["acc_slot"] and abs(s1["kl"] - s2["kl"]) < 1e-5
    assert s1["target_agree"] == s2["target_agree"]
