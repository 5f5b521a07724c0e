"""What runs inside the Slurm allocation: prepare node-local caches, preflight, then the entrypoint,
and record how it ended.

submitit pickles an `EntrypointRun` and calls it in every task. It is Checkpointable, so on a
timeout or preemption submitit requeues the same command line; the trainers resume from their
own latest checkpoint in $LAUNCH_JOB_DIR.

Outcomes. Each task writes `outcome.task<K>.json` in the job directory, and the job's main task
(the spec's `main_task`) also writes `outcome.json`: `{"state", "step", "error", "task",
"time"}` with state running, completed, failed, cancelled or requeued, the last step in the
run's metrics.jsonl, and a one-line error. A cancel (scancel's SIGTERM, or a preemption) is
recorded as "cancelled at step N" before the task exits; the full traceback of a failure stays
in the task's log. A trainer that records its own outcome.json during the run (same fields, a
"time" after the task started, no "task") keeps its word: the wrapper only fills in the step
where it is missing.
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import time
from pathlib import Path
from types import ModuleType

import submitit

from launch.doctor.checks import fast_subset
from launch.executor import CACHE_VARS
from toolkit.fsutil import atomic_write_text
from toolkit.metrics import step_records

OUTCOME = "outcome.json"


class EntrypointFailed(RuntimeError):
    """The entrypoint returned a non-zero exit code."""


def entry_module(module: str, run_main_module: bool = True) -> ModuleType:
    """The module holding `main`: `module` itself, or for a package entrypoint (`train.stage1`)
    its `train` module, or (in the job only: importing it runs it) its `__main__`."""
    entry = importlib.import_module(module)
    if hasattr(entry, "main"):
        return entry
    for sub in ("train", "__main__") if run_main_module else ("train",):
        try:
            candidate = importlib.import_module(f"{module}.{sub}")
        except ModuleNotFoundError:
            continue
        if hasattr(candidate, "main"):
            return candidate
    return entry


def entry_parser(module: str):  # -> Callable[[list[str]], object] | None
    """The entrypoint's `parse_args(argv)`: next to its `main` (where main is defined), or None."""
    entry = entry_module(module, run_main_module=False)
    main = getattr(entry, "main", None)
    home = sys.modules.get(getattr(main, "__module__", "") or "", entry)
    return getattr(home, "parse_args", None) or getattr(entry, "parse_args", None)


def task_outcome_path(job_dir: Path, task: int) -> Path:
    return job_dir / f"outcome.task{task}.json"


def read_outcome(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def outcome_line(outcome: dict) -> str:
    """'cancelled at step 12', 'failed at step 3: ValueError: shard 7 is corrupt', 'completed at step 60'."""
    state = outcome.get("state", "unknown")
    step = outcome.get("step")
    text = state if step is None else f"{state} at step {step}"
    return f"{text}: {outcome['error']}" if outcome.get("error") else text


def last_step(metrics: Path) -> int | None:
    try:
        steps = step_records(metrics)
    except OSError:
        return None
    return int(steps[-1]["step"]) if steps else None


def one_line(exc: BaseException) -> str:
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


class OutcomeRecorder:
    """Writes this task's outcome (and the job's, from the main task), atomically."""

    def __init__(self, job_dir: Path, task: int, main_task: int, metrics: Path) -> None:
        self.job_dir, self.task, self.main_task, self.metrics = job_dir, task, main_task, metrics
        self.started = time.time()
        self.final: str | None = None

    def write(self, state: str, error: str | None = None) -> None:
        step = last_step(self.metrics)
        record = {"state": state, "step": step, "error": error, "task": self.task, "time": time.time()}
        paths = [task_outcome_path(self.job_dir, self.task)]
        if self.task == self.main_task:
            paths.append(self.job_dir / OUTCOME)
        for path in paths:
            theirs = read_outcome(path)
            if (path.name == OUTCOME and theirs and theirs.get("task") != self.task
                    and float(theirs.get("time", 0)) >= self.started and theirs.get("state") != "running"):
                # The trainer recorded its own outcome in this attempt: keep it, add the step.
                record_here = {**theirs, "step": theirs.get("step", step)}
            else:
                record_here = record
            try:
                atomic_write_text(path, json.dumps(record_here) + "\n")
            except OSError as exc:  # an outcome must never turn a result into a crash
                print(f"[launch] could not write {path}: {exc}", file=sys.stderr, flush=True)
        if state != "running":
            self.final = state

    def line(self) -> str:
        return outcome_line(read_outcome(task_outcome_path(self.job_dir, self.task)) or {"state": self.final})


class EntrypointRun(submitit.helpers.Checkpointable):
    def __init__(self, module: str, argv: list[str], job_name: str, preflight: bool = True,
                 main_task: int = 0) -> None:
        self.module = module
        self.argv = list(argv)
        self.job_name = job_name
        self.preflight = preflight
        self.main_task = main_task

    def _recorder(self) -> OutcomeRecorder:
        job_dir = Path(os.environ.get("LAUNCH_JOB_DIR") or ".")
        out = self.argv[self.argv.index("--out") + 1] if "--out" in self.argv[:-1] else None
        metrics = Path(out) / "metrics.jsonl" if out else job_dir / "metrics.jsonl"
        return OutcomeRecorder(job_dir, int(os.environ.get("SLURM_PROCID", "0")), self.main_task, metrics)

    def __call__(self) -> int:
        recorder = self._recorder()
        recorder.write("running")

        owner = os.getpid()

        def on_sigterm(signum: int, _frame: object) -> None:
            if os.getpid() != owner:  # a forked worker (DataLoader) inherited this handler
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
                return
            # scancel and preemption send SIGTERM (then SIGKILL after KillWait): record first.
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
            recorder.write("cancelled")
            print(f"[launch] task {recorder.task}: {recorder.line()} ({signal.Signals(signum).name})",
                  file=sys.stderr, flush=True)
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, on_sigterm)
        try:
            prepare_node_local_dirs()
            if self.preflight:
                fast_subset(self.job_name)
            entry = entry_module(self.module)
            print(f"[launch] running {self.module} {' '.join(self.argv)}", flush=True)
            code = entry.main(self.argv)
            sys.stdout.flush()
        except SystemExit as exc:
            if recorder.final is None:  # the entrypoint called sys.exit itself
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
                recorder.write("completed" if code == 0 else "failed",
                               None if code == 0 else last_error_line() or f"exited with code {code}")
            raise
        except BaseException as exc:
            if recorder.final is None:  # not a cancel that got here first
                recorder.write("failed", one_line(exc))
            raise
        if code:
            error = last_error_line() or f"{self.module} exited with code {code}"
            recorder.write("failed", error)
            raise EntrypointFailed(f"{self.module} exited with code {code}: {error}")
        recorder.write("completed")
        return 0

    def checkpoint(self, *args: object, **kwargs: object) -> submitit.helpers.DelayedSubmission:
        # submitit calls this on SIGUSR2 (time limit near, or preemption) before it requeues.
        self._recorder().write("requeued")
        return super().checkpoint(*args, **kwargs)


def last_error_line() -> str | None:
    """The entrypoint's own one-line error ('name: error: ...') from this task's stderr log."""
    try:
        path = submitit.JobEnvironment().paths.stderr
        lines = path.read_text(errors="replace").splitlines()[-200:]
    except Exception:  # outside submitit, or no log: the exit code alone will do
        return None
    errors = [ln.strip() for ln in lines if ": error: " in ln]
    return errors[-1] if errors else None


def prepare_node_local_dirs() -> None:
    """Every task makes its node's scratch and cache dirs (setup lines run on the first node only)."""
    for var in ("LAUNCH_SCRATCH", *CACHE_VARS):
        value = os.environ.get(var)
        if value:
            Path(value).mkdir(parents=True, exist_ok=True)
