"""Bad inputs: checkpoints (see tests/badinputs/__init__.py for what a case is).

A finished tiny stage-1 run (2 steps, a checkpoint after each) is built once; a case copies it to
{tmp}/run, breaks something, and re-runs the same argv (resume) or `launch export`s it. Damage
to the newest checkpoint is tolerated by design: the run resumes from the newest one that
verifies and says which ("counted"); when none verifies it stops, naming them, and deletes
nothing (tests/test_checkpoint.py checks the files are all still there).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

from tests.badinputs import Case, built, copy_built
from tests.badinputs.stage1_data_cases import _quiet, _synthetic

RUN_ARGS = ["--shape", "tiny", "--batch-rows", "1", "--row-len", "128", "--num-workers", "0", "--lr", "3e-3",
            "--warmup", "1", "--ckpt-every", "1", "--export", "off"]
def resume(out: str = "{tmp}/run", *extra: str) -> list[str]:
    return [*RUN_ARGS, "--steps", "2", "--out", out, "--data-dir", "{tmp}/data", *extra]


RESUME = resume()
# The finished run copied elsewhere with its data inside it, resumed there: `launch resume` of a job
# submitted with --arg out= the copy runs this command line.
MOVED = [*RUN_ARGS, "--steps", "2", "--out", "{tmp}/moved", "--data-dir", "{tmp}/moved/data"]
# The newest checkpoint damaged: --steps 1, so the resume from step 1 is all the run does.
FROM_1 = [*RESUME, "--steps", "1"]
STEP1, STEP2 = "step_00000001", "step_00000002"


def _finished_run(d: Path) -> None:
    from train.stage1.train import main

    data = built("stage1-synthetic", _synthetic)
    rc: list[int] = []
    _quiet(lambda: rc.append(main([*RUN_ARGS, "--steps", "2", "--out", str(d), "--data-dir", str(data)], guard=False)))
    assert rc == [0] and (d / "checkpoints" / STEP2).is_dir(), rc


def finished_run(tmp: Path) -> Path:
    """{tmp}/run: a private copy of the finished run; {tmp}/data: its dataset."""
    (tmp / "data").symlink_to(built("stage1-synthetic", _synthetic), target_is_directory=True)
    return copy_built("stage1-run", _finished_run, tmp / "run")


def broken(*mutations: Callable[[Path], None]) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        ckpts = finished_run(tmp) / "checkpoints"
        for mutate in mutations:
            mutate(ckpts)

    return setup


def flip(step: str, file: str) -> Callable[[Path], None]:
    def mutate(ckpts: Path) -> None:
        f = ckpts / step / file
        data = bytearray(f.read_bytes())
        data[len(data) // 2] ^= 0x01  # same size: only the sha256 can tell
        f.write_bytes(bytes(data))

    return mutate


def truncate(step: str, file: str) -> Callable[[Path], None]:
    def mutate(ckpts: Path) -> None:
        f = ckpts / step / file
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])

    return mutate


def delete(step: str, file: str) -> Callable[[Path], None]:
    return lambda ckpts: (ckpts / step / file).unlink()


def write(rel: str, content: str | bytes) -> Callable[[Path], None]:
    def mutate(ckpts: Path) -> None:
        (ckpts / rel).write_bytes(content if isinstance(content, bytes) else content.encode())

    return mutate


def wrong_sha(step: str) -> Callable[[Path], None]:
    def mutate(ckpts: Path) -> None:
        path = ckpts / step / "MANIFEST.json"
        manifest = json.loads(path.read_text())
        manifest["files"]["model.pt"]["sha256"] = hashlib.sha256(b"another file").hexdigest()
        path.write_text(json.dumps(manifest))

    return mutate


class _RunsCode:
    """Unpickled with pickle (or torch.load(weights_only=False)), it creates `marker`: the test
    of a crafted checkpoint file is that the marker never appears."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204 (pickle's protocol)
        return (Path.touch, (self.marker,))


def crafted(step: str, file: str, wrap: Callable[[object], object] = lambda evil: evil) -> Callable[[Path], None]:
    """`file` of checkpoint `step` replaced by a pickle that would run code, with a manifest that
    verifies (whoever can write the run folder can rewrite the manifest too)."""
    def mutate(ckpts: Path) -> None:
        import torch

        torch.save(wrap(_RunsCode(ckpts.parent.parent / "PWNED")), ckpts / step / file)
        _rehash(ckpts / step, file)

    return mutate


def _rehash(path: Path, file: str) -> None:
    manifest = json.loads((path / "MANIFEST.json").read_text())
    data = (path / file).read_bytes()
    manifest["files"][file] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    (path / "MANIFEST.json").write_text(json.dumps(manifest))


def bf16_module(step: str) -> Callable[[Path], None]:
    """model.pt in bf16, as a bf16 run writes it: export then reads optim.pt for fp32 masters."""
    def mutate(ckpts: Path) -> None:
        import torch

        f = ckpts / step / "model.pt"
        torch.save({k: v.bfloat16() if v.is_floating_point() else v for k, v in torch.load(f).items()}, f)
        _rehash(ckpts / step, "model.pt")

    return mutate


def replaced(step: str, file: str, value: object) -> Callable[[Path], None]:
    """`file` of checkpoint `step` holding plain `value` (another layout's, or another trainer's),
    with a manifest that verifies."""
    def mutate(ckpts: Path) -> None:
        import torch

        torch.save(value, ckpts / step / file)
        _rehash(ckpts / step, file)

    return mutate


def edited(step: str, file: str, edit: Callable[[dict], object]) -> Callable[[Path], None]:
    """`file` of checkpoint `step` loaded, `edit`ed in place, saved, with a manifest that verifies."""
    def mutate(ckpts: Path) -> None:
        import torch

        state = torch.load(ckpts / step / file, weights_only=False)
        edit(state)
        torch.save(state, ckpts / step / file)
        _rehash(ckpts / step, file)

    return mutate


def _edit_json_file(rel: str, edit: Callable[[dict], object]) -> Callable[[Path], None]:
    """A JSON file of the run folder (relative to checkpoints/) edited in place."""
    def mutate(ckpts: Path) -> None:
        doc = json.loads((ckpts / rel).read_text())
        edit(doc)
        (ckpts / rel).write_text(json.dumps(doc))

    return mutate


def _out_a_symlink(tmp: Path) -> None:
    finished_run(tmp)
    (tmp / "real").mkdir()
    (tmp / "real" / "NOTES.md").write_text("mine\n")
    (tmp / "dest").symlink_to(tmp / "real", target_is_directory=True)


def as_deepspeed_layout(step: str) -> Callable[[Path], None]:
    """The checkpoint's files moved to where a DeepSpeed ZeRO-2 run keeps its state (deepspeed/, no
    model.pt / optim.pt), with a manifest that verifies: what a plain-torch resume finds after a
    --deepspeed on run (a real ZeRO-2 run is tests/test_checkpoint.py's, in its own process)."""
    def mutate(ckpts: Path) -> None:
        path = ckpts / step
        (path / "deepspeed").mkdir()
        (path / "model.pt").rename(path / "deepspeed" / "mp_rank_00_model_states.pt")
        (path / "optim.pt").rename(path / "deepspeed" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
        manifest = json.loads((path / "MANIFEST.json").read_text())
        files = manifest["files"]
        files["deepspeed/mp_rank_00_model_states.pt"] = files.pop("model.pt")
        files["deepspeed/bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"] = files.pop("optim.pt")
        (path / "MANIFEST.json").write_text(json.dumps(manifest))

    return mutate


def _checkpoints_a_file(tmp: Path) -> None:
    (tmp / "data").symlink_to(built("stage1-synthetic", _synthetic), target_is_directory=True)
    (tmp / "run").mkdir()
    (tmp / "run" / "checkpoints").write_text("step_00000002\n")


def _a_file(name: str) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        (tmp / "data").symlink_to(built("stage1-synthetic", _synthetic), target_is_directory=True)
        (tmp / name).write_text("a file, not a directory\n")

    return setup


def _destination_with(files: dict[str, str]) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        finished_run(tmp)
        (tmp / "dest").mkdir()
        for name, text in files.items():
            (tmp / "dest" / name).write_text(text)

    return setup


def _other_data(tmp: Path) -> None:
    """{tmp}/data2: other data at another place (the records of one manifest in another order)."""
    copy_built("stage1-synthetic", _synthetic, tmp / "data2")
    manifest = tmp / "data2" / "replay_text.jsonl"
    manifest.write_text("".join(reversed(manifest.read_text().splitlines(keepends=True))))


def moved(*mutations: Callable[[Path], None]) -> Callable[[Path], None]:
    """{tmp}/moved: the finished run copied with its data inside it (moved/data, a real copy: the
    same manifests at another path), then `mutations` on its checkpoints."""
    def setup(tmp: Path) -> None:
        finished_run(tmp)
        dest = tmp / "moved"
        copy_built("stage1-run", _finished_run, dest)
        copy_built("stage1-synthetic", _synthetic, dest / "data")
        for mutate in mutations:
            mutate(dest / "checkpoints")

    return setup


# the newest checkpoint damaged, said once: which file, and where the checkpoint went
SKIPPED = r"# step_\d{8} does not verify \("
RESUMED_1 = rf"# resumed from \S*{STEP1} at step 1"
EXPORT = ["export", "{tmp}/run", "--job", "stage1"]
NO_CKPT_VERIFIES = (rf"no checkpoint in \S*run/checkpoints verifies \(nor do {STEP1}\) "
                    r"\(--restart starts over and keeps them aside\)")

CASES = [
    # ---- resume with other model arguments
    Case("checkpoint", "resume-other-codebook-sizes", [*RESUME, "--codebook-sizes", "128"],
         rf"checkpoint \S*{STEP2} was written with --codebook-sizes unset, this run has 128: resume with the same "
         "model arguments", entry="stage1", setup=broken()),
    # refused before the model is built: seconds, not the minutes a 0.8B model takes on a CPU
    Case("checkpoint", "resume-other-shape", [*RESUME, "--shape", "qwen35-0.8b"],
         rf"checkpoint \S*{STEP2} was written with --shape tiny, this run has qwen35-0.8b: resume with the same model",
         entry="stage1", setup=broken()),
    Case("checkpoint", "resume-vision-off", [*RESUME, "--vision", "off"],
         rf"checkpoint \S*{STEP2} was written with --vision on, this run has off", entry="stage1", setup=broken()),
    Case("checkpoint", "resume-other-row-len", [*RESUME, "--row-len", "64", "--steps", "3"],
         rf"(?s)# resuming with --row-len 64 where checkpoint \S*{STEP2} has 128: batches from 2 on differ.*"
         r"step 3/3 ", entry="stage1", outcome="counted", setup=broken()),
    # ---- resume onto other data: refused unless --allow-data-change (then said)
    Case("checkpoint", "resume-other-data-dir", [*RESUME, "--data-dir", "{tmp}/data2"],
         rf"checkpoint \S*{STEP2} was trained with --data-dir \S+, this run has \S*data2 \(its manifests differ\): "
         "resume with the same data, add --allow-data-change", entry="stage1",
         setup=lambda tmp: (broken()(tmp), _other_data(tmp))),
    Case("checkpoint", "resume-other-data-dir-allowed", [*RESUME, "--data-dir", "{tmp}/data2", "--allow-data-change",
                                                        "--steps", "3"],
         rf"(?s)# --allow-data-change: resuming with --data-dir \S*data2 \(its manifests differ\) where checkpoint "
         rf"\S*{STEP2} has \S+: batches from 2 on are drawn from other data.*step 3/3 ", entry="stage1",
         outcome="counted", setup=lambda tmp: (broken()(tmp), _other_data(tmp))),
    # ---- a run folder moved or backed up with its data: the same manifests resume, by content
    Case("checkpoint", "moved-run-resumes", [*MOVED, "--steps", "3"],
         rf"(?s)# --data-dir \S*moved/data: the same manifests \(sha256\) as checkpoint \S*moved/checkpoints/{STEP2}'s "
         rf"\S+; resuming on it.*resumed from \S*moved/checkpoints/{STEP2} at step 2.*step 3/3 ", entry="stage1",
         outcome="counted", setup=moved()),
    Case("checkpoint", "moved-run-model-truncated", [*MOVED, "--steps", "1"],
         rf"(?s){SKIPPED}\S*moved/checkpoints/{STEP2}/model\.pt is corrupt.*resumed from \S*moved/checkpoints/{STEP1}",
         entry="stage1", outcome="counted", setup=moved(truncate(STEP2, "model.pt"))),
    Case("checkpoint", "moved-run-optim-bit-flipped", [*MOVED, "--steps", "1"],
         rf"(?s){SKIPPED}\S*moved/checkpoints/{STEP2}/optim\.pt is corrupt.*resumed from \S*moved/checkpoints/{STEP1}",
         entry="stage1", outcome="counted", setup=moved(flip(STEP2, "optim.pt"))),
    Case("checkpoint", "moved-run-latest-lost", MOVED,
         rf"(?s)latest names None; resuming from {STEP2}, the newest that verifies.*resumed from \S*moved/\S*{STEP2}",
         entry="stage1", outcome="counted", setup=moved(delete(".", "latest"))),
    Case("checkpoint", "moved-run-newest-deleted", [*MOVED, "--steps", "1"],
         rf"(?s)latest names '{STEP2}'; resuming from {STEP1}, the newest that verifies.*resumed from \S*moved/\S*{STEP1}",
         entry="stage1", outcome="counted", setup=moved(lambda c: __import__("shutil").rmtree(c / STEP2))),
    Case("checkpoint", "resume-other-weights", [*RESUME, "--weights", '{"und": 1}'],
         rf"checkpoint \S*{STEP2} was trained with --weights unset, this run has {{\"und\": 1.0}}: resume with the same",
         entry="stage1", setup=broken()),
    Case("checkpoint", "resume-other-asset-lengths", [*RESUME, "--asset-lengths", "8,16,16"],
         rf"checkpoint \S*{STEP2} was trained with --asset-lengths unset, this run has 8,16,16", entry="stage1",
         setup=broken()),
    # ---- the newest checkpoint damaged: resume from the one before, saying so
    Case("checkpoint", "newest-bit-flipped", FROM_1,
         rf"(?s){SKIPPED}\S*{STEP2}/model\.pt is corrupt .*{RESUMED_1}", entry="stage1", outcome="counted",
         setup=broken(flip(STEP2, "model.pt"))),
    Case("checkpoint", "newest-truncated", FROM_1, rf"(?s){SKIPPED}\S*{STEP2}/optim\.pt is corrupt.*{RESUMED_1}",
         entry="stage1", outcome="counted", setup=broken(truncate(STEP2, "optim.pt"))),
    Case("checkpoint", "newest-file-deleted", FROM_1,
         rf"(?s){SKIPPED}\S*{STEP2}/trainer_rank00000\.pt is missing from checkpoint.*{RESUMED_1}", entry="stage1",
         outcome="counted", setup=broken(delete(STEP2, "trainer_rank00000.pt"))),
    Case("checkpoint", "newest-manifest-missing", FROM_1, rf"(?s){SKIPPED}\S*{STEP2}/MANIFEST\.json is missing.*{RESUMED_1}",
         entry="stage1", outcome="counted", setup=broken(delete(STEP2, "MANIFEST.json"))),
    Case("checkpoint", "newest-manifest-garbage", FROM_1,
         rf"(?s){SKIPPED}\S*{STEP2}/MANIFEST\.json is unreadable.*{RESUMED_1}", entry="stage1", outcome="counted",
         setup=broken(write(f"{STEP2}/MANIFEST.json", b"{\x00\xff garbage"))),
    Case("checkpoint", "newest-manifest-wrong-sha", FROM_1, rf"(?s){SKIPPED}\S*{STEP2}/model\.pt is corrupt.*{RESUMED_1}",
         entry="stage1", outcome="counted", setup=broken(wrong_sha(STEP2))),
    # ---- the `latest` pointer: whatever it says, the newest that verifies
    Case("checkpoint", "latest-dangling", RESUME,
         rf"(?s)latest names 'step_00000099'; resuming from {STEP2}, the newest that verifies.*resumed from \S*{STEP2}",
         entry="stage1", outcome="counted", setup=broken(write("latest", "step_00000099\n"))),
    Case("checkpoint", "latest-garbage", RESUME, rf"latest names .*; resuming from {STEP2}, the newest that verifies",
         entry="stage1", outcome="counted", setup=broken(write("latest", b"\xff\xfe\x00../../etc\n"))),
    Case("checkpoint", "latest-missing", RESUME, rf"latest names None; resuming from {STEP2}, the newest that verifies",
         entry="stage1", outcome="counted", setup=broken(delete(".", "latest"))),
    # ---- nothing verifies: stop, name them, delete nothing
    Case("checkpoint", "all-bit-flipped", RESUME, rf"{STEP2}/model\.pt is corrupt .*; {NO_CKPT_VERIFIES}", entry="stage1",
         setup=broken(flip(STEP1, "model.pt"), flip(STEP2, "model.pt"))),
    Case("checkpoint", "all-manifests-missing", RESUME, rf"{STEP2}/MANIFEST\.json is missing.*; {NO_CKPT_VERIFIES}",
         entry="stage1", setup=broken(delete(STEP1, "MANIFEST.json"), delete(STEP2, "MANIFEST.json"))),
    # ---- files the run did not write: never unpickled (the marker file is tests/test_checkpoint.py's)
    Case("checkpoint", "crafted-trainer-state", RESUME,
         rf"{STEP2}/trainer_rank00000\.pt holds pickled objects that are not tensors or plain data \(it names "
         r"getattr\): refused, nothing in it was run", entry="stage1",
         setup=broken(crafted(STEP2, "trainer_rank00000.pt", lambda evil: {"step": 2, "rng": evil}))),
    Case("checkpoint", "crafted-optimizer-state", RESUME,
         rf"{STEP2}/optim\.pt holds pickled objects that are not tensors or plain data", entry="stage1",
         setup=broken(crafted(STEP2, "optim.pt", lambda evil: {"optimizer": evil}))),
    Case("checkpoint", "export-crafted-optimizer-state", EXPORT,
         rf"{STEP2}/optim\.pt holds pickled objects that are not tensors or plain data", entry="launch",
         setup=broken(bf16_module(STEP2), crafted(STEP2, "optim.pt", lambda evil: {"optimizer": evil}))),
    Case("checkpoint", "export-crafted-model", EXPORT,
         rf"{STEP2}/model\.pt holds pickled objects that are not tensors or plain data", entry="launch",
         setup=broken(crafted(STEP2, "model.pt"))),
    # ---- a trainer state or manifest a user edited (the manifest rehashed): one line naming the file
    Case("checkpoint", "trainer-state-fields-lists", RESUME,
         rf"{STEP2}/trainer_rank00000\.pt is not this trainer's state \(its data is list, not dict\)", entry="stage1",
         setup=broken(replaced(STEP2, "trainer_rank00000.pt", {"step": 2, "data": [], "rng": [], "config": []}))),
    Case("checkpoint", "trainer-state-a-list", RESUME,
         rf"{STEP2}/trainer_rank00000\.pt is not this trainer's state \(it holds a list, not a dict\)", entry="stage1",
         setup=broken(replaced(STEP2, "trainer_rank00000.pt", [2, {}, {}]))),
    Case("checkpoint", "trainer-state-step-a-string", RESUME,
         rf"{STEP2}/trainer_rank00000\.pt is not this trainer's state \(its step is str, not int\)", entry="stage1",
         setup=broken(edited(STEP2, "trainer_rank00000.pt", lambda t: t.update(step="two")))),
    Case("checkpoint", "trainer-state-step-1e12", RESUME,
         rf"{STEP2}/trainer_rank00000\.pt is not this trainer's state \(its step is 1000000000000, the checkpoint is "
         rf"{STEP2}\)", entry="stage1",
         setup=broken(edited(STEP2, "trainer_rank00000.pt", lambda t: t.update(step=10**12)))),
    Case("checkpoint", "trainer-state-rng-of-another-version", RESUME,
         rf"{STEP2}/trainer_rank00000\.pt: its RNG state does not load here \(ValueError: '?state with version 99",
         entry="stage1", setup=broken(edited(STEP2, "trainer_rank00000.pt",
                                             lambda t: t["rng"].update(python=(99, *t["rng"]["python"][1:]))))),
    Case("checkpoint", "export-manifest-without-step", EXPORT,
         rf"{STEP2}/MANIFEST\.json: its step is None, the checkpoint is {STEP2}: the manifest was edited",
         setup=broken(_edit_json_file(f"{STEP2}/MANIFEST.json", lambda m: m.pop("step")))),
    Case("checkpoint", "export-model-config-of-another-architecture", EXPORT,
         r"model_files/config\.json is a 'llama' model's config, not the stage-1 model's",
         setup=broken(_edit_json_file("../model_files/config.json",
                                      lambda c: (c.clear(), c.update(model_type="llama", hidden_size=64))))),
    Case("checkpoint", "deepspeed-checkpoint-resumed-plain", [*RESUME, "--deepspeed", "off"],
         rf"checkpoint \S*{STEP2} was written by DeepSpeed \(deepspeed/\), this run is plain torch: resume with "
         "--deepspeed on", entry="stage1", setup=broken(as_deepspeed_layout(STEP2))),
    Case("checkpoint", "deepspeed-config-missing", [*RESUME, "--deepspeed-config", "{tmp}/nope.json"],
         r"--deepspeed-config \S*nope\.json: not a readable DeepSpeed config \(No such file or directory\)",
         entry="stage1", setup=broken()),
    Case("checkpoint", "deepspeed-config-garbage", [*RESUME, "--deepspeed-config", "{tmp}/ds.json"],
         r"--deepspeed-config \S*ds\.json: not a readable DeepSpeed config \(Expecting value", entry="stage1",
         files={"ds.json": "zero_optimization: 2\n"}, setup=broken()),
    # ---- where checkpoints go
    Case("checkpoint", "checkpoints-dir-is-a-file", RESUME, r"\S*run/checkpoints is not a directory", entry="stage1",
         setup=_checkpoints_a_file),
    Case("checkpoint", "out-is-a-file", RESUME, r"--out \S*run: a file, not a directory", entry="stage1",
         setup=_a_file("run")),
    Case("checkpoint", "out-under-a-file", resume("{tmp}/blocker/run"),
         r"--out \S*blocker/run: cannot create the run directory \(Not a directory\)", entry="stage1",
         setup=_a_file("blocker")),
    Case("checkpoint", "keep-checkpoints-zero", [*RESUME, "--keep-checkpoints", "0"], r"--keep-checkpoints must be >= 1, got 0",
         entry="stage1"),
    Case("checkpoint", "keep-checkpoints-negative", [*RESUME, "--keep-checkpoints", "-1"],
         r"--keep-checkpoints must be >= 1, got -1", entry="stage1"),
    Case("checkpoint", "ckpt-every-negative", [*RESUME, "--ckpt-every", "-1"], r"--ckpt-every.* must be >= 0", entry="stage1"),
    # ---- --init-from is a transformers directory, not a training checkpoint
    Case("checkpoint", "init-from-a-training-checkpoint", resume("{tmp}/new", "--init-from", f"{{tmp}}/run/checkpoints/{STEP2}"),
         rf"{STEP2} is a training checkpoint \(MANIFEST\.json\), not a transformers checkpoint directory: "
         "export it first \\(`launch export`\\)", entry="stage1", setup=broken()),
    Case("checkpoint", "init-from-a-run-dir", resume("{tmp}/new", "--init-from", "{tmp}/run"),
         r"\S*run is a training run's directory, not a transformers checkpoint directory: export it first",
         entry="stage1", setup=broken()),
    # ---- launch export
    Case("checkpoint", "export-no-checkpoint", EXPORT, r"\S*run: no checkpoint to export \(\S*run/checkpoints has none\)",
         setup=broken(lambda c: [p.rename(c.parent / f"old-{p.name}") for p in c.glob("step_*")])),
    Case("checkpoint", "export-all-corrupt", EXPORT, rf"{STEP2}/model\.pt is corrupt .*; {NO_CKPT_VERIFIES}",
         setup=broken(flip(STEP1, "model.pt"), flip(STEP2, "model.pt"))),
    Case("checkpoint", "export-step-corrupt", [*EXPORT, "--step", "1"], rf"{STEP1}/optim\.pt is corrupt",
         setup=broken(truncate(STEP1, "optim.pt"))),
    Case("checkpoint", "export-step-absent", [*EXPORT, "--step", "7"],
         rf"no checkpoint at step 7 \(have: {STEP1}, {STEP2}\)", setup=broken()),
    Case("checkpoint", "export-not-a-run-dir", ["export", "{tmp}/other", "--job", "stage1"],
         r"\S*other: no model_files/config.json \(not a stage-1 job directory", setup=lambda tmp: (tmp / "other").mkdir()),
    Case("checkpoint", "export-unknown-dir-no-job", ["export", "{tmp}/other"],
         r"\S*other: not a directory of a job submitted from here; say which job it is with --job",
         setup=lambda tmp: (tmp / "other").mkdir()),
    Case("checkpoint", "export-dest-not-empty", [*EXPORT, "--out", "{tmp}/dest"],
         r"--out \S*dest exists and is not an export \(it holds notes\.txt\): nothing written; give a new or empty "
         "directory", setup=_destination_with({"notes.txt": "mine\n"})),
    Case("checkpoint", "export-dest-a-symlink", [*EXPORT, "--out", "{tmp}/dest"],
         r"--out \S*dest is a symbolic link \(to \S*real\): nothing written; give the directory itself",
         setup=_out_a_symlink),
    Case("checkpoint", "export-other-layout-optimizer", EXPORT,
         rf"{STEP2}/optim\.pt is not this trainer's optimizer state \(it holds state, param_groups, no 'optimizer'\)",
         setup=broken(bf16_module(STEP2), replaced(STEP2, "optim.pt", {"state": {}, "param_groups": []}))),
    Case("checkpoint", "export-dest-a-file", [*EXPORT, "--out", "{tmp}/run/metrics.jsonl"],
         r"--out \S*metrics\.jsonl exists and is not a directory: nothing written", setup=broken()),
]
