"""`launch status | logs | cancel | list`: follow-up verbs on submitted jobs.

A job has one log pair per Slurm task (submitit's `<id>_<task>_log.out|err`). `logs` shows the
job's main task by default (the spec's `main_task`; DFlash: the drafter), `--task N` another,
`--all` every task with `[task k]` prefixes. How a job ended comes from its outcome.json (see
launch.runner): "cancelled at step N", or the one-line error; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import re
import shlex
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from launch import registry, runconfig, values
from launch.errors import LaunchError
from launch.quiet import QuietFilter
from launch.registry import JobRecord
from launch.runner import last_step, read_task_outcome
from launch.runs import requeue_line
from launch.slurmenv import TERMINAL_STATES, job_state, job_states, pending_words, require_cluster, run_slurm
from toolkit.metrics import SCHEMAS, logged_step_records
from toolkit.outcome import STATES, describe, read_outcome

HEARTBEAT_S = 30.0
UNREACHABLE_GIVE_UP_S = 120.0


def add_status_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id", nargs="?", help="job id (default: the 10 most recent jobs)")
    p.add_argument("--json", action="store_true", help="print the state as JSON")


def add_logs_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--task", type=values.nonneg_int, metavar="N", help="this task's log (default: the job's main task)")
    which.add_argument("--all", action="store_true", help="every task's log, lines prefixed [task k]")
    p.add_argument("--tail", type=values.positive_int, metavar="N", help="only the last N lines (of each log)")
    p.add_argument("-f", "--follow", action="store_true",
                   help="keep printing until the job ends, from the end (with --tail N: its last N lines first)")
    p.add_argument("--from-start", action="store_true", help="with -f: replay the log from its first line")
    p.add_argument("--stderr", action="store_true", help="only stderr")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="every line of the log (default: without submitit's INFO lines, progress bars and a "
                   "preflight that passed)")


def add_cancel_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("job_id")


def add_list_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-n", type=values.positive_int, default=20, help="how many recent jobs")
    p.add_argument("--json", action="store_true", help="print the jobs as one JSON list")


# ------------------------------------------------------------------ outcomes
def task_outcomes(rec: JobRecord) -> dict[int, dict]:
    found = {}
    for task in range(rec.tasks):
        outcome = read_task_outcome(Path(rec.folder), task)
        if outcome is not None:
            found[task] = outcome
    return found


def own_outcome(rec: JobRecord) -> dict | None:
    """outcome.json of this job: the one in its folder when it wrote it, else (a later resume
    of its run wrote over it) what its main task recorded when it ended."""
    outcome = read_outcome(rec.folder, job=rec.job_id)
    if outcome is None and read_outcome(rec.folder) is not None:
        task = read_task_outcome(Path(rec.folder), rec.main_task)
        outcome = task if task and task.get("state") in STATES else None
    return outcome


def job_outcome(rec: JobRecord, slurm_state: str | None = None) -> dict | None:
    """The job's outcome.json (toolkit.outcome). Without one: a job Slurm ended was killed
    (SIGKILL, out of memory, a node failure, or a launcher from before outcomes): Slurm's state
    at the last step of its metrics, with submitit's pickled error when there is one."""
    outcome = own_outcome(rec)
    if outcome is not None:
        failed = [o for o in task_outcomes(rec).values() if o.get("state") == "failed"]
        if outcome.get("state") == "cancelled" and failed and slurm_state != "CANCELLED":
            # A task failed first and the main task was stopped with it: the failure is the news.
            return {**failed[0], "step": outcome.get("step", failed[0].get("step"))}
        return outcome
    if slurm_state not in TERMINAL_STATES and slurm_state is not None:
        return None
    error = _pickled_error(rec)
    if error is None and slurm_state is None:
        return None
    state = "failed" if error or slurm_state is None else slurm_state.lower()
    return {"state": state, "step": last_step(rec.run_folder / "metrics.jsonl"), "error": error}


class _PlainUnpickler(pickle.Unpickler):
    """submitit's result of a failed job is ("error", traceback text): plain data. Nothing that
    names a class or function is built, so a result file put in the job folder runs no code."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"{module}.{name}: not plain data")


def _pickled_error(rec: JobRecord) -> str | None:
    result = Path(rec.folder) / f"{rec.job_id}_{rec.main_task}_result.pkl"
    try:
        with open(result, "rb") as f:
            kind, payload = _PlainUnpickler(f).load()
    except Exception:  # absent, torn or foreign: nothing to say
        return None
    if kind != "error":
        return None
    lines = [ln.strip() for ln in str(payload).strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "failed"


def job_error(rec: JobRecord, slurm_state: str | None = None) -> str | None:
    """How a finished job ended, in one line ('cancelled at step 3', 'failed at step 5: ...')."""
    outcome = job_outcome(rec, slurm_state)
    if outcome is not None and outcome.get("state") not in ("completed", "running"):
        return describe(outcome)
    if rec.stderr.exists():  # no outcome (a launcher from before them): the entrypoint's own last error
        noise = ("submitit", " ", "Traceback", "srun:", "slurmstepd")  # srun's "exit code 2" says nothing
        lines = [ln for ln in rec.stderr.read_text(errors="replace").splitlines() if ln.strip() and not ln.startswith(noise)]
        errors = [ln for ln in lines if "Error" in ln or "error" in ln]
        if errors:
            return errors[-1].strip()
    return None


# ------------------------------------------------------------------ status and list
def _row(rec: JobRecord, st: dict[str, str]) -> dict:
    row = {"job_id": rec.job_id, "name": rec.name, "kind": rec.kind, "preset": rec.preset, "state": st["state"],
           "elapsed": elapsed_words(st["elapsed"]), "nodes": st["nodes"], "submitted_at": rec.submitted_at, "folder": rec.folder,
           "tasks": rec.tasks, "main_task": rec.main_task, "run_dir": str(rec.run_folder), "resumes": rec.resumes}
    if st["state"] == "PENDING":
        row["pending"] = pending_words(st["reason"], rec.job_id)
    return row


def _line(row: dict) -> str:
    return f"{row['job_id']:<8} {row['name']:<10} {row['preset'] or '-':<12} {row['state']:<11} {row['elapsed'] or '-':<10}"


HEADER = f"{'JOBID':<8} {'NAME':<10} {'PRESET':<12} {'STATE':<11} {'ELAPSED':<10}"


def run_status(args: argparse.Namespace) -> int:
    if args.job_id is None:
        return run_list(argparse.Namespace(n=10, json=args.json))
    rec = registry.find(args.job_id)
    st = job_state(rec.job_id, rec.slurm_env())
    if st.get("unreachable"):
        return _status_unreachable(rec, st, args.json)
    row = _row(rec, st)
    outcome = job_outcome(rec, st["state"])
    tasks = task_outcomes(rec)
    row["outcome"] = outcome
    row["task_states"] = {str(k): describe(v) for k, v in tasks.items()}
    requeued = requeue_line(rec.job_id, rec.folder, {**os.environ, **rec.slurm_env()})
    if requeued:
        row["requeued"] = requeued
    failed = st["state"] in TERMINAL_STATES - {"COMPLETED"}
    if failed:
        row["error"] = job_error(rec, st["state"])
    progress = running_progress(rec, st["state"])
    if progress:
        row["progress"] = progress
    config = runconfig.read(rec.run_folder)
    row["config"] = config
    run_jobs = registry.jobs_of_run(rec.run_folder)
    row["run_jobs"] = [j.job_id for j in run_jobs]
    # Exit 1 is a failed job; a cancel (the user's, or a preemption's) is how it was asked to end.
    code = 1 if failed and not (st["state"] == "CANCELLED" and (outcome or {}).get("state", "cancelled") == "cancelled") else 0
    if args.json:
        print(json.dumps(row))
        return code
    print(HEADER)
    print(_line(row))
    if "pending" in row:
        print(f"  pending: {row['pending']}")
    if requeued:
        print(f"  {requeued}")
    if progress:
        print(f"  progress: {progress_words(rec, progress)}")
    print(f"  folder: {rec.folder}")
    if len(run_jobs) > 1 or rec.run_dir:
        print(f"  run: {rec.run_folder} (jobs {', '.join(j.job_id for j in run_jobs)})")
    if config is not None:
        print(f"  config: {rec.run_folder / runconfig.CONFIG}")
        for line in runconfig.summary(config):
            print(f"    {line}")
    if rec.tasks > 1:
        states = ", ".join(f"{k} {row['task_states'].get(str(k), 'not started')}" for k in range(rec.tasks))
        print(f"  tasks (main {rec.main_task}): {states}")
    if failed:
        if row["error"]:
            print(f"  {'outcome' if outcome else 'error'}: {row['error']}")
        print(f"  see: launch logs {rec.job_id}" + (" --all" if rec.tasks > 1 else ""))
        return code
    if outcome and st["state"] == "COMPLETED" and outcome.get("step") is not None:
        print(f"  outcome: {describe(outcome)}")
    return 0


def _unreachable_note(why: str, what: str) -> None:
    print(f"launch: Slurm not reachable ({why}); {what}", file=sys.stderr)


def _recorded_rc(outcome: dict | None) -> int:
    """Exit status from what a job recorded, when Slurm cannot be asked: 0 completed, 1 failed
    or cancelled, 2 unknown (nothing recorded, or a state that may have changed since)."""
    state = (outcome or {}).get("state")
    return 0 if state == "completed" else 1 if state in ("failed", "cancelled") else 2


def _status_unreachable(rec: JobRecord, st: dict[str, str], as_json: bool) -> int:
    """`launch status JOB` while slurmctld does not answer: said once, with what the job
    itself recorded (outcome.json), never a bare UNKNOWN with exit 0."""
    outcome = own_outcome(rec)
    runconfig.read(rec.run_folder)  # not shown here, but a broken config.yaml is named (on stderr) all the same
    _unreachable_note(st["unreachable"], f"showing what job {rec.job_id} recorded in {rec.folder}/outcome.json"
                      if outcome else f"job {rec.job_id} recorded no outcome, so its state is unknown")
    row = {**_row(rec, st), "slurm_unreachable": st["unreachable"], "outcome": outcome}
    if as_json:
        print(json.dumps(row))
        return _recorded_rc(outcome)
    print(HEADER)
    print(_line(row))
    print(f"  folder: {rec.folder}")
    if outcome:
        print(f"  recorded outcome: {describe(outcome)} (outcome.json; Slurm not asked)")
    return _recorded_rc(outcome)


def run_list(args: argparse.Namespace) -> int:
    jobs, bad = registry.load()
    jobs = jobs[-args.n:]
    if bad:  # said, never silently dropped; the lines stay in the file
        print(f"launch: warning: {registry.unreadable_note(bad)}", file=sys.stderr)
    if not jobs:
        if args.json:
            print("[]")
        else:
            print("no jobs submitted from here yet (`launch submit stage1 --preset tiny`)")
        return 0
    by_conf: dict[str | None, list[JobRecord]] = {}
    for rec in jobs:
        by_conf.setdefault(rec.slurm_conf, []).append(rec)
    states: dict[tuple[str | None, str], dict[str, str]] = {}
    for conf, recs in by_conf.items():  # one squeue + one sacct per cluster, not per job
        for jid, st in job_states([r.job_id for r in recs], recs[0].slurm_env()).items():
            states[(conf, jid)] = st
    rows = [_row(rec, states[(rec.slurm_conf, rec.job_id)]) for rec in jobs]
    rc = 0
    why = next((st["unreachable"] for st in states.values() if st.get("unreachable")), None)
    if why:
        # Once for the listing; each job Slurm could not be asked about shows what it recorded.
        _unreachable_note(why, "states marked * are what the jobs recorded (outcome.json), the rest are unknown")
        for rec, row in zip(jobs, rows, strict=True):
            if states[(rec.slurm_conf, rec.job_id)].get("unreachable"):
                outcome = own_outcome(rec)
                row["slurm_unreachable"], row["outcome"] = why, outcome
                if outcome:
                    row["recorded"] = outcome["state"]
                rc = max(rc, 2 if _recorded_rc(outcome) == 2 else 0)
    if args.json:
        print(json.dumps(rows))
        return rc
    print(f"{HEADER} SUBMITTED")
    for row in rows:
        resumes = f"  (resumes {row['resumes']})" if row["resumes"] else ""
        line = _line({**row, "state": row["recorded"] + "*"} if "recorded" in row else row)
        print(f"{line} {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(row['submitted_at']))}{resumes}")
    return rc


def run_cancel(args: argparse.Namespace) -> int:
    rec = registry.find(args.job_id)
    env = require_cluster(rec.slurm_env())
    st = job_state(rec.job_id, env)
    ended = st["state"] in TERMINAL_STATES
    if not ended:
        proc = run_slurm(["scancel", rec.job_id], env)
        # It may end between the two calls: slurmctld then answers "already completing or completed".
        ended = "already completing or completed" in proc.stderr
        if proc.returncode != 0 and not ended:
            raise LaunchError(f"scancel {rec.job_id}: {proc.stderr.strip()}")
        if ended:
            st = job_state(rec.job_id, env)
    if ended:
        outcome = job_outcome(rec, st["state"]) if st["state"] in TERMINAL_STATES else None
        print(f"job {rec.job_id} had already ended ({st['state']}" + (f", {describe(outcome)}" if outcome else "")
              + "); nothing to cancel")
        return 0
    print(f"cancel requested for job {rec.job_id}")
    return 0


# ------------------------------------------------------------------ logs
class LogTail:
    """New complete lines of one log file since the last read (a partial last line waits)."""

    def __init__(self, path: Path, prefix: str, start_at_end: bool, back_lines: int = 0) -> None:
        """start_at_end: skip what is there, except its last `back_lines` lines."""
        self.path, self.prefix = path, prefix
        self.offset, self.pending = 0, b""
        if start_at_end and path.exists():
            # From the start of the unfinished last line, or of the last back_lines lines.
            size = path.stat().st_size
            with open(path, "rb") as f:
                start = max(0, size - (1 << 20))
                f.seek(start)
                chunk = f.read(size - start)
            body, newline, partial = chunk.rpartition(b"\n")
            keep = body.split(b"\n")[-back_lines:] if newline and back_lines else []
            self.offset = size - len(partial) - (len(b"\n".join(keep)) + 1 if keep else 0)

    def read(self, final: bool = False) -> list[str]:
        if not self.path.exists():
            return []
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read()
        self.offset += len(data)
        data = self.pending + data
        *lines, self.pending = data.split(b"\n")
        if final and self.pending:
            lines, self.pending = [*lines, self.pending], b""
        return [self.prefix + ln.decode(errors="replace") for ln in lines]


def _log_paths(rec: JobRecord, task: int | None, all_tasks: bool, stderr_only: bool) -> list[tuple[Path, str]]:
    if task is not None and task >= rec.tasks:
        raise LaunchError(f"job {rec.job_id} has {rec.tasks} task(s) (0..{rec.tasks - 1}); there is no task {task}")
    tasks = list(range(rec.tasks)) if all_tasks else [rec.main_task if task is None else task]
    streams = ("err",) if stderr_only else ("out", "err")
    return [(rec.log(t, s), f"[task {t}] " if all_tasks else "") for t in tasks for s in streams]


TRACEBACK_FOLDED = "  (traceback in the log)"
TRACEBACK_HOLD_S = 30.0


def _folded_text(line: str) -> str:
    """A folded traceback line's exception text, without a task prefix or the fold's note."""
    body = line.split("] ", 1)[1] if line.startswith("[task ") else line
    return body.removesuffix(TRACEBACK_FOLDED).strip()


def _tracebacks_folded(lines: list[str], state: dict) -> list[str]:
    """While following: a traceback becomes one line (its last); the log keeps all of it."""
    out = []
    for line in lines:
        body = line.split("] ", 1)[1] if line.startswith("[task ") else line
        if body.startswith("Traceback (most recent call last)"):
            state["in_tb"] = True
            continue
        if state.get("in_tb"):
            if body.startswith((" ", "\t")) or not body.strip() or body.startswith("During handling") \
                    or body.startswith("The above exception"):
                continue
            state["in_tb"] = False
            out.append(f"{line}{TRACEBACK_FOLDED}")
            continue
        out.append(line)
    return out


def follow(rec: JobRecord, out: TextIO, poll_s: float = 1.0, from_start: bool = False, task: int | None = None,
           all_tasks: bool = False, stderr_only: bool = False, heartbeat_s: float = HEARTBEAT_S,
           tail: int = 0, verbose: bool = False) -> int:
    """Stream the logs until the job reaches a terminal state; exit 0 only on COMPLETED.

    stdout and stderr are read on every poll and printed as their lines arrive (without the
    chatter launch.quiet leaves out, unless verbose); the state is said when it changes and,
    while the job waits or runs quietly, at least every heartbeat_s, with the last step, the
    total and the ETA the trainer logged. It ends with the run's summary and a `next:` line."""
    env = require_cluster(rec.slurm_env())
    tails = [LogTail(path, prefix, not from_start, tail)
             for path, prefix in _log_paths(rec, task, all_tasks, stderr_only)]
    said, said_at, unknown_since, tb = "", 0.0, None, {}
    quiet = None if verbose else QuietFilter()
    # Folded traceback lines wait up to TRACEBACK_HOLD_S: the exception that ends the job is said
    # once, in the closing line; a caught one, or another task's, is shown when the wait is over.
    held: list[tuple[float, str]] = []
    while True:
        st = job_state(rec.job_id, env)
        now = time.monotonic()
        if st["state"] == "UNKNOWN":
            unknown_since = unknown_since or now
            if now - unknown_since > UNREACHABLE_GIVE_UP_S:
                raise LaunchError(f"job {rec.job_id}: Slurm has not known its state for {UNREACHABLE_GIVE_UP_S:.0f} s "
                                  f"({st['reason'] or 'no answer'}); is slurmctld up? `launch status {rec.job_id}`")
        else:
            unknown_since = None
        say = st["state"] + (f": {pending_words(st['reason'], rec.job_id)}" if st["state"] == "PENDING" else "")
        terminal = st["state"] in TERMINAL_STATES
        if terminal:
            time.sleep(poll_s)  # the last lines may land just after the state flips
        lines = [ln for t in tails for ln in t.read(final=terminal)]
        shown = _tracebacks_folded(lines, tb)
        shown = quiet.feed(shown) if quiet is not None else shown
        if quiet is not None:
            held += [(now, ln) for ln in shown if ln.endswith(TRACEBACK_FOLDED)]
            shown = [ln for ln in shown if not ln.endswith(TRACEBACK_FOLDED)]
            err = job_error(rec, st["state"]) if terminal and st["state"] != "COMPLETED" else None
            due = [ln for t, ln in held if terminal or now - t >= TRACEBACK_HOLD_S]
            held = [(t, ln) for t, ln in held if not (terminal or now - t >= TRACEBACK_HOLD_S)]
            shown += [ln for ln in due if not (err and err.endswith(_folded_text(ln)))]
        for line in shown:
            out.write(line + "\n")
        if terminal:
            if st["state"] == "COMPLETED":
                out.write(f"[launch] job {rec.job_id}: COMPLETED\n")
                for line in summary_lines(rec):
                    out.write(line + "\n")
                out.write(f"next: {next_line(rec, completed=True)}\n")
                out.flush()
                return 0
            err = job_error(rec, st["state"])
            out.write(f"[launch] job {rec.job_id} ended {st['state']}" + (f": {err}" if err else "") + "\n")
            out.write(f"next: {next_line(rec, completed=False)}\n")
            out.flush()
            return 1
        if say != said or (now - said_at >= heartbeat_s and not lines):
            waited = f"{time.time() - rec.submitted_at:.0f} s since submit" if st["state"] == "PENDING" \
                else elapsed_words(st["elapsed"])
            since = f" ({waited})" if say == said and waited else ""
            where = progress_words(rec) if say == said and st["state"] == "RUNNING" else ""
            out.write(f"[launch] job {rec.job_id}: {say}{since}{f', {where}' if where else ''}\n")
            said, said_at = say, now
        out.flush()
        time.sleep(poll_s)


def last_progress(rec: JobRecord) -> dict | None:
    """The last step record of the run: step, and where the trainer logs them, steps_total,
    eta_s and stall. None before the first step (or with no readable metrics)."""
    try:  # in file order: after a requeue or a resume, the step the run is at now comes last
        steps = logged_step_records(rec.run_folder / "metrics.jsonl")
    except (OSError, ValueError):
        return None
    return steps[-1] if steps else None


def running_progress(rec: JobRecord, state: str) -> dict | None:
    """Where a RUNNING job is (step, steps_total, eta_s, stall: what the follow's heartbeat says),
    from the run's metrics.jsonl; None for any other state or before its first step."""
    if state != "RUNNING":
        return None
    last = last_progress(rec)
    if last is None or not isinstance(last.get("step"), int):
        return None
    return {k: last[k] for k in ("step", "steps_total", "eta_s", "stall") if last.get(k) is not None}


def progress_words(rec: JobRecord, last: dict | None = None) -> str:
    """'step 12/60, ETA 1:40' (each part only when the trainer logged it), or ''."""
    last = last_progress(rec) if last is None else last
    if last is None or not isinstance(last.get("step"), int):
        return ""
    total = last.get("steps_total")
    words = f"step {last['step']}" + (f"/{total}" if isinstance(total, int) else "")
    eta = last.get("eta_s")
    if isinstance(eta, (int, float)) and not isinstance(eta, bool) and eta >= 0:
        words += f", ETA {format_seconds(eta)}"
    stall = last.get("stall")
    if isinstance(stall, str) and stall:
        words += f", stalled: {stall}"
    return words


def format_seconds(seconds: float) -> str:
    """Slurm's own elapsed form: M:SS, H:MM:SS, D-HH:MM:SS."""
    total = int(round(seconds))
    days, rest = divmod(total, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}-{hours:02d}:{minutes:02d}:{secs:02d}"
    if hours:
        return f"{hours}:{minutes:02d}:{secs:02d}"
    return f"{minutes}:{secs:02d}"


def elapsed_words(elapsed: str) -> str:
    """squeue says `1:49` while a job runs and sacct `00:01:49` once it ended: one form for both."""
    m = re.fullmatch(r"(?:(\d+)-)?(?:(\d+):)?(\d+):(\d+)", elapsed.strip())
    if not m:
        return elapsed
    days, hours, minutes, seconds = (int(g or 0) for g in m.groups())
    return format_seconds(((days * 24 + hours) * 60 + minutes) * 60 + seconds)


# summary.json's throughput figure (toolkit.metrics Schema.throughput), as the summary says it
THROUGHPUT_WORDS = {"tok_s_all_ranks": "tokens/s  {:,.0f} (all ranks, padding included)",
                    "real_tok_s": "tokens/s  {:,.0f} (real tokens)", "samples_per_s": "samples/s {:,.1f}"}


def summary_lines(rec: JobRecord) -> list[str]:
    """The run's summary.json in a few lines (steps, loss, throughput, where things are)."""
    folder = rec.run_folder
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return []
    if not isinstance(summary, dict):
        return []
    lines = []
    if isinstance(summary.get("steps"), int):
        lines.append(f"  steps     {summary['steps']}")
    first, last = summary.get("first_loss"), summary.get("last_loss")
    if isinstance(first, (int, float)) and isinstance(last, (int, float)):
        lines.append(f"  loss      {first:.3f} -> {last:.3f}")
    for schema in SCHEMAS.values():
        value = summary.get(schema.throughput)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            words = THROUGHPUT_WORDS.get(schema.throughput, schema.throughput + " {:,.1f}")
            lines.append("  " + words.format(value))
            break
    lines.append(f"  run       {folder}")
    if isinstance(summary.get("export"), str):
        lines.append(f"  export    {summary['export']}")
    return lines


def _flag_value(argv: list[str], flag: str) -> str | None:
    """The last `--flag V` / `--flag=V` of an argv, or None."""
    value = None
    for i, item in enumerate(argv):
        if item == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif item.startswith(flag + "="):
            value = item.split("=", 1)[1]
    return value


def _preset(rec: JobRecord) -> str:
    return " --preset tiny" if rec.preset == "tiny" else ""


def _after_regen(rec: JobRecord) -> str:
    target = _flag_value(rec.argv, "--init-from")
    init = f" --arg init_from={shlex.quote(target)}" if target else " --arg init_from=<target>"
    return f"launch submit extract{_preset(rec)}{init} --arg data=job:{rec.job_id}/data.jsonl"


# The DFlash pipeline's next step after a completed job of each kind (regen -> extract -> dflash ->
# export); a report or a resume means nothing there.
PIPELINE_NEXT: dict[str, Callable[[JobRecord], str]] = {
    "regen": _after_regen,
    "extract": lambda rec: f"launch submit dflash{_preset(rec)} --arg data=job:{rec.job_id}",
    "dflash": lambda rec: f"launch export {rec.job_id}",
}


def next_line(rec: JobRecord, completed: bool | None) -> str:
    """What to type next: while it runs (None), after it completed (True), after it failed (False)."""
    j = rec.job_id
    if completed is None:
        return f"launch logs -f {j}   |   launch status {j}   |   launch cancel {j}"
    if completed:
        return f"{PIPELINE_NEXT[rec.name](rec)}   |   launch status {j}" if rec.name in PIPELINE_NEXT else \
            f"launch report {j}   |   launch status {j}   |   launch resume {j} --steps N"
    return f"launch logs {j} --tail 40" + (" --all" if rec.tasks > 1 else "") + f"   |   launch status {j}"


def run_logs(args: argparse.Namespace) -> int:
    rec = registry.find(args.job_id)
    if args.from_start and not args.follow:
        raise LaunchError("--from-start goes with -f/--follow (without -f the whole log is shown)")
    if args.follow:
        return follow(rec, sys.stdout, from_start=args.from_start, task=args.task, all_tasks=args.all,
                      stderr_only=args.stderr, tail=args.tail or 0, verbose=args.verbose)
    paths = _log_paths(rec, args.task, args.all, args.stderr)
    if not Path(rec.folder).is_dir():  # submitit makes it at submit time, so it was moved or deleted
        raise LaunchError(f"job {rec.job_id}'s folder {rec.folder} is gone (moved or deleted?); its logs were there")
    found = False
    for path, prefix in paths:
        if not path.exists():
            continue
        found = True
        quiet = QuietFilter()
        print(f"==> {path} <==")
        try:
            with open(path, "rb") as f:
                lines = (ln.decode(errors="replace").rstrip("\n") for ln in f)
                if not args.verbose:  # the tail is the last lines worth reading, not submitit's exit lines
                    tb: dict = {}  # a traceback is its last line here; --verbose (or the file) has it whole
                    lines = (shown for ln in lines for shown in quiet.feed(_tracebacks_folded([ln], tb)))
                for line in (deque(lines, maxlen=args.tail) if args.tail else lines):
                    print(prefix + line)
        except BrokenPipeError:  # the reader left (`| head`): launch.cli ends quietly
            raise
        except OSError as exc:
            raise LaunchError(f"cannot read {path} ({exc.strerror})") from None
    if not found:
        st = job_state(rec.job_id, rec.slurm_env())
        print(f"no log yet for job {rec.job_id} (state {st['state']}); expected at {rec.stdout}")
    err = job_error(rec)
    if err:
        print(f"==> outcome <==\n{err}")
    return 0


run = run_status
add_arguments = add_status_arguments
