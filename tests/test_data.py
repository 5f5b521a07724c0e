"""Stage-1 data: mixture determinism per (seed, rank), malformed records with file:line, limits,
the 3D asset format (lengths, code ranges), corrupt .npz files and decompression-bomb PNGs."""

from __future__ import annotations

import json
import re
import shutil
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from train.common.shapes import get_shape
from train.stage1.data import (
    TASKS,
    DataConfig,
    DataError,
    MixtureSampler,
    PackedBatches,
    Stage1Data,
    build_batch,
    load_manifests,
    normalized_weights,
)
from train.stage1.synthetic import generate_synthetic
from train.stage1.tokenizer import build_tokenizer

TOK = build_tokenizer(get_shape("tiny"), None, vision=False)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("stage1-data")
    generate_synthetic(d, samples=80, seed=1)
    return d


def _cfg(data_dir: Path, **kw) -> DataConfig:
    base = dict(row_len=128, batch_rows=2, seed=7, num_workers=0)
    base.update(kw)
    return DataConfig(str(data_dir), **base)


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a[k], b[k]) for k in ("input_ids", "labels", "position_ids", "task_ids", "cu_seqlens"))


def test_generated_format(data_dir: Path) -> None:
    man = load_manifests(data_dir)
    assert man.bad == []
    assert all(man.records[t] for t in TASKS)
    _, rec = man.records["gen_img"][0]
    assert (data_dir / rec["image"]).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (data_dir / rec["tokens3d"]).suffix == ".npz"


def test_batch_is_function_of_seed_rank_index(data_dir: Path) -> None:
    ds = PackedBatches(_cfg(data_dir), TOK, rank=0)
    again = PackedBatches(_cfg(data_dir), TOK, rank=0)
    other_rank = PackedBatches(_cfg(data_dir), TOK, rank=1)
    other_seed = PackedBatches(_cfg(data_dir, seed=8), TOK, rank=0)
    b3 = build_batch(ds.sampler, ds.tok, ds.cfg, 3)
    assert _same(b3, build_batch(again.sampler, again.tok, again.cfg, 3))
    assert not _same(b3, build_batch(ds.sampler, ds.tok, ds.cfg, 4))
    assert not _same(b3, build_batch(other_rank.sampler, other_rank.tok, other_rank.cfg, 3))
    assert not _same(b3, build_batch(other_seed.sampler, other_seed.tok, other_seed.cfg, 3))
    assert b3["input_ids"].shape == (2, 128)


def test_worker_loader_order_and_resume(data_dir: Path, tmp_path: Path) -> None:
    """Two loader worker processes give batches in index order; a resume from the saved data state
    (its carry-over buffers, through torch.save / weights-only load) continues bitwise the same,
    with one worker; every drawn document is trained whole, exactly once, across the resume."""
    from train.common.packing import IGNORE_INDEX
    from train.stage1.data import tokenize_record

    cfg = _cfg(data_dir, num_workers=2, prefetch_factor=2, packing="flat")
    loader = Stage1Data(cfg, TOK, rank=0, report=lambda _: None)
    seq = [next(loader) for _ in range(3)]
    torch.save(loader.state_dict(), tmp_path / "data.pt")
    seq += [next(loader) for _ in range(3)]
    loader.close()
    assert [b["batch_index"] for b in seq] == [0, 1, 2, 3, 4, 5]
    state = torch.load(tmp_path / "data.pt", weights_only=True)
    assert state["next_batch"] == 3 and state["streams"] == 2
    assert any(state["carry"].values())  # the oracle: documents wait in a buffer at the save
    resumed = Stage1Data(_cfg(data_dir, num_workers=1, packing="flat"), TOK, rank=0, state=state, report=lambda _: None)
    for want in seq[3:]:
        got = next(resumed)
        assert all(torch.equal(got[k], want[k]) for k in ("input_ids", "labels", "position_ids", "mrope_position_ids",
                                                          "task_ids", "cu_seqlens", "seq_idx"))
        assert (got["carry"], got["placed"]) == (want["carry"], want["placed"])
    # exactly once: the draws of batches 0-5 are the documents placed in them plus the last buffers
    ds = PackedBatches(cfg, TOK, rank=0)
    drawn = []
    for b in seq:
        draws = ds.sampler.draws(b["batch_index"])
        drawn += [(t, n) for t, n, _ in (next(draws) for _ in range(b["n_docs"]))]
    placed = [(t, n) for b in seq for t, n, _ in b["placed"]]
    left = [(t, n) for b in seq[-2:] for t, n, _ in b["carry"]]
    assert sorted(drawn) == sorted(placed + left) and len(placed) > len(seq)
    # whole: every placed document's segment is its record's tokens, all of them
    lines = {t: dict(recs) for t, recs in ds.man.records.items()}
    for b in seq:
        flat_ids = b["input_ids"].reshape(-1)
        cu = b["cu_seqlens"].tolist()
        segs = [flat_ids[a:e].tolist() for a, e in zip(cu[:-1], cu[1:], strict=True)
                if b["task_ids"].reshape(-1)[a] >= 0]
        whole = [tokenize_record(TOK, ds.man.root, t, lines[t][n]).tokens for t, n, span in b["placed"]]
        assert all(span is None for _, _, span in b["placed"])  # no document longer than a row here
        assert sorted(segs) == sorted(whole)
        assert int((b["labels"] != IGNORE_INDEX).sum()) == sum(len(w) - 1 for w in whole)


def test_mixture_follows_weights(data_dir: Path) -> None:
    man = load_manifests(data_dir)
    sampler = MixtureSampler(man, normalized_weights({"und": 3.0, "replay_text": 1.0}, man), seed=0, rank=0)
    draws = sampler.draws(0)
    tasks = [next(draws)[0] for _ in range(2000)]
    assert set(tasks) == {"und", "replay_text"}
    assert 0.70 < tasks.count("und") / len(tasks) < 0.80


def test_weight_on_empty_task_is_an_error(tmp_path: Path, data_dir: Path) -> None:
    (tmp_path / "und.jsonl").write_text((data_dir / "und.jsonl").read_text())
    man = load_manifests(tmp_path)
    with pytest.raises(DataError, match="gen_img.jsonl has no valid records"):
        normalized_weights({"gen_img": 1.0, "und": 1.0}, man)
    with pytest.raises(DataError, match="unknown task"):
        normalized_weights({"gen_image": 1.0}, man)


def _copy(src: Path, dst: Path) -> None:
    shutil.copytree(src, dst)


def test_malformed_records_counted_with_file_and_line(tmp_path: Path, data_dir: Path) -> None:
    d = tmp_path / "data"
    _copy(data_dir, d)
    lines = (d / "gen_txt.jsonl").read_text().splitlines()
    lines.insert(2, '{"id": "x", "text": ')  # line 3: bad JSON
    lines.insert(4, '{"id": "y"}')  # line 5: missing keys
    (d / "gen_txt.jsonl").write_text("\n".join(lines) + "\n")
    # A record whose image file is gone: caught only when loaded, still with file:line.
    img_lines = (d / "replay_img.jsonl").read_text().splitlines()
    (d / json.loads(img_lines[0])["image"]).unlink()

    reported: list[str] = []
    loader = Stage1Data(_cfg(d, max_bad_fraction=0.5, weights={"replay_img": 1.0, "gen_txt": 1.0}), TOK,
                        report=reported.append)
    assert f"{d / 'gen_txt.jsonl'}:3: invalid JSON" in reported[0]
    assert reported[1].startswith(f"malformed record: {d / 'gen_txt.jsonl'}:5: missing key(s) text, tokens3d")
    for _ in range(60):  # until the sampler draws replay_img line 1 (deterministic for this seed)
        next(loader)
        if len(reported) > 2:
            break
    assert reported[2:] == [
        f"malformed record: {d / 'replay_img.jsonl'}:1: unreadable image {d / 'images/replay_img-000000.png'}"
        " (FileNotFoundError)"
    ]
    assert loader.bad_seen >= 1


def test_too_many_malformed_records_stop_the_run(tmp_path: Path, data_dir: Path) -> None:
    d = tmp_path / "data"
    _copy(data_dir, d)
    with open(d / "und.jsonl", "a") as f:
        f.write("not json\n" * 5)
    with pytest.raises(DataError, match=r"5 of \d+ records malformed .* > 1\.0% allowed\); first: .*und.jsonl:\d+"):
        Stage1Data(_cfg(d, max_bad_fraction=0.01), TOK, report=lambda _: None)
    Stage1Data(_cfg(d, max_bad_fraction=0.2), TOK, report=lambda _: None)  # under the limit: runs


def _asset(**over: np.ndarray) -> dict[str, np.ndarray]:
    ss, shape, tex = TOK.codebooks.lengths
    return {"ss": np.zeros(ss, np.int16), "shape": np.ones(shape, np.int16), "tex": np.ones(tex, np.int16), **over}


BAD_ASSETS = {
    "out of range": (lambda p: np.savez(p, **_asset(ss=np.full(8, 256))), r"ss codes out of range \[0, 256\)"),
    "wrong length": (lambda p: np.savez(p, **_asset(shape=np.ones(9, np.int16))),
                     "shape has 9 codes, the asset format wants 10"),
    "missing array": (lambda p: np.savez(p, ss=np.zeros(8, np.int16)), "lacks array.s. shape, tex"),
    "truncated npz": (lambda p: p.write_bytes(p.read_bytes()[:100]), r"unreadable 3D token file .*\(BadZipFile\)"),
    "not an npz": (lambda p: np.save(p.with_suffix(".npy"), np.zeros(3)) or p.with_suffix(".npy").rename(p),
                   "not an .npz archive"),
    "float codes": (lambda p: np.savez(p, **_asset(tex=np.ones(10, np.float32))), "tex codes must be .* integer"),
}


@pytest.mark.parametrize("case", list(BAD_ASSETS))
def test_a_bad_3d_asset_is_a_malformed_record_with_file_and_line(tmp_path: Path, data_dir: Path, case: str) -> None:
    d = tmp_path / "data"
    _copy(data_dir, d)
    make_bad, reason = BAD_ASSETS[case]
    line_no, rec = load_manifests(d).records["und"][1]
    make_bad(d / rec["tokens3d"])
    reported: list[str] = []
    loader = Stage1Data(_cfg(d, weights={"und": 1.0}, max_bad_fraction=0.5), TOK, report=reported.append)
    for _ in range(40):
        next(loader)
        if reported:
            break
    assert len(reported) == 1, reported
    assert reported[0].startswith(f"malformed record: {d / 'und.jsonl'}:{line_no}: "), reported[0]
    assert re.search(reason, reported[0]), reported[0]
    assert loader.bad_seen >= 1


def test_every_bad_asset_stops_the_run_past_max_bad_fraction(tmp_path: Path, data_dir: Path) -> None:
    d = tmp_path / "data"
    _copy(data_dir, d)
    for _, rec in load_manifests(d).records["und"]:
        np.savez(d / rec["tokens3d"], **_asset(ss=np.full(8, 256)))
    loader = Stage1Data(_cfg(d, weights={"und": 1.0}, max_bad_fraction=0.5), TOK, report=lambda _: None)
    with pytest.raises(DataError, match=r"und\.jsonl:\d+: .*ss codes out of range"):
        next(loader)


def _png_claiming(path: Path, width: int, height: int) -> None:
    """A valid PNG header for a width x height RGB image, with one tiny IDAT: a decompression bomb's
    shape (a few hundred bytes on disk that claim gigabytes) without the bytes."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))


@pytest.mark.parametrize(("vision", "side"), [(False, 9000), (True, 9000), (True, 30000)])
def test_a_decompression_bomb_png_is_a_malformed_record(tmp_path: Path, data_dir: Path, vision: bool,
                                                        side: int) -> None:
    """9000^2 is above the loader's limit and below PIL's; 30000^2 (900M pixels) above both."""
    d = tmp_path / "data"
    _copy(data_dir, d)
    line_no, rec = load_manifests(d).records["replay_img"][0]
    _png_claiming(d / rec["image"], side, side)
    tok = build_tokenizer(get_shape("tiny"), None, vision=vision)
    reported: list[str] = []
    loader = Stage1Data(_cfg(d, weights={"replay_img": 1.0}, max_bad_fraction=0.5), tok, report=reported.append)
    for _ in range(40):
        next(loader)
        if reported:
            break
    assert reported and reported[0].startswith(f"malformed record: {d / 'replay_img.jsonl'}:{line_no}: image ")
    assert "decompression bomb" in reported[0] and len(reported[0].splitlines()) == 1


def test_asset_format_any_length(tmp_path: Path) -> None:
    """lengths "any": assets of varying length pass, codes are still range-checked."""
    from train.common.codebooks import CodebookConfig, parse_lengths

    fmt = CodebookConfig(ss=256, shape=256, tex=256, lengths=parse_lengths("any"))
    fmt.check_asset({"ss": np.arange(5), "shape": np.arange(70), "tex": np.arange(1)})
    with pytest.raises(ValueError, match="out of range"):
        fmt.check_asset({"ss": np.arange(5), "shape": np.arange(300), "tex": np.arange(1)})
    assert parse_lengths("1728,any,2048") == (1728, None, 2048)
    for bad in ("1,2", "0,1,2", "a,b,c"):
        with pytest.raises(ValueError):
            parse_lengths(bad)


def test_generator_cli(tmp_path: Path) -> None:
    out = tmp_path / "d"
    proc = subprocess.run([sys.executable, "-m", "train.stage1.synthetic", "--out", str(out), "--samples", "20"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out.glob("*.jsonl")) == sorted(f"{t}.jsonl" for t in TASKS)
    bad = subprocess.run([sys.executable, "-m", "train.stage1.synthetic", "--out", str(out), "--samples", "20",
                          "--shape", "nope"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1
