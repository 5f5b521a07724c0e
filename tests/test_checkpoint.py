"""Atomic checkpoints: verified on load, partial/corrupt ones refused; resume is exact."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from tests.stage1_fixtures import make_data, run, step_records
from train.common.checkpoint import CheckpointError, CheckpointManager, verify


def _write(payload: dict):
    def write(tmp: Path) -> None:
        for name, value in payload.items():
            torch.save(value, tmp / name)

    return write


def test_save_latest_prune(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep=2)
    for step in (1, 2, 3):
        mgr.save(step, _write({"model.pt": {"w": torch.full((3,), float(step))}}))
    assert (tmp_path / "latest").read_text().strip() == "step_00000003"
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003"]
    latest = mgr.latest()
    assert latest is not None and torch.load(latest / "model.pt")["w"][0] == 3.0
    assert set(verify(latest)["files"]) == {"model.pt"}


def test_no_checkpoint_is_none(tmp_path: Path) -> None:
    assert CheckpointManager(tmp_path / "nothing").latest() is None


def test_interrupted_save_is_invisible(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    mgr.save(1, _write({"model.pt": {"w": torch.ones(2)}}))

    def dies(tmp: Path) -> None:
        torch.save({"w": torch.zeros(2)}, tmp / "model.pt")
        raise KeyboardInterrupt  # e.g. the job is killed mid-write

    with pytest.raises(KeyboardInterrupt):
        mgr.save(2, dies)
    assert (tmp_path / ".tmp-step_00000002").exists()
    assert mgr.latest() == tmp_path / "step_00000001"
    mgr.save(3, _write({"model.pt": {"w": torch.ones(2)}}))  # next save cleans the leftover
    assert not (tmp_path / ".tmp-step_00000002").exists()


def test_corrupt_file_is_named(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    path = mgr.save(5, _write({"model.pt": {"w": torch.ones(100)}, "optim.pt": {"s": 1}}))
    data = bytearray((path / "optim.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / "optim.pt").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"optim\.pt is corrupt") as exc:
        mgr.latest()
    assert str(path / "optim.pt") in str(exc.value) and "\n" not in str(exc.value)


def test_partial_checkpoint_without_manifest_is_refused(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    path = mgr.save(5, _write({"model.pt": {"w": torch.ones(2)}}))
    (path / "MANIFEST.json").unlink()
    with pytest.raises(CheckpointError, match=r"MANIFEST\.json is missing: checkpoint .* is partial"):
        mgr.latest()


def test_truncated_file_is_refused(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path)
    path = mgr.save(5, _write({"model.pt": {"w": torch.ones(1000)}}))
    with open(path / "model.pt", "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=r"model\.pt is corrupt"):
        mgr.latest()


def test_missing_or_dangling_latest_resumes_from_the_newest_that_verifies(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep=5, report=lambda line: None)
    for step in (2, 4, 6):
        mgr.save(step, _write({"model.pt": {"w": torch.full((3,), float(step))}}))
    (tmp_path / "latest").unlink()
    assert mgr.latest() == tmp_path / "step_00000006"
    (tmp_path / "latest").write_text("step_00000099\n")  # dangling, e.g. after deleting a checkpoint
    assert mgr.latest() == tmp_path / "step_00000006"
    victim = tmp_path / "step_00000006" / "model.pt"
    victim.write_bytes(victim.read_bytes()[:-3])
    seen: list[str] = []
    assert CheckpointManager(tmp_path, report=seen.append).latest() == tmp_path / "step_00000004"
    assert any("step_00000006" in line and "corrupt" in line for line in seen), seen


def test_prune_deletes_only_its_own_lineage_and_restart_keeps_everything(tmp_path: Path) -> None:
    old = CheckpointManager(tmp_path, keep=2)
    for step in (10, 20):
        old.save(step, _write({"model.pt": {"w": torch.ones(1)}}))
    new = CheckpointManager(tmp_path, keep=2, report=lambda line: None)  # a new lineage (nothing resumed)
    for step in (1, 2, 3):
        new.save(step, _write({"model.pt": {"w": torch.zeros(1)}}))
    names = sorted(p.name for p in tmp_path.glob("step_*"))
    assert names == ["step_00000002", "step_00000003", "step_00000010", "step_00000020"]
    resumed = CheckpointManager(tmp_path, keep=2, report=lambda line: None)
    assert resumed.resume() == tmp_path / "step_00000020" and resumed.lineage == old.lineage
    resumed.save(30, _write({"model.pt": {"w": torch.ones(1)}}))
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_00000002", "step_00000003", "step_00000020",
                                                                "step_00000030"]
    aside = CheckpointManager(tmp_path).restart()
    assert aside is not None and sorted(p.name for p in aside.glob("step_*")) == [
        "step_00000002", "step_00000003", "step_00000020", "step_00000030"]
    assert CheckpointManager(tmp_path).latest() is None


def test_a_foreign_checkpoint_at_the_same_step_is_kept_aside(tmp_path: Path) -> None:
    CheckpointManager(tmp_path).save(4, _write({"model.pt": {"w": torch.ones(1)}}))
    seen: list[str] = []
    CheckpointManager(tmp_path, report=seen.append).save(4, _write({"model.pt": {"w": torch.zeros(1)}}))
    assert (tmp_path / "step_00000004.replaced-1" / "model.pt").is_file() and seen


def test_a_damaged_newer_checkpoint_is_moved_aside_on_resume_and_never_overwritten(tmp_path: Path) -> None:
    mgr = CheckpointManager(tmp_path, keep=5)
    for step in (4, 6):
        mgr.save(step, _write({"model.pt": {"w": torch.full((100,), float(step))}, "optim.pt": {"s": step}}))
    victim = tmp_path / "step_00000006"
    (victim / "model.pt").write_bytes((victim / "model.pt").read_bytes()[:50])
    before = {p.relative_to(victim): p.read_bytes() for p in victim.rglob("*") if p.is_file()}
    seen: list[str] = []
    other_rank = CheckpointManager(tmp_path, report=lambda line: None)
    assert other_rank.resume(is_main=False) == tmp_path / "step_00000004" and victim.exists()  # only the main moves
    resumed = CheckpointManager(tmp_path, keep=5, report=seen.append)
    assert resumed.resume() == tmp_path / "step_00000004"
    [aside] = tmp_path.glob("step_00000006.damaged-*")
    assert {p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()} == before
    assert any(f"moved to {aside}" in line and "model.pt is corrupt" in line for line in seen), seen
    resumed.save(6, _write({"model.pt": {"w": torch.zeros(100)}}))  # the resumed run reaches step 6 again
    assert verify(victim) and {p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()} == before
    # and a same-lineage checkpoint that stopped verifying since the resume is kept too, never rmtree'd
    (victim / "model.pt").write_bytes(b"x")
    resumed.save(6, _write({"model.pt": {"w": torch.ones(100)}}))
    assert len(list(tmp_path.glob("step_00000006.damaged-*"))) == 2 and any("kept as" in line for line in seen)


def test_a_run_resumed_past_a_damaged_checkpoint_keeps_it(tmp_path: Path, data: Path, capsys,
                                                         one_torch_thread: None) -> None:
    """model.pt of step 4 truncated: the run resumes from step 2, says where step 4 went, and
    its own new step 4 does not touch the damaged one."""
    out = tmp_path / "run"
    assert run(out, data, 4, "--ckpt-every", "2") == 0
    victim = out / "checkpoints" / "step_00000004"
    with open(victim / "model.pt", "r+b") as f:
        f.truncate(100)
    before = {p.relative_to(victim): p.read_bytes() for p in victim.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert run(out, data, 4, "--ckpt-every", "2") == 0
    said = capsys.readouterr()
    [aside] = (out / "checkpoints").glob("step_00000004.damaged-*")
    assert f"moved to {aside}" in said.out + said.err
    assert {p.relative_to(aside): p.read_bytes() for p in aside.rglob("*") if p.is_file()} == before
    assert [r["step"] for r in step_records(out)][-2:] == [3, 4] and verify(victim)


def test_resume_onto_another_tokenizer_is_refused_unless_allowed(tmp_path: Path) -> None:
    """The tokenizer's fingerprint is part of what a checkpoint was trained on (the corpus
    covers --data-dir, --weights and --asset-lengths through real runs)."""
    from train.stage1.train import _check_source

    saved = {"data_dir": "/d", "weights": None, "asset_lengths": None, "tokenizer": "aaaa"}
    now = {**saved, "tokenizer": "bbbb"}
    with pytest.raises(CheckpointError, match=r"was trained with the tokenizer aaaa, this run has bbbb: .*--allow-data"):
        _check_source(tmp_path, saved, now, allow=False, next_batch=4, report=print)
    said: list[str] = []
    _check_source(tmp_path, saved, now, allow=True, next_batch=4, report=said.append)
    assert len(said) == 1 and "batches from 4 on are drawn from other data" in said[0]
    _check_source(tmp_path, saved, dict(saved), allow=False, next_batch=4, report=said.append)  # same: silent
    assert len(said) == 1


def test_data_edited_in_place_is_a_change_of_data_and_a_moved_copy_is_not(tmp_path: Path) -> None:
    """The data is compared by its manifests' sha256: the same path with edited manifests is refused
    unless --allow-data-change; another path with the same manifests (a run folder moved or backed up
    with its data) resumes and says so (the corpus's checkpoint:moved-run-* resume real copies)."""
    from train.stage1.train import _check_source, manifests_digest

    data = tmp_path / "data"
    data.mkdir()
    (data / "replay_text.jsonl").write_text('{"id": 1, "text": "a"}\n')
    saved = {"data_dir": str(data), "manifests": manifests_digest(data), "tokenizer": "aaaa"}
    (data / "replay_text.jsonl").write_text('{"id": 1, "text": "b"}\n')
    edited = {**saved, "manifests": manifests_digest(data)}
    assert edited["manifests"] != saved["manifests"]
    with pytest.raises(CheckpointError, match=r"was trained with the manifests \(sha256\) of --data-dir [0-9a-f]{16}, "
                                              r"this run has [0-9a-f]{16} \(edited in place\): .*--allow-data-change"):
        _check_source(tmp_path, saved, edited, allow=False, next_batch=4, report=print)
    said: list[str] = []
    _check_source(tmp_path, saved, {**saved, "data_dir": "/elsewhere"}, allow=False, next_batch=4, report=said.append)
    assert len(said) == 1 and "--data-dir /elsewhere: the same manifests (sha256) as checkpoint" in said[0]
    with pytest.raises(CheckpointError, match=r"--data-dir \S+, this run has /elsewhere \(its manifests differ\)"):
        _check_source(tmp_path, saved, {**edited, "data_dir": "/elsewhere"}, allow=False, next_batch=4, report=print)


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_data(tmp_path_factory.mktemp("ckpt-data"))


def test_resume_gives_same_step_and_next_batch(tmp_path: Path, data: Path) -> None:
    """Run 4 steps straight; separately run 2, stop, re-run the same argv to 4: identical."""
    straight = tmp_path / "straight"
    assert run(straight, data, 4) == 0
    resumed = tmp_path / "resumed"
    assert run(resumed, data, 2, "--ckpt-every", "2") == 0
    assert (resumed / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    assert run(resumed, data, 4, "--ckpt-every", "2") == 0

    a, b = step_records(straight), step_records(resumed)
    assert [r["step"] for r in b] == [1, 2, 3, 4]  # resumed at step 3, not 1
    for ra, rb in zip(a, b, strict=True):
        assert ra["batch_index"] == rb["batch_index"]
        assert ra["batch_digest"] == rb["batch_digest"]
        assert rb["loss"] == pytest.approx(ra["loss"], rel=1e-5, abs=1e-6)
        assert rb["lr"] == pytest.approx(ra["lr"])


def test_the_schedule_ends_at_its_horizon_and_stays_at_the_final_lr() -> None:
    from train.stage1.train import Stage1Config, lr_lambda, schedule_horizon

    cfg = Stage1Config(steps=40, warmup=3, lr=3e-3, min_lr_ratio=0.1)
    first = lr_lambda(Stage1Config(steps=20, warmup=3, lr=3e-3, min_lr_ratio=0.1))
    resumed = lr_lambda(cfg, schedule_horizon({"config": {"steps": 20}}, cfg))
    assert [resumed(s) for s in range(20)] == [first(s) for s in range(20)]
    assert [resumed(s) for s in range(20, 40)] == [pytest.approx(0.1)] * 20  # no jump back up
    assert first(0) == pytest.approx(1 / 3) and first(2) == 1.0 and first(19) > 0.1
    # a resumed run's checkpoints carry the horizon on, whatever --steps the resume had
    assert schedule_horizon({"schedule_horizon": 20, "config": {"steps": 40}}, cfg) == 20
    assert schedule_horizon(None, cfg) == 40


def test_resume_with_more_steps_trains_them_at_the_final_lr(tmp_path: Path, data: Path, capsys) -> None:
    """What README's `launch resume --steps N` says: the cosine still ends at the run's first
    --steps; the new steps run at the final lr (--min-lr-ratio x --lr), no re-warm."""
    from train.stage1.train import Stage1Config, lr_lambda

    out = tmp_path / "run"
    assert run(out, data, 4, "--ckpt-every", "2") == 0  # FAST_ARGS: --lr 3e-3 --warmup 3
    assert run(out, data, 7, "--ckpt-every", "2") == 0
    assert "# lr: the run's schedule, its cosine ending at step 4 (its first --steps); steps 5-7 at the final lr " \
        "0.0003" in capsys.readouterr().out
    f = lr_lambda(Stage1Config(steps=4, warmup=3, lr=3e-3))
    assert [r["lr"] for r in step_records(out)] == pytest.approx([3e-3 * f(s) for s in range(7)])
    assert [r["lr"] for r in step_records(out)][4:] == pytest.approx([3e-4] * 3)


def test_corrupt_checkpoint_stops_run_with_one_line(tmp_path: Path, data: Path, capsys) -> None:
    out = tmp_path / "run"
    assert run(out, data, 1) == 0
    model_file = out / "checkpoints" / "step_00000001" / "model.pt"
    model_file.write_bytes(model_file.read_bytes()[:-10])
    before = {p: p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()}
    capsys.readouterr()
    assert run(out, data, 2) == 1
    err = capsys.readouterr().err.strip()
    # nothing deleted or rewritten: the damaged checkpoint and the pointer are as they were
    assert {p: p.read_bytes() for p in (out / "checkpoints").rglob("*") if p.is_file()} == before
    assert err == (
        f"train.stage1: error: {model_file} is corrupt (size/sha256 differ from MANIFEST.json); "
        f"delete checkpoint {model_file.parent}; no checkpoint in {model_file.parent.parent} verifies "
        "(--restart starts over and keeps them aside)"
    )


@pytest.mark.slow
def test_deepspeed_zero2_checkpoint_resume_on_cpu(tmp_path: Path, data: Path) -> None:
    """The GPU code path (DeepSpeed ZeRO-2 engine, its own checkpoint files inside ours) on a
    1-rank gloo group: resumes at the saved step with the same next batch and the same loss.
    Each run is its own process, as in a job (DeepSpeed keeps process-wide comm state)."""
    import subprocess
    import sys

    from tests.stage1_fixtures import FAST_ARGS

    def run_process(out: Path, steps: int, *extra: str) -> None:
        argv = [*FAST_ARGS, "--out", str(out), "--data-dir", str(data), "--steps", str(steps), "--deepspeed", "on",
                *extra]
        code = f"import sys; from train.stage1.train import main; sys.exit(main({argv!r}, guard=False))"
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                              env={**{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
                                   "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    run_process(straight, 3)
    run_process(resumed, 2, "--ckpt-every", "2")
    assert (resumed / "checkpoints" / "step_00000002" / "deepspeed").is_dir()
    run_process(resumed, 3, "--ckpt-every", "2")
    a, b = step_records(straight), step_records(resumed)
    assert [r["step"] for r in b] == [1, 2, 3]
    assert b[2]["batch_digest"] == a[2]["batch_digest"]
    assert b[2]["loss"] == pytest.approx(a[2]["loss"], rel=1e-5)


def test_a_crafted_pickle_in_a_checkpoint_is_refused_in_one_line_and_runs_nothing(tmp_path: Path) -> None:
    """What the run writes (tensors, numpy's RNG state) loads; a file whose pickle would run code
    (create a marker) is refused naming the file, and the marker never appears. Through the real
    trainer and `launch export`: corpus `checkpoint:crafted-*`."""
    from tests.badinputs.checkpoint_cases import _RunsCode
    from train.common.checkpoint import load_state, rng_state

    good = tmp_path / "trainer_rank00000.pt"
    torch.save({"step": 3, "rng": rng_state(), "w": torch.ones(2)}, good)
    loaded = load_state(good)
    assert loaded["step"] == 3 and (loaded["rng"]["numpy"][1] == rng_state()["numpy"][1]).all()

    marker = tmp_path / "PWNED"
    evil = tmp_path / "optim.pt"
    torch.save({"optimizer": _RunsCode(marker)}, evil)
    with pytest.raises(CheckpointError) as err:
        load_state(evil)
    assert not marker.exists()
    assert "\n" not in str(err.value)
    assert str(err.value).startswith(f"{evil} holds pickled objects that are not tensors or plain data (it names ")
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") is None  # restored after the load
    torch.load(evil, weights_only=False)  # the oracle: the same file, unpickled, does run code
    assert marker.exists()
