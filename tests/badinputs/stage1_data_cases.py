"""Bad inputs: stage-1 data and its options (see tests/badinputs/__init__.py for what a case is).

One synthetic dataset and two tiny transformers checkpoints (text-only, with a vision tower) are
built once (`built`); a case links or copies them into its directory and breaks one thing. Record
faults come twice: below --max-bad-fraction they are counted (rc 0, `file:line: reason` printed),
above it (--max-bad-fraction 0) the run stops naming the first one. The sampled faults (a file a
record points to) sit in a data dir whose mixture has only `und` / `replay_img`, one good record
and the bad one, so the first batch draws it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import struct
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from tests.badinputs import Case, built, copy_built

DATA = "{tmp}/data"
RUN = ["--shape", "tiny", "--batch-rows", "1", "--row-len", "128", "--num-workers", "0", "--lr", "3e-3",
       "--warmup", "1", "--steps", "1", "--ckpt-every", "0", "--export", "off", "--out", "{tmp}/run",
       "--data-dir", DATA]
COUNTED = [*RUN, "--max-bad-fraction", "0.9"]
STRICT = [*RUN, "--max-bad-fraction", "0"]
UND = ["--weights", '{"und": 1}']
IMG = ["--weights", '{"replay_img": 1}']


def _synthetic(d: Path) -> None:
    from train.stage1.synthetic import generate_synthetic

    generate_synthetic(d, samples=40, seed=0)


def _quiet(build: Callable[[], object]) -> None:
    """Build a fixture without its progress bars (the case's output is what is judged)."""
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        build()


def _hf_text(d: Path) -> None:
    from tests.hf_fixtures import make_checkpoint

    _quiet(lambda: make_checkpoint(d))


def _hf_vision(d: Path) -> None:
    from tests.hf_fixtures import make_checkpoint

    _quiet(lambda: make_checkpoint(d, vision=True))


def _link(name: str, build: Callable[[Path], None], dest: str) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / dest).symlink_to(built(name, build), target_is_directory=True)

    return setup


LINK_DATA = _link("stage1-synthetic", _synthetic, "data")


def data(mutate: Callable[[Path], None]) -> Callable[[Path], None]:
    """A private copy of the synthetic data at {tmp}/data, then `mutate(data_dir)`."""
    def setup(tmp: Path) -> None:
        mutate(copy_built("stage1-synthetic", _synthetic, tmp / "data"))

    return setup


def _lines(path: Path) -> list[str]:
    return path.read_text().splitlines()


def append_line(task: str, line: str | bytes) -> Callable[[Path], None]:
    """A malformed line appended after the good ones (its line number: len + 1)."""
    def mutate(d: Path) -> None:
        with open(d / f"{task}.jsonl", "ab") as f:
            f.write((line if isinstance(line, bytes) else line.encode()) + b"\n")

    return mutate


def every_line(task: str, line: str | bytes) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        n = len(_lines(d / f"{task}.jsonl"))
        (d / f"{task}.jsonl").write_bytes(b"\n".join([line if isinstance(line, bytes) else line.encode()] * n) + b"\n")

    return mutate


def one_good_and(task: str, key: str, name: str, content: bytes | Callable[[Path], bytes] | None) -> Callable[[Path], None]:
    """`task`.jsonl becomes its first record and, at line 2, a copy whose `key` file is `name`
    holding `content` (None: the file does not exist)."""
    def mutate(d: Path) -> None:
        first = json.loads(_lines(d / f"{task}.jsonl")[0])
        bad = {**first, "id": "bad", key: name}
        if content is not None:
            target = d / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(content(d) if callable(content) else content)
        (d / f"{task}.jsonl").write_text(json.dumps(first) + "\n" + json.dumps(bad) + "\n")

    return mutate


def one_good_linked(task: str, key: str, name: str, target: str) -> Callable[[Path], None]:
    """As one_good_and, with the bad record's file a symlink to `target`."""
    def mutate(d: Path) -> None:
        one_good_and(task, key, name, None)(d)
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        (d / name).symlink_to(target)

    return mutate


def npz(**arrays: object) -> bytes:
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    return buf.getvalue()


def asset(**override: object) -> bytes:
    """A tiny-shape asset (8 SS, 10 shape, 10 tex codes in [0, 256)) with some arrays replaced."""
    good = {"ss": np.arange(8, dtype=np.int16), "shape": np.arange(10, dtype=np.int16),
            "tex": np.arange(10, dtype=np.int16)}
    return npz(**{k: v for k, v in {**good, **override}.items() if v is not None})


def truncated_npz(d: Path) -> bytes:
    whole = (d / "tokens3d" / "und-000000.npz").read_bytes()
    return whole[: len(whole) // 2]


def truncated_png(d: Path) -> bytes:
    whole = (d / "images" / "replay_img-000000.png").read_bytes()
    return whole[: len(whole) // 2]


def png_claiming(width: int, height: int) -> bytes:
    """A PNG whose header claims width x height RGB pixels over a few bytes of data: a bomb."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
            + chunk(b"IEND", b""))


def hf_copy(name: str, build: Callable[[Path], None], mutate: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        LINK_DATA(tmp)
        mutate(copy_built(name, build, tmp / "ckpt"))

    return setup


def _drop_tokenizer(d: Path) -> None:
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt"):
        (d / f).unlink(missing_ok=True)


def _edit_json(file: str, **changes: object) -> Callable[[Path], None]:
    def mutate(d: Path) -> None:
        doc = json.loads((d / file).read_text())
        doc.update(changes)
        (d / file).write_text(json.dumps(doc))

    return mutate


def _plain_tokenizer(d: Path) -> None:
    """The checkpoint's tokenizer replaced by one trained without Qwen's vision tokens: the config's
    image_token_id then names an ordinary BPE piece."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tests.hf_fixtures import training_lines

    _drop_tokenizer(d)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(training_lines(), trainers.BpeTrainer(
        vocab_size=600, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(d)


def _config_garbage(d: Path) -> None:
    (d / "config.json").write_text("{not json")


HF_TEXT = ("hf-text", _hf_text)
HF_VISION = ("hf-vision", _hf_vision)
INIT = [*RUN, "--init-from", "{tmp}/ckpt"]


def _empty_dir(tmp: Path) -> None:
    (tmp / "data").mkdir()


def _unknown_files(tmp: Path) -> None:
    (tmp / "data").mkdir()
    (tmp / "data" / "train.jsonl").write_text('{"text": "hello"}\n')
    (tmp / "data" / "README.md").write_text("not a manifest\n")


def _data_is_file(tmp: Path) -> None:
    (tmp / "data").write_text("gen_img.jsonl\n")


def _all_bad(d: Path) -> None:
    for task in ("gen_img", "gen_txt", "und", "replay_img", "replay_text"):
        every_line(task, b"{ not json ,")(d)


UND_LINE = "und.jsonl:2"
IMG_LINE = "replay_img.jsonl:2"

CASES = [
    # ---- the data directory
    Case("stage1-data", "data-dir-missing", [*RUN[:-1], "{tmp}/nowhere"], r"data directory \S*nowhere does not exist",
         entry="stage1"),
    Case("stage1-data", "data-dir-empty", RUN, r"no stage-1 manifests in \S*data \(expected .*gen_img\.jsonl",
         entry="stage1", setup=_empty_dir),
    Case("stage1-data", "data-dir-unknown-files", RUN, r"no stage-1 manifests in \S*data", entry="stage1",
         setup=_unknown_files),
    Case("stage1-data", "data-dir-is-a-file", RUN, r"data directory \S*data is not a directory", entry="stage1",
         setup=_data_is_file),
    Case("stage1-data", "manifest-is-a-directory", RUN, r"\S*data/und\.jsonl is not a file", entry="stage1",
         setup=data(lambda d: ((d / "und.jsonl").unlink(), (d / "und.jsonl").mkdir()))),
    Case("stage1-data", "synthetic-samples-zero", [*RUN[:-2], "--synthetic-samples", "0"],
         r"--synthetic-samples must be >= 1, got 0", entry="stage1"),
    Case("stage1-data", "num-workers-negative", [*RUN, "--num-workers", "-1"], r"--num-workers must be >= 0, got -1",
         entry="stage1"),
    # ---- manifest lines: counted below --max-bad-fraction, refused above
    Case("stage1-data", "jsonl-not-utf8-counted", COUNTED, r"malformed record: \S*und\.jsonl:10: not UTF-8 \(byte 0xff at column 1\)",
         entry="stage1", outcome="counted", setup=data(append_line("und", b"\xff\xfe{\"id\": \x80}"))),
    # a byte that is not UTF-8 inside the text: a malformed record (file:line), never U+FFFD trained on
    Case("stage1-data", "text-not-utf8-counted", COUNTED,
         r"malformed record: \S*replay_text\.jsonl:5: not UTF-8 \(byte 0xe9 at column 25\)", entry="stage1",
         outcome="counted", setup=data(append_line("replay_text", b'{"id": "x", "text": "caf\xe9 au lait"}'))),
    Case("stage1-data", "text-not-utf8-refused", STRICT,
         r"1 of \d+ records malformed .*first: \S*replay_text\.jsonl:5: not UTF-8 \(byte 0xe9", entry="stage1",
         setup=data(append_line("replay_text", b'{"id": "x", "text": "caf\xe9 au lait"}'))),
    Case("stage1-data", "jsonl-garbage-refused", [*RUN], r"of \d+ records malformed .*first: \S*gen_img\.jsonl:1: invalid JSON",
         entry="stage1", setup=data(_all_bad)),
    Case("stage1-data", "record-missing-keys-counted", COUNTED,
         r"malformed record: \S*gen_txt\.jsonl:10: missing key\(s\) text, tokens3d", entry="stage1", outcome="counted",
         setup=data(append_line("gen_txt", '{"id": "x"}'))),
    Case("stage1-data", "record-missing-keys-refused", STRICT,
         r"1 of \d+ records malformed .*first: \S*gen_txt\.jsonl:10: missing key\(s\) text, tokens3d", entry="stage1",
         setup=data(append_line("gen_txt", '{"id": "x"}'))),
    Case("stage1-data", "record-not-an-object", STRICT, r"replay_text\.jsonl:5: not a JSON object", entry="stage1",
         setup=data(append_line("replay_text", '["id", "text"]'))),
    Case("stage1-data", "record-text-wrong-type", STRICT, r"replay_text\.jsonl:5: 'text' must be a non-empty string",
         entry="stage1", setup=data(append_line("replay_text", '{"id": "x", "text": 5}'))),
    Case("stage1-data", "record-image-escapes", STRICT,
         r"replay_img\.jsonl:10: 'image' must be a path inside the data directory", entry="stage1",
         setup=data(append_line("replay_img", '{"id": "x", "image": "../../etc/passwd", "text": "t"}'))),
    Case("stage1-data", "record-image-absolute", COUNTED,
         r"malformed record: \S*replay_img\.jsonl:10: 'image' must be a path inside the data directory",
         entry="stage1", outcome="counted",
         setup=data(append_line("replay_img", '{"id": "x", "image": "/etc/hostname", "text": "t"}'))),
    # ---- 3D asset files (sampled: one good record and the bad one)
    Case("stage1-data", "asset-missing-file", [*COUNTED, *UND], rf"malformed record: \S*{UND_LINE}: unreadable 3D token file",
         entry="stage1", outcome="counted", setup=data(one_good_and("und", "tokens3d", "tokens3d/nope.npz", None))),
    # symlinks: a manifest reads only the data it ships, and a loop is named, not followed forever
    Case("stage1-data", "asset-symlink-out-counted", [*COUNTED, *UND],
         rf"malformed record: \S*{UND_LINE}: tokens3d 'tokens3d/out.npz': \S*out\.npz is a symlink out of the data "
         r"directory \(to /etc/hostname\)", entry="stage1", outcome="counted",
         setup=data(one_good_linked("und", "tokens3d", "tokens3d/out.npz", "/etc/hostname"))),
    Case("stage1-data", "asset-symlink-loop-refused", [*STRICT, *UND],
         rf"records malformed .*first: \S*{UND_LINE}: tokens3d 'tokens3d/loop.npz': \S*loop\.npz is a symlink loop",
         entry="stage1", setup=data(one_good_linked("und", "tokens3d", "tokens3d/loop.npz", "loop.npz"))),
    Case("stage1-data", "image-symlink-out-refused", [*STRICT, *IMG],
         r"records malformed .*first: \S*replay_img\.jsonl:2: image 'images/out.png': \S*out\.png is a symlink out "
         r"of the data directory", entry="stage1",
         setup=data(one_good_linked("replay_img", "image", "images/out.png", "/etc/hostname"))),
    Case("stage1-data", "asset-npz-corrupt-counted", [*COUNTED, *UND],
         rf"malformed record: \S*{UND_LINE}: unreadable 3D token file \S*bad\.npz", entry="stage1", outcome="counted",
         setup=data(one_good_and("und", "tokens3d", "tokens3d/bad.npz", b"PK\x03\x04 garbage, not a zip"))),
    Case("stage1-data", "asset-npz-corrupt-refused", [*STRICT, *UND],
         rf"records malformed .*first: \S*{UND_LINE}: unreadable 3D token file \S*bad\.npz", entry="stage1",
         setup=data(one_good_and("und", "tokens3d", "tokens3d/bad.npz", b"PK\x03\x04 garbage, not a zip"))),
    Case("stage1-data", "asset-npz-truncated", [*COUNTED, *UND], rf"{UND_LINE}: unreadable 3D token file \S*cut\.npz",
         entry="stage1", outcome="counted", setup=data(one_good_and("und", "tokens3d", "tokens3d/cut.npz", truncated_npz))),
    Case("stage1-data", "asset-npy-not-npz", [*STRICT, *UND], rf"{UND_LINE}: 3D token file \S*a\.npy is not an \.npz",
         entry="stage1", setup=data(one_good_and("und", "tokens3d", "tokens3d/a.npy", b"\x93NUMPY\x01\x00v\x00"
                                                 + b"{'descr': '<i2', 'fortran_order': False, 'shape': (2,), }".ljust(117)
                                                 + b"\n" + b"\0" * 4))),
    Case("stage1-data", "asset-missing-array", [*COUNTED, *UND], rf"{UND_LINE}: 3D token file \S* lacks array\(s\) tex",
         entry="stage1", outcome="counted", setup=data(one_good_and("und", "tokens3d", "tokens3d/b.npz", asset(tex=None)))),
    Case("stage1-data", "asset-wrong-length", [*STRICT, *UND], rf"{UND_LINE}: \S*b\.npz: ss has 7 codes, the asset format wants 8",
         entry="stage1", setup=data(one_good_and("und", "tokens3d", "tokens3d/b.npz", asset(ss=np.arange(7))))),
    Case("stage1-data", "asset-code-out-of-range", [*COUNTED, *UND],
         rf"malformed record: \S*{UND_LINE}: \S*b\.npz: shape codes out of range \[0, 256\): found \[247, 256\]",
         entry="stage1", outcome="counted",
         setup=data(one_good_and("und", "tokens3d", "tokens3d/b.npz", asset(shape=np.arange(247, 257))))),
    Case("stage1-data", "asset-negative-code", [*STRICT, *UND], rf"{UND_LINE}: \S*b\.npz: tex codes out of range \[0, 256\): found \[-1",
         entry="stage1", setup=data(one_good_and("und", "tokens3d", "tokens3d/b.npz", asset(tex=np.arange(-1, 9))))),
    Case("stage1-data", "asset-float-codes", [*STRICT, *UND], rf"{UND_LINE}: \S*b\.npz: ss codes must be a non-empty 1-D integer array",
         entry="stage1", setup=data(one_good_and("und", "tokens3d", "tokens3d/b.npz", asset(ss=np.arange(8) + 0.5)))),
    Case("stage1-data", "asset-bool-codes", [*STRICT, *UND], rf"{UND_LINE}: \S*b\.npz: ss codes must be a non-empty 1-D integer array",
         entry="stage1", setup=data(one_good_and("und", "tokens3d", "tokens3d/b.npz", asset(ss=np.ones(8, bool))))),
    Case("stage1-data", "asset-2d", [*STRICT, *UND], rf"{UND_LINE}: \S*b\.npz: shape codes must be a non-empty 1-D",
         entry="stage1", setup=data(one_good_and("und", "tokens3d", "tokens3d/b.npz", asset(shape=np.zeros((2, 5), int))))),
    Case("stage1-data", "asset-pickled-object", [*STRICT, *UND], rf"{UND_LINE}: unreadable 3D token file \S*b\.npz",
         entry="stage1", setup=data(one_good_and("und", "tokens3d", "tokens3d/b.npz",
                                                 asset(ss=np.array([{"a": 1}] * 8, dtype=object))))),
    # a wrong format for the whole dataset: every record fails the same way, the run stops
    Case("stage1-data", "codebook-sizes-below-the-data", [*RUN, *UND, "--codebook-sizes", "16"],
         r"batch 0: 1001 malformed records against 0 good; last: \S*und\.jsonl:\d+: .*ss codes out of range \[0, 16\)", entry="stage1", setup=LINK_DATA),
    Case("stage1-data", "codebook-sizes-below-the-data-in-a-worker", [*RUN, *UND, "--codebook-sizes", "16",
                                                                       "--num-workers", "1"],
         r"batch 0: 1001 malformed records against 0 good; last: \S*und\.jsonl:\d+: .*ss codes out of range \[0, 16\)",
         entry="stage1", setup=LINK_DATA),
    Case("stage1-data", "asset-lengths-other-than-the-data", [*RUN, *UND, "--asset-lengths", "9,10,10"],
         r"batch 0: 1001 malformed records against 0 good; last: .*ss has 8 codes, the asset format wants 9", entry="stage1", setup=LINK_DATA),
    # ---- images (sampled; the vision tower is on)
    Case("stage1-data", "png-bomb-counted", [*COUNTED, *IMG],
         rf"malformed record: \S*{IMG_LINE}: image \S*bomb\.png is 9000x8000 pixels, above the \d+ limit", entry="stage1",
         outcome="counted", setup=data(one_good_and("replay_img", "image", "images/bomb.png", png_claiming(9000, 8000)))),
    Case("stage1-data", "png-bomb-huge-refused", [*STRICT, *IMG], rf"{IMG_LINE}: image \S*bomb\.png: .*decompression bomb",
         entry="stage1", setup=data(one_good_and("replay_img", "image", "images/bomb.png", png_claiming(60000, 60000)))),
    Case("stage1-data", "png-not-an-image", [*COUNTED, *IMG],
         rf"malformed record: \S*{IMG_LINE}: unreadable image \S*text\.png \(UnidentifiedImageError\)", entry="stage1",
         outcome="counted", setup=data(one_good_and("replay_img", "image", "images/text.png", b"just some text\n"))),
    Case("stage1-data", "png-truncated", [*STRICT, *IMG], rf"{IMG_LINE}: unreadable image \S*cut\.png", entry="stage1",
         setup=data(one_good_and("replay_img", "image", "images/cut.png", truncated_png))),
    Case("stage1-data", "image-missing", [*COUNTED, *IMG], rf"malformed record: \S*{IMG_LINE}: unreadable image \S*gone\.png",
         entry="stage1", outcome="counted", setup=data(one_good_and("replay_img", "image", "images/gone.png", None))),
    # ---- --weights
    Case("stage1-data", "weights-not-json", [*RUN, "--weights", "gen_img=2"],
         r"argument --weights: must be a JSON object of name -> number, got 'gen_img=2'", entry="stage1"),
    Case("stage1-data", "weights-a-list", [*RUN, "--weights", "[1, 2]"], r"argument --weights: must be a JSON object",
         entry="stage1"),
    Case("stage1-data", "weights-unknown-task", [*RUN, "--weights", '{"gen_img": 1, "bogus": 2}'],
         r"--weights: unknown task\(s\) bogus; known: gen_img, ", entry="stage1"),
    Case("stage1-data", "weights-negative", [*RUN, "--weights", '{"gen_img": -1}'],
         r"--weights: mixture weights must be finite and >= 0, got gen_img -1.0", entry="stage1"),
    Case("stage1-data", "weights-nan", [*RUN, "--weights", '{"gen_img": NaN, "und": 1}'],
         r"--weights: mixture weights must be finite and >= 0, got gen_img nan", entry="stage1"),
    Case("stage1-data", "weights-zero-total", [*RUN, "--weights", '{"gen_img": 0, "und": 0}'],
         r"--weights: .*sum to 0", entry="stage1"),
    Case("stage1-data", "weights-task-without-data", [*RUN, "--weights", '{"und": 1}'],
         r"task und has weight 1.0 but \S*und\.jsonl has no valid records", entry="stage1",
         setup=data(lambda d: (d / "und.jsonl").write_text(""))),
    # ---- --max-bad-fraction
    Case("stage1-data", "max-bad-fraction-negative", [*RUN, "--max-bad-fraction", "-0.1"],
         r"--max-bad-fraction must be between 0 and 1, got -0.1", entry="stage1"),
    Case("stage1-data", "max-bad-fraction-above-1", [*RUN, "--max-bad-fraction", "1.5"],
         r"--max-bad-fraction must be between 0 and 1, got 1.5", entry="stage1"),
    Case("stage1-data", "max-bad-fraction-nan", [*RUN, "--max-bad-fraction", "nan"],
         r"--max-bad-fraction must be between 0 and 1, got nan", entry="stage1"),
    # ---- the asset format's flags
    Case("stage1-data", "codebook-sizes-garbage", [*RUN, "--codebook-sizes", "big"],
         r"codebook sizes must be 1 or 3 comma-separated positive integers .*got 'big'", entry="stage1"),
    Case("stage1-data", "codebook-sizes-zero", [*RUN, "--codebook-sizes", "256,0,256"],
         r"codebook sizes must be .*positive integers .*got '256,0,256'", entry="stage1"),
    Case("stage1-data", "asset-lengths-two", [*RUN, "--asset-lengths", "8,10"],
         r"asset lengths must be 3 comma-separated numbers or 'any'", entry="stage1"),
    Case("stage1-data", "asset-lengths-negative", [*RUN, "--asset-lengths", "8,-10,10"],
         r"asset length '-10' must be a positive integer or 'any'", entry="stage1"),
    # ---- --init-from and --vision
    Case("stage1-data", "init-from-missing", [*RUN, "--init-from", "{tmp}/nowhere"],
         r"(checkpoint|--init-from) \S*nowhere: not a directory", entry="stage1"),
    Case("stage1-data", "init-from-not-a-checkpoint", INIT, r"(checkpoint|--init-from) \S*ckpt: no config.json there", entry="stage1",
         setup=hf_copy("empty", lambda d: None, lambda d: None)),
    Case("stage1-data", "init-from-config-garbage", INIT, r"(checkpoint|--init-from) \S*ckpt: config.json does not load", entry="stage1",
         setup=hf_copy(*HF_TEXT, _config_garbage)),
    Case("stage1-data", "init-from-no-tokenizer", INIT, r"checkpoint \S*ckpt: no tokenizer there", entry="stage1",
         setup=hf_copy(*HF_TEXT, _drop_tokenizer)),
    Case("stage1-data", "init-from-tokenizer-without-vision-tokens", [*INIT, "--vision", "on"],
         r"checkpoint \S*ckpt: its image_token_id \d+ is .*not one of its tokenizer's special tokens", entry="stage1",
         setup=hf_copy(*HF_VISION, _plain_tokenizer)),
    Case("stage1-data", "init-from-image-token-out-of-range", [*INIT, "--vision", "on"],
         r"checkpoint \S*ckpt: its image_token_id 100000 is unknown to its tokenizer", entry="stage1",
         setup=hf_copy(*HF_VISION, _edit_json("config.json", image_token_id=100000))),
    Case("stage1-data", "vision-on-text-only-checkpoint", [*INIT, "--vision", "on"],
         r"checkpoint \S*ckpt: no vision tower in its config.json; use --vision off", entry="stage1",
         setup=hf_copy(*HF_TEXT, lambda d: None)),
    Case("stage1-data", "vision-not-on-off", [*RUN, "--vision", "yes"], r"argument --vision: expected on or off",
         entry="stage1"),
]



def fifo_for(task: str, key: str, name: str) -> Callable[[Path], None]:
    """As one_good_and, with the bad record's file a FIFO: opened, it would block the loader forever."""
    def mutate(d: Path) -> None:
        one_good_and(task, key, name, None)(d)
        (d / name).parent.mkdir(parents=True, exist_ok=True)
        os.mkfifo(d / name)

    return mutate


def npz_claiming(count: int) -> bytes:
    """A good asset whose ss.npy header claims `count` int16 entries over the 8 it holds."""
    good = zipfile.ZipFile(io.BytesIO(asset()))
    header = f"{{'descr': '<i2', 'fortran_order': False, 'shape': ({count},), }}".encode()
    header = header.ljust(-(10 + len(header) + 1) % 64 + len(header)) + b"\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        for name in good.namelist():
            z.writestr(name, b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header + b"\0" * 16
                       if name == "ss.npy" else good.read(name))
    return buf.getvalue()


# ---- one bad record is named and skipped (within --max-bad-fraction), whatever is wrong with it
CASES += [
    Case("stage1-data", "image-a-fifo-counted", [*COUNTED, *IMG],
         rf"malformed record: \S*{IMG_LINE}: image 'images/pipe\.png': \S*pipe\.png is not a regular file", entry="stage1",
         outcome="counted", setup=data(fifo_for("replay_img", "image", "images/pipe.png"))),
    Case("stage1-data", "asset-a-fifo-counted", [*COUNTED, *UND],
         rf"malformed record: \S*{UND_LINE}: tokens3d 'tokens3d/pipe\.npz': \S*pipe\.npz is not a regular file",
         entry="stage1", outcome="counted", setup=data(fifo_for("und", "tokens3d", "tokens3d/pipe.npz"))),
    Case("stage1-data", "text-lone-surrogate-counted", COUNTED,
         r"malformed record: \S*replay_text\.jsonl:5: 'text' holds a lone surrogate \(U\+D800 at character 4\)",
         entry="stage1", outcome="counted", setup=data(append_line("replay_text", '{"id": "x", "text": "abc\\ud800"}'))),
    Case("stage1-data", "image-a-number-on-a-text-task", STRICT,
         r"1 of \d+ records malformed .*first: \S*replay_text\.jsonl:5: 'image' must be a string, got int",
         entry="stage1", setup=data(append_line("replay_text", '{"id": "x", "text": "t", "image": 5}'))),
    Case("stage1-data", "image-path-with-nul-counted", [*COUNTED, *IMG],
         r"malformed record: \S*replay_img\.jsonl:10: 'image' holds a NUL character", entry="stage1", outcome="counted",
         setup=data(append_line("replay_img", '{"id": "x", "image": "images/a\\u0000.png", "text": "t"}'))),
    Case("stage1-data", "asset-npy-header-claims-1e11-counted", [*COUNTED, *UND],
         rf"malformed record: \S*{UND_LINE}: 3D token file \S*huge\.npz: ss's header claims 100000000000 entries",
         entry="stage1", outcome="counted",
         setup=data(one_good_and("und", "tokens3d", "tokens3d/huge.npz", npz_claiming(10**11)))),
]

# the data-less refusals need no data; everything else links the synthetic set when it has no setup
for _case in CASES:
    if _case.setup is None:
        _case.setup = LINK_DATA

