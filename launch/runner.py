"""What runs inside the Slurm allocation: prepare node-local caches, preflight, then the entrypoint,
and record how it ended.

submitit pickles an `EntrypointRun` and calls it in every task. It is Checkpointable, so on a
timeout or preemption submitit requeues the same command line; the trainers resume from their
own latest checkpoint in $LAUNCH_JOB_DIR.

Outcomes. The job's outcome.json (toolkit.outcome: state completed, failed or cancelled, the
step, a one-line error) is the trainer's word when the trainer wrote one in this attempt (the
shared runtime does, with its own step count); otherwise the main task (the spec's
`main_task`) writes it here, with the last step of the run's metrics.jsonl: an entrypoint that
raised or returned non-zero, a preflight that failed, or a cancel (scancel's SIGTERM, or a
preemption) that reads "cancelled at step N". Each task also records its own state in
`outcome.task<K>.json` (running, completed, failed, cancelled, requeued) for `launch status`.
The full traceback of a failure stays in the task's log.
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

from launch import kernel_archive as kernels
from launch import runconfig
from launch.doctor.checks import fast_subset
from launch.errors import LaunchError
from launch.executor import CACHE_VARS
from launch.fsutil import foreign_ancestor
from toolkit import outcome, runlock
from toolkit.fsutil import atomic_write_text
from toolkit.metrics import step_records
from toolkit.outcome import OUTCOME, STATES, describe, read_outcome, write_outcome


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
    return _entry_function(module, "parse_args")


def entry_task_check(module: str):  # -> Callable[[object, int], None] | None
    """The entrypoint's optional `check_tasks(parsed_args, tasks)`: does the job's task count fit
    what its arguments ask for (DFlash online: k target ranks + 1 drafter)? Raises ValueError."""
    return _entry_function(module, "check_tasks")


def entry_inputs(module: str):  # -> Callable[[object], list[tuple[str, str, Callable | None]]] | None
    """The entrypoint's optional `input_paths(parsed_args)`: what the job reads at its start (flag,
    path, a check of it), which `launch submit` checks before queueing."""
    return _entry_function(module, "input_paths")


def entry_gpu_work(module: str):  # -> Callable[[object], str | None] | None
    """The entrypoint's optional `gpu_work(parsed_args)`: what in the run needs a real GPU (None:
    it runs on the CPU too, its GPUs only a task count)."""
    return _entry_function(module, "gpu_work")


def _entry_function(module: str, name: str):  # -> Callable | None
    """`name` from the entrypoint's `args` module when it has one (a package entrypoint's flags and
    checks without torch: `train.stage1.args`), else from next to its `main`."""
    try:
        light = importlib.import_module(f"{module}.args")
    except ModuleNotFoundError as exc:
        if exc.name not in (f"{module}.args", module):
            raise
    else:
        if hasattr(light, name):
            return getattr(light, name)
    entry = entry_module(module, run_main_module=False)
    main = getattr(entry, "main", None)
    home = sys.modules.get(getattr(main, "__module__", "") or "", entry)
    return getattr(home, name, None) or getattr(entry, name, None)


def task_outcome_path(job_dir: Path, task: int) -> Path:
    return job_dir / f"outcome.task{task}.json"


def read_task_outcome(job_dir: Path, task: int) -> dict | None:
    try:
        data = json.loads(task_outcome_path(job_dir, task).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and "state" in data else None


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
    """This task's state, and (from the main task) the job's outcome.json, written atomically."""

    def __init__(self, job_dir: Path, task: int, main_task: int, metrics: Path) -> None:
        self.job_dir, self.task, self.main_task, self.metrics = job_dir, task, main_task, metrics
        self.started = time.time()
        self.final: str | None = None

    def start(self) -> None:
        if self.task == self.main_task:  # a requeued attempt starts without the last attempt's outcome
            (self.job_dir / OUTCOME).unlink(missing_ok=True)
        self.write("running")

    def trainer_outcome(self) -> dict | None:
        """The outcome.json the trainer wrote in this attempt (next to its metrics), if any."""
        theirs = read_outcome(self.metrics.parent)
        return theirs if theirs and float(theirs.get("time") or 0) >= self.started else None

    def write(self, state: str, error: str | None = None) -> None:
        theirs = self.trainer_outcome() if state in STATES else None
        if theirs:  # the trainer knows its step and why it stopped better than we do
            state, step = theirs["state"], theirs.get("step")
            error = theirs.get("error") if state == "failed" else None
        else:
            step = last_step(self.metrics)
        record = {"state": state, "step": step, "error": error, "task": self.task, "time": time.time()}
        try:
            atomic_write_text(task_outcome_path(self.job_dir, self.task), json.dumps(record) + "\n")
            ours = not theirs or self.metrics.parent.resolve() != self.job_dir.resolve()
            if self.task == self.main_task and state in STATES and ours:
                write_outcome(self.job_dir, state, step, error)
        except OSError as exc:  # an outcome must never turn a result into a crash
            print(f"[launch] could not record the outcome in {self.job_dir}: {exc}", file=sys.stderr, flush=True)
        if state != "running":
            self.final = state

    def line(self) -> str:
        return describe(read_task_outcome(self.job_dir, self.task) or {"state": self.final or "running"})


class EntrypointRun(submitit.helpers.Checkpointable):
    def __init__(self, module: str, argv: list[str], job_name: str, preflight: bool = True,
                 main_task: int = 0, meta: dict | None = None) -> None:
        self.module = module
        self.argv = list(argv)
        self.job_name = job_name
        self.preflight = preflight
        self.main_task = main_task
        self.meta = dict(meta or {})  # job, preset, spec, resources: for the run's config.yaml

    def write_config(self, task: int) -> None:
        """The main task writes the run's resolved config.yaml (launch.runconfig) before the
        entrypoint starts; a failure to do so is said, never fatal."""
        if task != self.main_task:
            return
        try:
            parse = entry_parser(self.module)
            parsed = parse(list(self.argv)) if parse is not None else None
            out = getattr(parsed, "out", None)
            run_dir = Path(out) if isinstance(out, (str, os.PathLike)) and str(out) else \
                Path(os.environ.get("LAUNCH_JOB_DIR") or ".")
            who = runlock.holder(run_dir)
            if who:  # the trainer will refuse too; the holder's config.yaml stays its own
                print(f"[launch] config.yaml not written: run folder {run_dir} is in use by {who}", file=sys.stderr,
                      flush=True)
                return
            kind = outcome.run_kind(run_dir)
            if kind is not None and kind != outcome.kind_of_entrypoint(self.module):  # the trainer refuses too
                print(f"[launch] config.yaml not written: run folder {run_dir} holds a {kind} run", file=sys.stderr,
                      flush=True)
                return
            runconfig.write(run_dir, runconfig.build(self.module, self.argv, parsed, getattr(self, "meta", {})))
        except (OSError, ValueError, TypeError, SystemExit) as exc:  # the entrypoint says what is wrong with its argv
            print(f"[launch] config.yaml not written: {one_line(exc)}", file=sys.stderr, flush=True)

    def _recorder(self) -> OutcomeRecorder:
        job_dir = Path(os.environ.get("LAUNCH_JOB_DIR") or ".")
        out = self.argv[self.argv.index("--out") + 1] if "--out" in self.argv[:-1] else None
        metrics = Path(out) / "metrics.jsonl" if out else job_dir / "metrics.jsonl"
        return OutcomeRecorder(job_dir, int(os.environ.get("SLURM_PROCID", "0")), self.main_task, metrics)

    def __call__(self) -> int:
        recorder = self._recorder()
        recorder.start()

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
            if os.environ.get("LAUNCH_SCRATCH"):  # a job of `launch`: its node's baked kernels, once per node
                kernels.install_for_job(log=lambda line: print(line, flush=True))
            if self.preflight:
                try:
                    fast_subset(self.job_name)
                except LaunchError as exc:
                    recorder.write("failed", f"preflight: {one_line(exc).removeprefix('LaunchError: ')}")
                    raise
            self.write_config(recorder.task)
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
            if recorder.final == "cancelled":  # the trainer caught the SIGTERM and said so
                print(f"[launch] task {recorder.task}: {recorder.line()}", file=sys.stderr, flush=True)
                raise SystemExit(code)
            raise EntrypointFailed(f"{self.module} exited with code {code}: {error}")
        if os.environ.get(kernels.BAKE_VAR) and recorder.task == self.main_task:
            kernels.bake_at_end(log=lambda line: print(line, flush=True))
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
            # What is in them runs as the user (Triton's compiled kernels, inductor's code): a
            # directory another uid made or can swap is refused, not used.
            foreign = foreign_ancestor(Path(value).resolve(), writable_mask=0o002)
            if foreign:
                raise LaunchError(f"{var}={value}: {foreign}; code cached there would run as you: give a "
                                  "directory only you can write")
