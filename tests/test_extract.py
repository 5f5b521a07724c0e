"""Hidden-state extraction: no lm_head, right layers captured, batched shards, crash-safe resume, sync."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from train.extract import extract as ex
from train.extract.data import generate_synthetic
from train.extract.shards import index_name, read_index, read_shard

SMALL = ["--layers", "1,2", "--token-budget", "96", "--max-len", "32"]


@pytest.fixture()
def data(tmp_path: Path) -> Path:
    return generate_synthetic(tmp_path / "data.jsonl", 20, seed=1, vocab=4096, min_len=8, max_len=32, median=16)


@pytest.fixture()
def no_lm_head(monkeypatch):
    """Every target the extractor loads is the decoder stack alone: no lm_head exists to be called."""
    from train.extract import target as target_mod

    real = target_mod.load_target

    def load(*args, **kwargs):
        target = real(*args, **kwargs)
        assert not any("lm_head" in n for n, _ in target.base.named_modules()), "the target has an lm_head"
        return target

    monkeypatch.setattr(ex, "load_target", load)


def _run(out: Path, data: Path, *extra: str) -> int:
    return ex.main(["--out", str(out), "--data", str(data), *SMALL, *extra], guard=False)


def _all_samples(out: Path) -> list[int]:
    seen: list[int] = []
    for name in sorted(p.name for p in out.glob("shard_*.safetensors")):
        seen += sorted(read_shard(out / name))
    return seen


def test_default_layers_spread_from_1_to_L_minus_3():
    assert ex.default_layers(64, 5) == [1, 16, 31, 46, 61]
    assert ex.default_layers(4, 5) == [1]


def test_capture_equals_hidden_states_and_skips_lm_head():
    from train.stage1.model import build_model

    torch.manual_seed(0)
    model, _ = build_model("tiny")
    model.eval()
    calls = []
    model.lm_head.register_forward_hook(lambda m, i, o: calls.append(o.shape))
    ids = torch.randint(32, 200, (2, 20))
    with torch.no_grad():
        full = model(input_ids=ids, output_hidden_states=True)
    calls.clear()
    capture = ex.HiddenCapture(model.model, [1, 2])
    hidden, final = ex.target_forward(model.model, capture, ids)
    assert calls == []  # base model only
    assert hidden.shape == (2, 20, 2 * model.config.hidden_size)
    # layer i = output of decoder layer i = hidden_states[i + 1]
    torch.testing.assert_close(hidden[..., :256], full.hidden_states[2], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(hidden[..., 256:], full.hidden_states[3], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, full.hidden_states[-1], atol=1e-5, rtol=1e-5)


def test_packed_forward_equals_each_sample_alone_through_stock_transformers():
    """Three samples of unequal length as one varlen stream (the extractor's layout: real tokens
    only, the varlen attention and the packed GDN kernels) against each sample run alone through
    the stock model: the same captured layers and final states, in fp32."""
    import numpy as np

    from train.common import fastpath, varlen_attention
    from train.stage1.model import build_model

    torch.manual_seed(0)
    model, _ = build_model("tiny")
    model.eval()
    gen = np.random.default_rng(0)
    samples = [gen.integers(32, 200, size=n) for n in (20, 7, 13)]
    with torch.no_grad():
        alone = [model(input_ids=torch.from_numpy(s)[None], output_hidden_states=True).hidden_states
                 for s in samples]
    fastpath.install_kernels(model.model, fastpath.select_kernels(torch.device("cpu")))
    varlen_attention.use_attention(model.model, "varlen")
    capture = ex.HiddenCapture(model.model, [1, 2])
    ids, lens, packing = ex.pack_batch(samples)
    hidden, final = ex.target_forward_packed(model.model, capture, ids, packing)
    assert hidden.shape == (1, 40, 512) and lens == [20, 7, 13]
    lo = 0
    for n, ref in zip(lens, alone, strict=True):
        torch.testing.assert_close(hidden[0, lo:lo + n, :256], ref[2][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hidden[0, lo:lo + n, 256:], ref[3][0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(final[0, lo:lo + n], ref[-1][0], atol=1e-5, rtol=1e-5)
        lo += n
    # the extractor's regional compile (dynamic sizes; dynamo's eager backend here): the same
    # states, and a batch of another length compiles no new graph
    from torch._dynamo import reset
    from torch._dynamo.utils import counters

    from train.common.regional_compile import apply_regional_compile

    reset()
    counters.clear()
    apply_regional_compile(model.model, backend="eager", dynamic=True)
    again, again_final = ex.target_forward_packed(model.model, capture, ids, packing)
    torch.testing.assert_close(again, hidden, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(again_final, final, atol=1e-5, rtol=1e-5)
    graphs = int(counters["stats"]["unique_graphs"])
    assert graphs >= 4  # norm, MLP, the attention and GDN regions
    ids2, _, packing2 = ex.pack_batch(samples[:2] + [gen.integers(32, 200, size=9)])
    ex.target_forward_packed(model.model, capture, ids2, packing2)
    assert int(counters["stats"]["unique_graphs"]) == graphs
    reset()


def test_crash_and_resume_covers_dataset_exactly_once(tmp_path, data, no_lm_head, capsys):
    out = tmp_path / "x"
    assert _run(out, data, "--stop-after", "3") == 0
    index = read_index(out)
    assert len(index) == 3
    # Simulate a crash: the third shard was renamed but never indexed, and a fourth was cut short.
    entries = json.loads((out / index_name(0)).read_text())["shards"]
    dropped = sorted(entries)[-1]
    del entries[dropped]
    (out / index_name(0)).write_text(json.dumps({"shards": entries}))
    (out / ".shard_00003.safetensors.zz.tmp").write_bytes(b"partial")
    kept = {n: os.stat(out / n).st_ino for n in entries}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["shards"] > 4
    capsys.readouterr()

    assert _run(out, data) == 0
    log = capsys.readouterr().out
    assert f"adopted {dropped}" in log and "removed .shard_00003" in log and "samples/s" in log
    assert not list(out.glob(".*.tmp"))
    assert {n: os.stat(out / n).st_ino for n in entries} == kept  # complete shards were not rewritten
    seen = _all_samples(out)
    assert sorted(seen) == list(range(20))  # every sample, each exactly once
    assert sorted(i for e in read_index(out).values() for i in e.samples) == list(range(20))
    assert len(read_index(out)) == meta["shards"]
    shard = read_shard(out / "shard_00000.safetensors")
    some = next(iter(shard.values()))
    assert some["hidden"].shape[1] == 2 * 256 and some["final"].shape[1] == 256
    assert some["hidden"].dtype == torch.bfloat16 and some["input_ids"].dtype == torch.int32

    # A third run has nothing to do.
    assert _run(out, data) == 0
    assert '"written": 0' in capsys.readouterr().out


def test_sync_deletes_only_verified_copies(tmp_path, data, no_lm_head, capsys):
    store = tmp_path / "store"
    store.mkdir()
    out = tmp_path / "x"
    assert _run(out, data, "--sync-cmd", f"cp {{src}} {store}/{{name}}",
                "--sync-check-cmd", f"sha256sum {store}/{{name}}") == 0
    assert not list(out.glob("shard_*"))
    index = read_index(out)
    assert all(e.location == "synced" for e in index.values())
    assert sorted(i for p in store.iterdir() for i in read_shard(p)) == list(range(20))

    # A copy that does not verify: the local shard stays, one clear line, exit 1.
    out2 = tmp_path / "y"
    capsys.readouterr()
    assert _run(out2, data, "--sync-cmd", "true", "--sync-check-cmd", "echo deadbeef") == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not verify" in err[0] and "local shard is kept" in err[0]
    assert (out2 / "shard_00000.safetensors").is_file()


def test_bad_input_one_line(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": 1, "input_ids": [1, 2, 3]}\n{"id": 2}\n')
    assert ex.main(["--out", str(tmp_path / "o"), "--data", str(bad), *SMALL], guard=False) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.jsonl:2" in err[0]
    assert ex.main(["--layers", "9", "--out", str(tmp_path / "o2"), "--data", str(bad)], guard=False) != 0


def test_guard_refuses_outside_slurm(tmp_path, monkeypatch, capsys):
    for var in ("SLURM_JOB_ID", "SLURM_JOBID"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(SystemExit) as exc:
        ex.main(["--out", str(tmp_path)])
    assert exc.value.code == 3
    assert "refusing to run outside a Slurm allocation" in capsys.readouterr().err


def test_sigkill_midway_then_resume(tmp_path, data):
    """A real kill (SIGKILL, no cleanup) during extraction; the resumed run completes exactly once."""
    import signal
    import subprocess
    import sys
    import time

    out = tmp_path / "x"
    code = ("import sys; from train.extract.extract import main; "
            f"sys.exit(main({['--out', str(out), '--data', str(data), *SMALL]!r}, guard=False))")
    repo = Path(__file__).resolve().parents[1]
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=repo, env={**os.environ, "PYTHONPATH": str(repo)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and proc.poll() is None:
        if (out / index_name(0)).exists() and read_index(out):
            break
        time.sleep(0.01)
    assert proc.poll() is None, "extraction finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    total = json.loads((out / "meta.json").read_text())["shards"]
    assert 0 < len(read_index(out)) < total
    assert _run(out, data) == 0
    assert sorted(_all_samples(out)) == list(range(20))
    assert len(read_index(out)) == total


def test_resume_rewrites_a_bit_flipped_shard(tmp_path, data, capsys):
    """Resume verifies each indexed shard's sha256, not just its size, and rewrites one that changed."""
    from toolkit.fsutil import sha256_file

    out = tmp_path / "x"
    assert _run(out, data) == 0
    victim = out / "shard_00001.safetensors"
    raw = bytearray(victim.read_bytes())
    raw[-10] ^= 0x01
    victim.write_bytes(bytes(raw))
    capsys.readouterr()
    assert _run(out, data) == 0
    log = capsys.readouterr().out
    assert "# rewriting shard_00001.safetensors: sha256" in log and '"written": 1' in log
    assert sha256_file(victim) == read_index(out)["shard_00001.safetensors"].sha256


def _can_unshare_mounts() -> bool:
    import shutil
    import subprocess

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        return False
    return subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _can_unshare_mounts(), reason="needs root and unshare -m (a private tmpfs)")
def test_disk_estimate_printed_and_too_small_a_filesystem_refused(tmp_path, data):
    """A real 2 MiB tmpfs (private mount namespace) as --out: the estimate is printed, the run
    refuses with one line before writing anything; on the real disk the same run proceeds."""
    import subprocess
    import sys

    out = tmp_path / "small"
    out.mkdir()
    repo = Path(__file__).resolve().parents[1]
    code = ("import sys; from train.extract.extract import main; "
            f"sys.exit(main({['--out', str(out), '--data', str(data), *SMALL]!r}, guard=False))")
    script = f"mount -t tmpfs -o size=2m tmpfs {out} && {sys.executable} -c \"$0\"; rc=$?; ls -A {out}; exit $rc"
    done = subprocess.run(["unshare", "-m", "sh", "-c", script, code], cwd=repo, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(repo)}, timeout=300)
    err = done.stderr.strip().splitlines()
    assert done.returncode == 1 and len(err) == 1, done.stdout + done.stderr
    assert "GiB free" in err[0] and "extraction needs" in err[0]
    assert "# disk:" in done.stdout and ".safetensors" not in done.stdout  # nothing written there
    assert _run(tmp_path / "big", data) == 0


def test_conversations_tokenized_with_the_targets_template_loss_mask_on_assistant_turns(tmp_path, capsys):
    """Conversation records through the target's own tokenizer and chat template (local files):
    the stored loss mask covers exactly the assistant's text and its end-of-turn token; samples
    cut to --max-len are counted and reported."""
    from dflash_fixtures import make_tokenizer, write_conversations
    from transformers import AutoTokenizer

    tok_dir = make_tokenizer(tmp_path / "tok")
    convs = write_conversations(tmp_path / "chat.jsonl", 6, n_words=6)
    out = tmp_path / "x"
    assert ex.main(["--out", str(out), "--data", str(convs), "--tokenizer", str(tok_dir), "--layers", "1,2",
                    "--token-budget", "512", "--max-len", "128"], guard=False) == 0
    tok = AutoTokenizer.from_pretrained(str(tok_dir), local_files_only=True)
    records = [json.loads(x) for x in convs.read_text().splitlines()]
    seen = 0
    for name in sorted(p.name for p in out.glob("shard_*.safetensors")):
        for idx, t in read_shard(out / name).items():
            ids, mask = t["input_ids"].tolist(), t["loss_mask"].bool()
            assistant = records[idx]["conversations"][-1]["content"]
            assert tok.decode([i for i, m in zip(ids, mask.tolist(), strict=True) if m]) == assistant + "<|im_end|>\n"
            assert tok.decode(ids).startswith("<|im_start|>system\nYou repeat.")
            seen += 1
    assert seen == 6
    # Cut short: counted and reported, never silent.
    capsys.readouterr()
    assert ex.main(["--out", str(tmp_path / "y"), "--data", str(convs), "--tokenizer", str(tok_dir), "--layers", "1,2",
                    "--token-budget", "512", "--max-len", "20"], guard=False) == 0
    log = capsys.readouterr().out
    assert "# truncated 6 of 6 samples to --max-len 20" in log
    meta = json.loads((tmp_path / "y" / "meta.json").read_text())
    assert meta["truncated"] == 6
    assert f"shard     {meta['shards']}/{meta['shards']} |" in log  # progress as shard n/N
    # Without the tokenizer: one line naming the record.
    assert ex.main(["--out", str(tmp_path / "z"), "--data", str(convs), *SMALL], guard=False) == 1
    assert "chat.jsonl:1: a conversation record needs the target's tokenizer" in capsys.readouterr().err


def test_overlapped_shard_writes_equal_inline_ones(tmp_path, data, no_lm_head):
    """--overlap on (what CUDA runs by default: each shard persisted on a writer thread while the
    next batch runs through the target) writes the same shards (every tensor equal, the same
    samples in each) and indexes them alike as the inline writes; --stop-after counts the shards
    started, as before. (The files differ only in the extraction id, which names the run.)"""
    inline, overlapped, stopped = tmp_path / "inline", tmp_path / "overlap", tmp_path / "stop"
    assert _run(inline, data, "--overlap", "off") == 0
    assert _run(overlapped, data, "--overlap", "on") == 0
    names = sorted(p.name for p in inline.glob("shard_*.safetensors"))
    assert names and names == sorted(p.name for p in overlapped.glob("shard_*.safetensors"))
    for name in names:
        a, b = read_shard(inline / name), read_shard(overlapped / name)
        assert a.keys() == b.keys(), name
        for idx in a:
            assert a[idx].keys() == b[idx].keys()
            for key in a[idx]:
                assert torch.equal(a[idx][key], b[idx][key]), (name, idx, key)
    got, want = read_index(overlapped), read_index(inline)
    assert {n: (e.samples, e.lengths) for n, e in got.items()} == {n: (e.samples, e.lengths) for n, e in want.items()}
    assert _run(stopped, data, "--overlap", "on", "--stop-after", "2") == 0
    assert len(read_index(stopped)) == 2


def test_two_identical_extractions_write_byte_identical_shards(tmp_path, data):
    """The same data and arguments into two directories: every shard has the same sha256 (safetensors
    keeps `__metadata__` in a hash map of a per-map order; the shards write it sorted). Encoding the
    same shard several times in this process (a new map each time) gives the same bytes too."""
    from toolkit.fsutil import sha256_file
    from train.extract.shards import encode_shard

    first, second = tmp_path / "a", tmp_path / "b"
    assert _run(first, data) == 0 and _run(second, data) == 0
    names = sorted(p.name for p in first.glob("shard_*.safetensors"))
    assert names and names == sorted(p.name for p in second.glob("shard_*.safetensors"))
    assert [sha256_file(first / n) for n in names] == [sha256_file(second / n) for n in names]
    samples = read_shard(first / names[0])
    metadata = {f"key{i}": str(i) for i in range(8)}
    encoded = {encode_shard(samples, metadata) for _ in range(8)}
    assert len(encoded) == 1
    assert read_shard_metadata(encoded.pop()) == metadata


def read_shard_metadata(data: bytes) -> dict[str, str]:
    import json
    import struct

    from safetensors.torch import load

    assert load(data)  # still a safetensors file safetensors itself reads
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n])["__metadata__"]
