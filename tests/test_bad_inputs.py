"""The bad-input corpus (cases in tests/badinputs/): every case is refused with a non-zero exit
and a one- or two-line message that names the problem, and never a traceback; a record-level
fault that a run tolerates by design is counted, by name, never silently.

Launcher cases run against an unreachable Slurm (SLURM_CONF names a file that does not exist),
so nothing can ever be queued by accident; a case that needs "a job submitted before" gets a
registry record. Add a case by adding a row to a module in tests/badinputs/.
"""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.badinputs import CATEGORIES, REPO, Case
from tests.badinputs.checkpoint_cases import CASES as CHECKPOINT_CASES
from tests.badinputs.cli_cases import CASES as CLI_CASES
from tests.badinputs.inventory_cases import CASES as INVENTORY_CASES
from tests.badinputs.keepalive_cases import CASES as KEEPALIVE_CASES
from tests.badinputs.redteam_cases import CASES as REDTEAM_CASES
from tests.badinputs.shard_cases import CASES as SHARD_CASES
from tests.badinputs.stage1_data_cases import CASES as STAGE1_DATA_CASES

CASES: list[Case] = [*CLI_CASES, *INVENTORY_CASES, *STAGE1_DATA_CASES, *CHECKPOINT_CASES, *SHARD_CASES,
                     *KEEPALIVE_CASES, *REDTEAM_CASES]
JOB_FIXTURES = Path(__file__).with_name("jobfixtures")
CHILD_TIMEOUT_S = 60
# The trainer cases run a real step in this process: on a loaded 2-core machine two intra-op
# threads only contend (a stage-1 data case took 46-50 s instead of 3-8 s on one thread).
pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _prepare(case: Case, tmp: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    home = tmp / "home"
    monkeypatch.chdir(tmp)
    monkeypatch.setenv("LAUNCH_HOME", str(home))
    monkeypatch.setenv("LAUNCH_JOBS_PATH", str(JOB_FIXTURES))
    monkeypatch.syspath_prepend(str(JOB_FIXTURES))
    monkeypatch.setenv("SLURM_CONF", str(tmp / "no-slurm.conf"))
    for key in [k for k in os.environ if k.startswith("SLURM_") and k != "SLURM_CONF"]:
        monkeypatch.delenv(key)
    for key, value in case.env.items():
        monkeypatch.setenv(key, value.replace("{tmp}", str(tmp)))
    for name, content in case.files.items():
        path = tmp / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
    if case.setup is not None:
        case.setup(tmp)
    if case.job_record:
        home.mkdir(parents=True, exist_ok=True)
        (home / "jobs.jsonl").write_text(json.dumps({
            "job_id": "1", "name": "fixture", "preset": None, "folder": str(tmp / "runs" / "1"), "submitted_at": 0.0,
            "slurm_conf": str(tmp / "no-slurm.conf"), "argv": []}) + "\n")
    if case.embedded_half_down:
        monkeypatch.delenv("SLURM_CONF")
        state = home / "cluster" / "cluster.json"
        state.parent.mkdir(parents=True)
        # What `up` recorded; none of these pids is a daemon of this cluster any more.
        dead = 2 ** 22 + 1
        state.write_text(json.dumps({"pids": {d: dead for d in ("mariadb", "munged", "slurmdbd", "slurmctld", "slurmd")}}))
    return [arg.replace("{tmp}", str(tmp)) for arg in case.argv]


def _in_process(entry: str, argv: list[str]) -> int | str | None:
    if entry == "launch":
        from launch.cli import main
        return main(argv)
    if entry == "stage1":
        from train.stage1.train import main
    elif entry == "dflash":
        from train.dflash.train import main
    elif entry == "extract":
        from train.extract.extract import main
    else:
        from train.regen.regen import main
    return main(argv, guard=False)


class _CurrentStderr:
    """Whatever sys.stderr is when a record is written: the running case's, as in a process."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _release_streams(root_handlers: list[logging.Handler], streams: tuple[object, object]) -> None:
    """After an in-process case, as if its process had ended: root handlers it added (a
    basicConfig) go, and a library handler made during it (transformers' binds the sys.stderr
    of its first use, and its flush) follows the next case's stderr, not this closed one."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if h not in root_handlers]:
        root.removeHandler(handler)
    loggers = [root, *(lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger))]
    for handler in (h for lg in loggers for h in lg.handlers):
        if isinstance(handler, logging.StreamHandler) and getattr(handler, "stream", None) in streams:
            handler.setStream(_CurrentStderr())
            vars(handler).pop("flush", None)


def _run(case: Case, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int | str | None, str, str]:
    if case.entry in ("inventory", "launch-process"):
        command = ([sys.executable, str(REPO / "ansible" / "tools" / "check_inventory.py")] if case.entry == "inventory"
                   else [sys.executable, "-m", "launch"])
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        try:
            proc = subprocess.run([*command, *argv], capture_output=True, text=True, env=env, timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            return "timeout", str(exc.stdout or ""), f"still running after {CHILD_TIMEOUT_S} s: accepted"
        return proc.returncode, proc.stdout, proc.stderr
    handlers, streams = list(logging.getLogger().handlers), (sys.stdout, sys.stderr)
    try:
        rc = _in_process(case.entry, argv)
    except SystemExit as exc:  # argparse's exit; anything else escaping is a traceback for the user
        rc = exc.code
    finally:
        _release_streams(handlers, streams)
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize("case", CASES, ids=[f"{c.category}:{c.id}" for c in CASES])
def test_bad_input_is_refused_in_one_or_two_lines(case: Case, tmp_path, monkeypatch, capsys):
    argv = _prepare(case, tmp_path, monkeypatch)
    rc, out, err = _run(case, argv, capsys)
    assert "Traceback" not in out + err, out + err
    # a crafted pickle's payload creates {tmp}/PWNED when unpickled (checkpoint_cases.crafted)
    assert not (tmp_path / "PWNED").exists(), "a crafted file's code ran"
    if case.outcome == "counted":
        assert rc == 0, f"rc {rc}: {argv}\n{out}\n{err}"
        assert re.search(case.expect, out + err), out + err
        return
    message = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert rc not in (0, None), f"accepted: {argv}\n{out}\n{err}"
    assert 1 <= len(message) <= 2, err
    assert re.search(case.expect, err), err


def test_corpus_covers_every_category_and_ids_are_unique():
    per_category = Counter(c.category for c in CASES)
    assert len(CASES) >= 60
    assert {c: per_category[c] for c in CATEGORIES if per_category[c] < 30} == {}, per_category
    assert len({(c.category, c.id) for c in CASES}) == len(CASES)
