"""Bad inputs: shard (see tests/badinputs/__init__.py for what a case is).

Hidden-state shards broken after a good extraction, and the inputs of extraction, DFlash and
regeneration around them. The good inputs (one extraction of 12 synthetic samples into 4 shards,
a second extraction of the same samples with other layers, a tokenizer, a tiny target checkpoint)
are built once per test process; each case breaks its own copy.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

from tests.badinputs import Case, built, copy_built

# The good extraction: 12 samples of 12..32 tokens, layers 1,2 of the tiny target, 4 shards.
EXTRACT = ["--layers", "1,2", "--token-budget", "80", "--max-len", "32"]
N_SHARDS = 4
# A DFlash run of two small steps on it.
DFLASH = ["--steps", "2", "--block-size", "4", "--anchors", "4", "--token-budget", "96", "--ckpt-every", "100",
          "--warmup", "1"]


def _quiet(fn, *args, **kwargs) -> None:
    """Build output stays out of the case's captured streams."""
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        rc = fn(*args, **kwargs)
    assert rc == 0, err.getvalue()


def _extraction(layers: str):
    def build(d: Path) -> None:
        from train.extract.data import generate_synthetic
        from train.extract.extract import main

        data = generate_synthetic(d / "data.jsonl", 12, seed=3, vocab=4096, min_len=12, max_len=32, median=20)
        argv = ["--out", str(d / "shards"), "--data", str(data), *EXTRACT]
        argv[argv.index("--layers") + 1] = layers
        _quiet(main, argv, guard=False)
        assert len(list((d / "shards").glob("shard_*.safetensors"))) == N_SHARDS
    return build


GOOD = ("extraction", _extraction("1,2"))
OTHER = ("extraction-layers-1-3", _extraction("1,3"))


def _tokenizer(d: Path) -> None:
    from tests.dflash_fixtures import make_tokenizer

    make_tokenizer(d)


def _target(d: Path) -> None:
    """A tiny stage-1 target saved with save_pretrained, its tokenizer and chat template beside it."""
    import torch

    from train.stage1.model import build_model

    torch.manual_seed(0)
    model, _ = build_model("tiny")
    with contextlib.redirect_stderr(io.StringIO()):  # save_pretrained's progress bar
        model.save_pretrained(str(d))
    _tokenizer(d)


def _shards(tmp: Path) -> Path:
    """A private copy of the good extraction at tmp/x (tmp/x/shards, tmp/x/data.jsonl)."""
    copy_built(*GOOD, tmp / "x")
    return tmp / "x" / "shards"


def shard(k: int) -> str:
    return f"shard_{k:05d}.safetensors"


def _index(root: Path) -> dict:
    return json.loads((root / "index.00000.json").read_text())


def _write_index(root: Path, data: dict) -> None:
    (root / "index.00000.json").write_text(json.dumps(data))


def _rewrite(root: Path, k: int, change) -> None:
    """Rewrite shard k with `change(samples)` applied, indexed as if extraction had written it so
    (its size and sha256 in the index): only the trainer's own checks can find what is wrong."""
    from train.extract.shards import read_shard, write_shard

    path = root / shard(k)
    samples = read_shard(path)
    change(samples)
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
    size, digest = write_shard(path, samples, metadata)
    index = _index(root)
    index["shards"][path.name].update(bytes=size, sha256=digest)
    _write_index(root, index)


def _fill(key: str, value: float):
    def change(samples) -> None:
        for t in samples.values():
            t[key] = t[key].clone().fill_(value)
    return change


# --- setups: each breaks its own copy of the good extraction ------------------------------------


def bit_flip(tmp: Path) -> None:
    path = _shards(tmp) / shard(1)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x10  # inside the tensor data: the header and the size stay valid
    path.write_bytes(bytes(raw))


def nan_hidden(tmp: Path) -> None:
    _rewrite(_shards(tmp), 2, _fill("hidden", float("nan")))


def inf_final_two(tmp: Path) -> None:
    root = _shards(tmp)
    _rewrite(root, 0, _fill("final", float("inf")))
    _rewrite(root, 3, _fill("final", float("-inf")))


def ids_past_vocab(tmp: Path) -> None:
    """Shard 2's samples' first token id past the target's vocabulary (its embedding has 4096 rows)."""
    def change(samples) -> None:
        for t in samples.values():
            t["input_ids"] = t["input_ids"].clone()
            t["input_ids"][0] = 999_999

    _rewrite(_shards(tmp), 2, change)


def truncated(tmp: Path) -> None:
    path = _shards(tmp) / shard(1)
    path.write_bytes(path.read_bytes()[:-100])


def zero_length(tmp: Path) -> None:
    (_shards(tmp) / shard(2)).write_bytes(b"")


def missing(tmp: Path) -> None:
    (_shards(tmp) / shard(3)).unlink()


def extra_files(tmp: Path) -> None:
    root = _shards(tmp)
    shutil.copy(root / shard(0), root / shard(17))  # a stray shard no index names
    (root / "NOTES.txt").write_text("not a shard\n")


def no_index(tmp: Path) -> None:
    (_shards(tmp) / "index.00000.json").unlink()


def index_not_json(tmp: Path) -> None:
    (_shards(tmp) / "index.00000.json").write_text('{"shards": {"shard_00000.safetensors": ')


def index_wrong_version(tmp: Path) -> None:
    root = _shards(tmp)
    _write_index(root, {**_index(root), "version": 99})


def index_outside(tmp: Path) -> None:
    root = _shards(tmp)
    index = _index(root)
    entry = index["shards"].pop(shard(0))
    (tmp / "elsewhere").mkdir()
    shutil.copy(root / shard(0), tmp / "elsewhere" / shard(0))
    index["shards"][f"../elsewhere/{shard(0)}"] = entry
    _write_index(root, index)


def index_absolute(tmp: Path) -> None:
    root = _shards(tmp)
    index = _index(root)
    index["shards"][str((root / shard(0)).resolve())] = index["shards"].pop(shard(0))
    _write_index(root, index)


def index_twice_two_files(tmp: Path) -> None:
    root = _shards(tmp)
    shutil.copy(root / "index.00000.json", root / "index.00001.json")


def index_twice_one_file(tmp: Path) -> None:
    root = _shards(tmp)
    index = _index(root)
    first = json.dumps({shard(0): index["shards"][shard(0)]})[1:-1]
    text = json.dumps(index)
    (root / "index.00000.json").write_text(text.replace('"shards": {', '"shards": {' + first + ", ", 1))


def sample_twice(tmp: Path) -> None:
    root = _shards(tmp)
    index = _index(root)
    a, b = index["shards"][shard(0)], index["shards"][shard(1)]
    b["samples"][0] = a["samples"][0]
    _write_index(root, index)


def sample_out_of_range(tmp: Path) -> None:
    root = _shards(tmp)
    index = _index(root)
    index["shards"][shard(0)]["samples"][0] = 9999
    _write_index(root, index)


def lengths_mismatch(tmp: Path) -> None:
    root = _shards(tmp)
    index = _index(root)
    index["shards"][shard(1)]["lengths"].pop()
    _write_index(root, index)


def _edit_meta(change):
    def setup(tmp: Path) -> None:
        root = _shards(tmp)
        meta = json.loads((root / "meta.json").read_text())
        change(meta)
        (root / "meta.json").write_text(json.dumps(meta))
    return setup


def meta_not_json(tmp: Path) -> None:
    (_shards(tmp) / "meta.json").write_text("preset: tiny\n")


def no_head(tmp: Path) -> None:
    (_shards(tmp) / "target_head.safetensors").unlink()


def mixed(tmp: Path) -> None:
    """Shard 1 of another extraction (same samples, layers 1,3 instead of 1,2), indexed as if it
    belonged: size and sha256 agree, the shapes agree, only the origin differs."""
    root = _shards(tmp)
    other = built(*OTHER) / "shards"
    shutil.copy(other / shard(1), root / shard(1))
    index = _index(root)
    index["shards"][shard(1)] = json.loads((other / "index.00000.json").read_text())["shards"][shard(1)]
    _write_index(root, index)


def foreign_unindexed(tmp: Path) -> None:
    """Shard 1 of the other extraction where this one's shard 1 was, not in the index: what a crash
    between a shard's rename and its index write leaves, had the shard been this extraction's."""
    root = _shards(tmp)
    shutil.copy(built(*OTHER) / "shards" / shard(1), root / shard(1))
    index = _index(root)
    del index["shards"][shard(1)]
    _write_index(root, index)


def synced_away(tmp: Path) -> None:
    """Shard 2 copied to another store by --sync-cmd and deleted here, as the index records."""
    root = _shards(tmp)
    index = _index(root)
    index["shards"][shard(2)]["location"] = "synced"
    _write_index(root, index)
    (root / shard(2)).unlink()


def empty_dir(tmp: Path) -> None:
    (tmp / "empty").mkdir()


def drafter_json(fields: dict):
    def setup(tmp: Path) -> None:
        _shards(tmp)
        (tmp / "drafter.json").write_text(json.dumps(fields))
    return setup


def tokenizer_dir(tmp: Path) -> None:
    copy_built("tokenizer", _tokenizer, tmp / "tok")


def tokenizer_no_template(tmp: Path) -> None:
    tokenizer_dir(tmp)
    (tmp / "chat.jsonl").write_text(GOOD_CONV + "\n")
    config = tmp / "tok" / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data.pop("chat_template", None)
    config.write_text(json.dumps(data))
    (tmp / "tok" / "chat_template.jinja").unlink(missing_ok=True)


def _conversations(lines: list[str], empty: bool = False):
    def setup(tmp: Path) -> None:
        tokenizer_dir(tmp)
        if empty:
            (tmp / "empty").mkdir()
        (tmp / "chat.jsonl").write_text("".join(line + "\n" for line in lines))
    return setup


SYSTEM = {"role": "system", "content": "You repeat."}
USER = {"role": "user", "content": "alpha beta"}
ASSISTANT = {"role": "assistant", "content": "alpha 0 beta 1"}
GOOD_IDS = "".join(json.dumps({"id": i, "input_ids": list(range(40, 60))}) + "\n" for i in range(3))
GOOD_CONV = json.dumps({"id": "c0", "conversations": [SYSTEM, USER, ASSISTANT]})


def out_holds_regen(tmp: Path) -> None:
    (tmp / "data.jsonl").write_text(GOOD_IDS)
    (tmp / "out").mkdir()
    (tmp / "out" / "meta.json").write_text(json.dumps({"init_from": "t", "data": "chat.jsonl", "batch_size": 16}))
    (tmp / "out" / "part_00000.jsonl").write_text('{"id": "c0"}\n')


def out_holds_a_stage1_run(tmp: Path) -> None:
    """A finished stage-1 run folder: its outcome.json and metrics.jsonl name the trainer."""
    (tmp / "data.jsonl").write_text(GOOD_IDS)
    (tmp / "out").mkdir()
    (tmp / "out" / "outcome.json").write_text(json.dumps({"state": "completed", "step": 3, "error": None,
                                                          "trainer": "stage1", "time": 0, "job": "7"}))
    (tmp / "out" / "metrics.jsonl").write_text(json.dumps({"event": "header", "trainer": "stage1"}) + "\n")


def out_meta_not_json(tmp: Path) -> None:
    (tmp / "data.jsonl").write_text(GOOD_IDS)
    (tmp / "out").mkdir()
    (tmp / "out" / "meta.json").write_text("{{{\n")


def data_file(text: str | bytes, name: str = "data.jsonl"):
    def setup(tmp: Path) -> None:
        path = tmp / name
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return setup


def target_dir(tmp: Path) -> None:
    copy_built("target", _target, tmp / "target")
    (tmp / "chat.jsonl").write_text(GOOD_CONV + "\n")


def target_without(*names: str):
    def setup(tmp: Path) -> None:
        target_dir(tmp)
        for name in names:
            for path in (tmp / "target").glob(name):
                path.unlink()
    return setup


def target_config_garbage(tmp: Path) -> None:
    target_dir(tmp)
    (tmp / "target" / "config.json").write_text('{"model_type": "no-such-model", "hidden_size": "wide"}')


def regen_data(text: str | bytes):
    def setup(tmp: Path) -> None:
        target_dir(tmp)
        (tmp / "chat.jsonl").write_bytes(text if isinstance(text, bytes) else text.encode())
    return setup


def regen_out_file(tmp: Path) -> None:
    target_dir(tmp)
    (tmp / "regen").write_text("an earlier run's notes\n")


def not_a_checkpoint(tmp: Path) -> None:
    (tmp / "target").mkdir()
    (tmp / "target" / "README.md").write_text("my notes\n")
    (tmp / "chat.jsonl").write_text(GOOD_CONV + "\n")


# --- the cases --------------------------------------------------------------------------------

DATA = "{tmp}/x/shards"
RUN = ["--data", DATA, "--out", "{tmp}/run", *DFLASH]
SHARD_RE = r"shard_\d{5}\.safetensors"


def dflash(id: str, setup, expect: str, *extra: str, outcome: str = "refused", argv: list[str] | None = None) -> Case:
    return Case("shard", id, [*(argv if argv is not None else RUN), *extra], expect, entry="dflash", setup=setup,
                outcome=outcome)


def extract(id: str, setup, expect: str, argv: list[str], outcome: str = "refused") -> Case:
    return Case("shard", id, argv, expect, entry="extract", setup=setup, outcome=outcome)


def regen(id: str, setup, expect: str, *extra: str) -> Case:
    argv = ["--init-from", "{tmp}/target", "--data", "{tmp}/chat.jsonl", "--out", "{tmp}/regen",
            "--max-new-tokens", "2", "--temperature", "0", *extra]
    return Case("shard", id, argv, expect, entry="regen", setup=setup)


# Extraction over the copy: the same arguments as the good one, so a re-run resumes it.
RESUME = ["--out", DATA, "--data", "{tmp}/x/data.jsonl", *EXTRACT]
SYN = ["--data", "{tmp}/data.jsonl", "--out", "{tmp}/out", *EXTRACT]
SYN_ARGS = dict(zip(SYN[::2], SYN[1::2], strict=True))


def syn(**flags: str) -> list[str]:
    """Extraction of {tmp}/data.jsonl into {tmp}/out with flags replaced or added."""
    merged = {**SYN_ARGS, **{f"--{k.replace('_', '-')}": v for k, v in flags.items()}}
    return [x for kv in merged.items() for x in kv]


CONV_EXTRACT = ["--data", "{tmp}/chat.jsonl", "--tokenizer", "{tmp}/tok", "--out", "{tmp}/out", *EXTRACT]


CASES: list[Case] = [
    # DFlash offline, over a broken copy of a good extraction.
    dflash("bit-flip", bit_flip, rf"{shard(1)}: corrupt shard \(sha256"),
    dflash("nan-hidden", nan_hidden, rf"{shard(2)}: non-finite hidden states"),
    dflash("nan-hidden-within-threshold", nan_hidden, rf"skipping .*{shard(2)}: non-finite hidden states",
           "--max-bad-fraction", "0.3", outcome="counted"),
    dflash("inf-final-above-threshold", inf_final_two, r"non-finite hidden states.*2 of 4 shards bad",
           "--max-bad-fraction", "0.3", "--steps", "6"),
    dflash("token-ids-past-the-vocabulary", ids_past_vocab,
           rf"{shard(2)}: \d+\.input_ids holds token ids in \[\d+, 999999\], outside the target's vocabulary \[0, \d+\)"),
    dflash("token-ids-past-the-vocabulary-within-threshold", ids_past_vocab,
           rf"skipping \S*{shard(2)}: \d+\.input_ids holds token ids .*outside the target's vocabulary",
           "--max-bad-fraction", "0.3", outcome="counted"),
    dflash("truncated", truncated, rf"{shard(1)}: corrupt shard"),
    dflash("zero-length", zero_length, rf"{shard(2)}: corrupt shard \(0 bytes"),
    dflash("missing-indexed-shard", missing, rf"{shard(3)}: .*missing"),
    dflash("synced-away", synced_away, rf"{shard(2)}: shard was synced to another store"),
    dflash("extra-unindexed-files", extra_files, rf"{shard(17)}.*not in the index", outcome="counted"),
    dflash("index-missing", no_index, r"index\.\*\.json"),
    dflash("index-not-json", index_not_json, r"index\.00000\.json: unreadable index"),
    dflash("index-wrong-version", index_wrong_version, r"index\.00000\.json: .*version 99"),
    dflash("index-points-outside", index_outside, r"index\.00000\.json: .*\.\./elsewhere.*not a shard name"),
    dflash("index-absolute-path", index_absolute, r"index\.00000\.json: .*not a shard name"),
    dflash("index-shard-twice-two-files", index_twice_two_files, rf"{shard(0)}.*listed twice"),
    dflash("index-shard-twice-one-file", index_twice_one_file, rf"index\.00000\.json: .*{shard(0)}.*listed twice"),
    dflash("index-sample-in-two-shards", sample_twice, r"sample \d+ .*in both"),
    dflash("index-sample-out-of-range", sample_out_of_range, r"index lists sample 9999 .*12 samples"),
    dflash("index-lengths-mismatch", lengths_mismatch, rf"index\.00000\.json: .*{shard(1)}: 3 samples but 2 lengths"),
    dflash("meta-not-json", meta_not_json, r"meta\.json: not JSON"),
    dflash("meta-no-samples", _edit_meta(lambda m: m.pop("samples")), r"meta\.json: .*samples"),
    dflash("meta-samples-not-a-number", _edit_meta(lambda m: m.update(samples="twelve")),
           r"meta\.json: samples, hidden_size and layers must be non-negative integers"),
    dflash("meta-hidden-size-differs", _edit_meta(lambda m: m.update(hidden_size=128)),
           r"hidden.*128|128.*hidden"),
    dflash("meta-more-layers-than-shards", _edit_meta(lambda m: m.update(layers=[1, 2, 3])),
           r"layers \[1, 2, 3\]|3 layers"),
    dflash("meta-layer-outside-target", _edit_meta(lambda m: m.update(layers=[1, 9])),
           r"layer.*9.*4 layers|layers \[1, 9\]"),
    dflash("target-head-missing", no_head, r"target_head\.safetensors"),
    dflash("mixed-extractions", mixed, rf"{shard(1)}: .*another extraction"),
    dflash("drafter-other-layers", drafter_json({"target_layer_ids": [0, 1, 2]}), r"--drafter .*target_layer_ids",
           "--drafter", "{tmp}/drafter.json"),
    dflash("drafter-other-hidden-size", drafter_json({"hidden_size": 96}), r"--drafter .*hidden_size",
           "--drafter", "{tmp}/drafter.json"),
    dflash("empty-dir", empty_dir, r"empty: no meta\.json", argv=["--data", "{tmp}/empty", "--out", "{tmp}/run",
                                                                   *DFLASH]),
    dflash("data-is-a-file", data_file(GOOD_IDS), r"data\.jsonl: .*not .*directory",
           argv=["--data", "{tmp}/data.jsonl", "--out", "{tmp}/run", *DFLASH]),
    # DFlash options.
    dflash("anchors-zero", None, r"--anchors must be >= 1", "--anchors", "0", argv=["--data", "{tmp}"]),
    dflash("anchors-negative", None, r"--anchors must be >= 1", "--anchors", "-4", argv=["--data", "{tmp}"]),
    dflash("anchors-more-than-samples-allow", _shards, r"--anchors 100000: .*at most \d+", "--anchors", "100000",
           outcome="counted"),
    dflash("block-size-one", None, r"--block-size must be >= 2", "--block-size", "1", argv=["--data", "{tmp}"]),
    dflash("block-size-negative", None, r"--block-size must be >= 2", "--block-size", "-8", argv=["--data", "{tmp}"]),
    # A block may run past a sample's end (its labels there are masked, as SpecForge does), so a
    # block longer than every sample trains; more anchors than the data offers is said, then trained.
    dflash("anchors-beyond-the-longest-sample", _shards,
           r"--anchors 100000: the longest sample offers at most \d+ anchor positions", "--anchors", "100000",
           outcome="counted"),
    dflash("max-bad-fraction-above-one", None, r"--max-bad-fraction", "--max-bad-fraction", "2",
           argv=["--data", "{tmp}"]),
    dflash("online-one-rank", None, r"--topology 2-1 needs 3 ranks", argv=["--mode", "online", "--out", "{tmp}/run"]),
    dflash("offline-without-data", None, r"--mode offline needs --data", argv=["--out", "{tmp}/run"]),
    # Extraction: resume over broken shards (rewritten, and said so).
    extract("resume-over-bit-flip", bit_flip, rf"rewriting {shard(1)}: sha256", RESUME, outcome="counted"),
    extract("resume-over-truncated", truncated, rf"rewriting {shard(1)}: \d+ bytes, index says", RESUME,
            outcome="counted"),
    extract("resume-over-zero-length", zero_length, rf"rewriting {shard(2)}: 0 bytes", RESUME, outcome="counted"),
    extract("resume-over-foreign-unindexed-shard", foreign_unindexed,
            rf"rewriting {shard(1)}: written by another extraction", RESUME, outcome="counted"),
    extract("out-holds-a-regeneration", out_holds_regen, r"out/meta\.json: not an extraction", syn()),
    extract("out-holds-a-stage1-run", out_holds_a_stage1_run,
            r"--out \S+/out holds a stage1 run \(its outcome\.json / metrics\.jsonl\); a run folder belongs to one "
            r"trainer", syn()),
    extract("out-meta-not-json", out_meta_not_json, r"out/meta\.json: not JSON", syn()),
    extract("extract-out-is-a-file", data_file("x", "out"), r"out: .*not a directory", syn()),
    extract("layers-out-of-range", data_file(GOOD_IDS), r"--layers '1,4': .*\[0, 3\]", syn(layers="1,4")),
    extract("layers-duplicate", data_file(GOOD_IDS), r"--layers '1,1'.*twice", syn(layers="1,1")),
    extract("layers-negative", data_file(GOOD_IDS), r"--layers '-1,2': .*\[0, 3\]", [*syn(), "--layers=-1,2"]),
    extract("layers-words", data_file(GOOD_IDS), r"--layers must be comma-separated integers", syn(layers="one,two")),
    extract("token-budget-zero", data_file(GOOD_IDS), r"--token-budget must be >= 2, got 0", syn(token_budget="0")),
    extract("token-budget-negative", data_file(GOOD_IDS), r"--token-budget must be >= 2, got -96", syn(token_budget="-96")),
    extract("max-len-zero", data_file(GOOD_IDS), r"--max-len must be >= 2, got 0", syn(max_len="0")),
    extract("max-len-below-shortest", data_file(GOOD_IDS), r"truncated 3 of 3 samples to --max-len 8",
            syn(max_len="8"), outcome="counted"),
    extract("data-not-jsonl", data_file("id,input_ids\n1,2 3 4\n"), r"data\.jsonl:1: malformed record", syn()),
    extract("data-is-a-directory", empty_dir, r"empty: no such dataset file",
            [*syn(), "--data", "{tmp}/empty"]),
    extract("data-empty", data_file(""), r"data\.jsonl: no samples", syn()),
    extract("data-wrong-keys", data_file('{"id": 1, "tokens": [40, 41, 42]}\n'), r"data\.jsonl:1: malformed record",
            syn()),
    extract("data-not-utf8", data_file(b'{"id": 1, "input_ids": [40, 41]}\n\xff\xfe\x00garbage\n'),
            r"data\.jsonl:2: .*UTF-8", syn()),
    # ids and masks are JSON integers that fit: numpy would truncate 1.5 and true to 1, and raise a bare
    # OverflowError past int64 or for a loss_mask of -1
    extract("data-token-id-beyond-int64", data_file('{"id": 1, "input_ids": [40, 99999999999999999999999]}\n'),
            r"data\.jsonl:1: malformed record \(ValueError: input_ids\[1\] is 99999999999999999999999, not in "
            r"\[-9223372036854775808, 9223372036854775807\]\)", syn()),
    extract("data-token-id-float", data_file('{"id": 1, "input_ids": [40, 41.5]}\n'),
            r"data\.jsonl:1: malformed record \(ValueError: input_ids\[1\] is 41\.5, not an integer\)", syn()),
    extract("data-token-id-bool", data_file('{"id": 1, "input_ids": [true, 41]}\n'),
            r"data\.jsonl:1: malformed record \(ValueError: input_ids\[0\] is true, not an integer\)", syn()),
    extract("data-loss-mask-negative", data_file('{"id": 1, "input_ids": [40, 41], "loss_mask": [1, -1]}\n'),
            r"data\.jsonl:1: malformed record \(ValueError: loss_mask\[1\] is -1, not in \[0, 255\]\)", syn()),
    extract("data-token-out-of-vocab", data_file('{"id": 1, "input_ids": [40, 99999999]}\n'),
            r"data\.jsonl:1: token id out of range", syn()),
    extract("conversation-bad-role", _conversations([json.dumps({"id": 1, "conversations": [
        USER, {"role": "robot", "content": "x"}]})]), r"chat\.jsonl:1: .*role", CONV_EXTRACT),
    extract("conversation-no-assistant", _conversations([json.dumps({"id": 1, "conversations": [SYSTEM, USER]})]),
            r"chat\.jsonl:1: .*assistant turn", CONV_EXTRACT),
    extract("conversation-not-json", _conversations([GOOD_CONV, "<conversation>hi</conversation>"]),
            r"chat\.jsonl:2: malformed record", CONV_EXTRACT),
    extract("conversation-without-tokenizer", _conversations([GOOD_CONV]), r"chat\.jsonl:1: .*tokenizer",
            [a for a in CONV_EXTRACT if a not in ("--tokenizer", "{tmp}/tok")]),
    extract("tokenizer-dir-empty", _conversations([GOOD_CONV], empty=True), r"--tokenizer: .*empty: no tokenizer",
            [*CONV_EXTRACT, "--tokenizer", "{tmp}/empty"]),
    extract("tokenizer-without-chat-template", tokenizer_no_template, r"--tokenizer .*no chat template",
            CONV_EXTRACT),
    extract("init-from-not-a-checkpoint", not_a_checkpoint, r"target.*config\.json",
            [*syn(), "--init-from", "{tmp}/target"]),
    # Regeneration.
    regen("conversations-garbage", regen_data("\x00\x01 not json {\n"), r"chat\.jsonl:1: malformed conversation"),
    regen("conversations-not-utf8", regen_data(b"\xff\xfe\xfd\n"), r"chat\.jsonl:1: .*UTF-8"),
    regen("conversations-not-a-list", regen_data('{"id": 1, "conversations": "hi"}\n'),
          r"chat\.jsonl:1: malformed conversation"),
    regen("conversations-empty", regen_data("\n\n"), r"chat\.jsonl: no conversations"),
    regen("regen-out-is-a-file", regen_out_file, r"--out .*regen: a file, not a directory"),
    regen("target-not-a-checkpoint", not_a_checkpoint, r"--init-from .*target.*config\.json"),
    regen("target-without-tokenizer", target_without("tokenizer*.json", "chat_template.jinja"),
          r"--init-from: checkpoint .*target: no tokenizer"),
    regen("target-without-chat-template", target_without("chat_template.jinja"),
          r"--init-from .*target: the tokenizer has no chat template"),
    regen("target-without-weights", target_without("*.safetensors"), r"--init-from .*target: no \*\.safetensors weights there"),
    regen("target-config-garbage", target_config_garbage, r"--init-from .*target: .*no-such-model"),
]
