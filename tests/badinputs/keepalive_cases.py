"""Bad inputs: keepalive (see tests/badinputs/__init__.py for what a case is).

`run` cases go through a child `python -m launch keepalive run` (entry "launch-process"): a run
that wrongly accepts holds its GPUs forever, and the child's timeout catches that. Every run case
has its own stand-in GPUs (char devices with the NVIDIA major 195, tests/keepalive_fixtures.py),
socket and state under {tmp}, and --no-slurm unless Slurm is the point. The quick verbs (status,
prolog, epilog, hooks, unit) run in process; their socket and hook log are under {tmp} too, so no
case touches the system's holder.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

from tests.badinputs import Case
from tests.keepalive_fixtures import make_standin_gpus

SOCKET = "{tmp}/ctl/k.sock"
STATE = "{tmp}/state.json"
# The hooks as slurmd runs them, but against a socket nobody listens on and a private log.
HOOK_ENV = {"LAUNCH_KEEPALIVE_SOCKET": "{tmp}/no-holder/k.sock", "LAUNCH_KEEPALIVE_HOOK_LOG": "{tmp}/hooks.log"}


def run(*extra: str, devices: str = "{tmp}/dev", socket: str = SOCKET, state: str = STATE,
        no_slurm: bool = True) -> list[str]:
    """`keepalive run` on the case's own devices, socket and state; a later option wins."""
    return ["keepalive", "run", *(["--no-slurm"] if no_slurm else []), "--devices-dir", devices,
            "--socket", socket, "--state", state, *extra]


def gpus(count: int = 2) -> Callable[[Path], None]:
    def setup(tmp: Path) -> None:
        make_standin_gpus(tmp / "dev", count)
    return setup


def _world_writable(tmp: Path) -> None:
    gpus()(tmp)
    (tmp / "shared").mkdir()
    (tmp / "shared").chmod(0o1777)


def _wrong_major(tmp: Path) -> None:
    (tmp / "dev").mkdir()
    os.mknod(tmp / "dev" / "nvidia0", 0o666 | 0o020000, os.makedev(1, 3))  # /dev/null's numbers


def _plain_files(tmp: Path) -> None:
    (tmp / "dev").mkdir()
    (tmp / "dev" / "nvidia0").write_text("")  # a file, not a device node


def _live_state(**state: object) -> dict[str, str | bytes]:
    """A state file whose pid is alive (init's), so status reads the rest of it."""
    return {"state.json": json.dumps({"pid": 1, **state})}


def prolog(job: str | None, job_gpus: str | None, **extra: str) -> dict[str, str]:
    env = {**HOOK_ENV, **extra}
    if job is not None:
        env["SLURM_JOB_ID"] = job
    if job_gpus is not None:
        env["SLURM_JOB_GPUS"] = job_gpus
    return env


LONG = "d" * 120  # a socket path past AF_UNIX's 108 bytes

CASES = [
    # ---- run: where the socket goes
    Case("keepalive", "socket-world-writable-dir", run(socket="{tmp}/shared/k.sock"),
         r"refusing a control socket directly in .*/shared: anyone may write there \(mode 1777\)",
         entry="launch-process", setup=_world_writable),
    Case("keepalive", "socket-parent-is-a-file", run(socket="{tmp}/afile/k.sock"),
         r"control socket .*/afile/k\.sock: .*/afile is not a directory", entry="launch-process",
         setup=gpus(), files={"afile": "not a directory\n"}),
    Case("keepalive", "socket-path-is-a-file", run(socket="{tmp}/afile"),
         r"control socket path .*/afile exists and is not a socket; refusing to replace it", entry="launch-process",
         setup=gpus(), files={"afile": "someone's file\n"}),
    Case("keepalive", "socket-path-too-long", run(socket="{tmp}/" + LONG + "/k.sock"),
         r"control socket path .* is \d+ bytes; a unix socket path must be under 108",
         entry="launch-process", setup=gpus()),
    Case("keepalive", "state-parent-is-a-file", run(state="{tmp}/afile/state.json"),
         r"state file .*/afile/state\.json: .*/afile is not a directory", entry="launch-process",
         setup=gpus(), files={"afile": "not a directory\n"}),
    # ---- run: which GPUs
    Case("keepalive", "gpus-word", run("--gpus", "a"), r"--gpus: bad GPU list 'a'", entry="launch-process",
         setup=gpus()),
    Case("keepalive", "gpus-repeated", run("--gpus", "0,0"), r"--gpus '0,0' names GPU 0 twice",
         entry="launch-process", setup=gpus()),
    Case("keepalive", "gpus-beyond-devices", run("--gpus", "99"), r"GPU\(s\) \[99\] not found \(found \[0, 1\]\)",
         entry="launch-process", setup=gpus()),
    Case("keepalive", "gpus-empty", run("--gpus", ""), r"--gpus '' names no GPU", entry="launch-process",
         setup=gpus()),
    Case("keepalive", "devices-dir-missing", run(devices="{tmp}/nope"), r"devices dir .*/nope does not exist",
         entry="launch-process"),
    Case("keepalive", "devices-dir-is-a-file", run(devices="{tmp}/afile"), r"devices dir .*/afile is not a directory",
         entry="launch-process", files={"afile": "x\n"}),
    Case("keepalive", "devices-dir-empty", run(), r"no stand-in GPUs in .*/dev: no nvidiaN character devices",
         entry="launch-process", setup=lambda tmp: (tmp / "dev").mkdir()),
    Case("keepalive", "devices-wrong-major", run(), r"nvidia0 has major 1, not NVIDIA's 195",
         entry="launch-process", setup=_wrong_major),
    Case("keepalive", "devices-plain-files", run(), r"nvidia0 is not a character device", entry="launch-process",
         setup=_plain_files),
    # ---- run: numbers
    Case("keepalive", "mem-fraction-zero", run("--mem-fraction", "0"), r"--mem-fraction 0(\.0)? is out of range",
         entry="launch-process", setup=gpus()),
    Case("keepalive", "mem-fraction-negative", run("--mem-fraction", "-1"), r"--mem-fraction -1(\.0)? is out of range",
         entry="launch-process", setup=gpus()),
    Case("keepalive", "mem-fraction-above-one", run("--mem-fraction", "1.5"), r"--mem-fraction 1\.5 is out of range",
         entry="launch-process", setup=gpus()),
    Case("keepalive", "mem-fraction-nan", run("--mem-fraction", "nan"), r"--mem-fraction nan is out of range",
         entry="launch-process", setup=gpus()),
    Case("keepalive", "hold-timeout-negative", run("--hold-timeout", "-2"),
         r"--hold-timeout -2(\.0)?: must be a number of seconds >= 0", entry="launch-process", setup=gpus()),
    Case("keepalive", "reconcile-interval-negative", run("--reconcile-interval", "-30"),
         r"--reconcile-interval -30(\.0)?: must be a number of seconds >= 0", entry="launch-process", setup=gpus()),
    # ---- status
    Case("keepalive", "status-state-dir-missing", ["keepalive", "status", "--state", "{tmp}/nope/state.json"],
         r"keepalive state .*/nope/state\.json: no such directory .*/nope"),
    Case("keepalive", "status-state-garbage", ["keepalive", "status", "--state", STATE],
         r"cannot read keepalive state .*state\.json: not JSON", files={"state.json": "{not json"}),
    Case("keepalive", "status-state-not-utf8", ["keepalive", "status", "--state", STATE],
         r"cannot read keepalive state .*state\.json: not UTF-8", files={"state.json": b'{"pid": "\xff\xfe"}'}),
    Case("keepalive", "status-state-a-list", ["keepalive", "status", "--state", STATE],
         r"keepalive state .*state\.json has no valid pid", files={"state.json": "[1, 2]"}),
    Case("keepalive", "status-state-pid-zero", ["keepalive", "status", "--state", STATE],
         r"keepalive state .*state\.json has no valid pid", files={"state.json": json.dumps({"pid": 0, "held": []})}),
    Case("keepalive", "status-state-no-held", ["keepalive", "status", "--state", STATE],
         r"keepalive state .*state\.json: 'held' is missing or not a list of GPU indices", files=_live_state()),
    Case("keepalive", "status-state-released-a-list", ["keepalive", "status", "--state", STATE],
         r"keepalive state .*state\.json: 'released' is not a map of job ids to GPU indices",
         files=_live_state(held=[0], released=[1])),
    Case("keepalive", "status-state-is-a-dir", ["keepalive", "status", "--state", "{tmp}"],
         r"cannot read keepalive state .*: it is a directory"),
    # ---- the Slurm hooks (slurmd's environment)
    Case("keepalive", "prolog-no-job-id", ["keepalive", "prolog"], r"SLURM_JOB_ID is not set", env=prolog(None, "0")),
    Case("keepalive", "prolog-job-id-word", ["keepalive", "prolog"], r"SLURM_JOB_ID='abc' is not a Slurm job id",
         env=prolog("abc", "0")),
    Case("keepalive", "prolog-job-id-shell", ["keepalive", "prolog"], r"SLURM_JOB_ID='12;rm -rf x' is not a Slurm job id",
         env=prolog("12;rm -rf x", "0")),
    Case("keepalive", "prolog-gpus-word", ["keepalive", "prolog"], r"SLURM_JOB_GPUS: bad GPU list 'gpu0'",
         env=prolog("12", "gpu0")),
    Case("keepalive", "prolog-gpus-reversed-range", ["keepalive", "prolog"], r"SLURM_JOB_GPUS: bad GPU list '3-1'",
         env=prolog("12", "3-1")),
    Case("keepalive", "prolog-timeout-env-word", ["keepalive", "prolog"],
         r"LAUNCH_KEEPALIVE_TIMEOUT='soon' is not a number of seconds", env=prolog("12", "0", LAUNCH_KEEPALIVE_TIMEOUT="soon")),
    Case("keepalive", "prolog-timeout-env-negative", ["keepalive", "prolog"],
         r"LAUNCH_KEEPALIVE_TIMEOUT='-5': must be a number of seconds > 0",
         env=prolog("12", "0", LAUNCH_KEEPALIVE_TIMEOUT="-5")),
    Case("keepalive", "prolog-timeout-nan", ["keepalive", "prolog", "--timeout", "nan"],
         r"--timeout nan: must be a number of seconds > 0", env=prolog("12", "0")),
    # A failing epilog drains the node, so the epilog exits 0 by design: counted, by name.
    Case("keepalive", "epilog-no-job-id", ["keepalive", "epilog"], r"epilog: SLURM_JOB_ID is not set",
         env=prolog(None, "0"), outcome="counted"),
    Case("keepalive", "epilog-job-id-word", ["keepalive", "epilog"], r"epilog: SLURM_JOB_ID='abc' is not a Slurm job id",
         env=prolog("abc", "0"), outcome="counted"),
    Case("keepalive", "epilog-gpus-garbage", ["keepalive", "epilog"], r"epilog: SLURM_JOB_GPUS: bad GPU list '0,x'",
         env=prolog("12", "0,x"), outcome="counted"),
    Case("keepalive", "epilog-timeout-env-word", ["keepalive", "epilog"],
         r"epilog: LAUNCH_KEEPALIVE_TIMEOUT='soon' is not a number of seconds",
         env=prolog("12", "0", LAUNCH_KEEPALIVE_TIMEOUT="soon"), outcome="counted"),
    # ---- hooks / unit
    Case("keepalive", "hooks-dir-is-a-file", ["keepalive", "hooks", "--dir", "{tmp}/afile", "--socket", "{tmp}/k.sock"],
         r"cannot write the hook wrappers in .*/afile: not a directory", files={"afile": "x\n"}),
    Case("keepalive", "hooks-dir-unwritable", ["keepalive", "hooks", "--dir", "/proc/launch-hooks", "--socket", "{tmp}/k.sock"],
         r"cannot write the hook wrappers in /proc/launch-hooks: "),
    Case("keepalive", "hooks-python-relative", ["keepalive", "hooks", "--dir", "{tmp}/h", "--python", "python3"],
         r"--python 'python3' must be an absolute path"),
    Case("keepalive", "hooks-timeout-negative", ["keepalive", "hooks", "--dir", "{tmp}/h", "--prolog-timeout", "-1"],
         r"--prolog-timeout -1(\.0)?: must be a number of seconds > 0"),
    Case("keepalive", "unit-args-newline", ["keepalive", "unit", "--args", "--gpus 0\nExecStartPre=/bin/touch /tmp/x"],
         r"--args '--gpus 0\\nExecStartPre=/bin/touch /tmp/x' has a control character"),
    Case("keepalive", "unit-python-relative", ["keepalive", "unit", "--python", "venv/bin/python"],
         r"--python 'venv/bin/python' must be an absolute path"),
]
