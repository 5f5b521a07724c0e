"""The bad-input corpus: one row per bad input, run by tests/test_bad_inputs.py.

A case names its category (the acceptance counts them), the program that reads the input
(`entry`), the command line (`{tmp}` is the case's own directory), the files it needs there
(`files` for text, `setup` for anything built: datasets, checkpoints, shards, device nodes) and a
regular expression the message must match.

Outcomes:
- "refused" (most cases): a non-zero exit, one or two lines on stderr, no traceback.
- "counted": a record-level fault the run tolerates by design (a malformed record below
  --max-bad-fraction, a skipped shard below its threshold): exit 0, and a line naming the record
  or shard and the reason. Silently accepting it is the failure the corpus exists to catch.

Entries (what a user's input reaches):
- "launch": the real CLI, `launch.cli.main`, in this process, against an unreachable Slurm.
- "stage1", "dflash", "extract", "regen": the trainers' own `main(argv, guard=False)` in this
  process: everything a job runs except the Slurm guard (no allocation here).
- "launch-process": `python -m launch ...` in a child with a timeout (for verbs that would run
  forever when they wrongly accept, such as `keepalive run`).
- "inventory": `ansible/tools/check_inventory.py`, as `make provision` runs it, in a child.
"""

from __future__ import annotations

import atexit
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CATEGORIES = ("cli", "job-spec", "inventory", "stage1-data", "checkpoint", "shard", "keepalive")
ENTRIES = ("launch", "stage1", "dflash", "extract", "regen", "launch-process", "inventory")


@dataclass
class Case:
    category: str
    id: str
    argv: list[str]
    expect: str  # a regex the message must match (re.search)
    files: dict[str, str | bytes] = field(default_factory=dict)
    job_record: bool = False  # a registry record of job 1 on the unreachable Slurm
    embedded_half_down: bool = False  # no SLURM_CONF; an embedded cluster state whose daemons are gone
    entry: str = "launch"
    setup: Callable[[Path], None] | None = None  # builds the case's inputs in its directory
    outcome: str = "refused"  # or "counted"
    env: dict[str, str] = field(default_factory=dict)  # extra environment ({tmp} expanded)

    def __post_init__(self) -> None:
        assert self.category in CATEGORIES, self.category
        assert self.entry in ENTRIES, self.entry
        assert self.outcome in ("refused", "counted"), self.outcome


def spec(text: str) -> dict[str, str | bytes]:
    return {"job.yaml": text}


_BUILT: dict[str, Path] = {}
_BUILT_ROOT: list[Path] = []


def built(name: str, build: Callable[[Path], None]) -> Path:
    """A good input built once per test process (a dataset, a finished run, shards) for cases to
    copy and then break; `build(directory)` fills an empty directory. Never modify the result."""
    if name not in _BUILT:
        if not _BUILT_ROOT:
            root = Path(tempfile.mkdtemp(prefix="badinputs-"))
            atexit.register(shutil.rmtree, root, True)
            _BUILT_ROOT.append(root)
        directory = _BUILT_ROOT[0] / name
        directory.mkdir()
        build(directory)
        _BUILT[name] = directory
    return _BUILT[name]


def copy_built(name: str, build: Callable[[Path], None], dest: Path) -> Path:
    """A private copy of `built(name, build)` at `dest`, to break."""
    shutil.copytree(built(name, build), dest, symlinks=True)
    return dest
