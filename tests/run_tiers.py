"""`make test` and `make test-fast`: the suite's tiers, each one pytest run, timed and budgeted.

    python tests/run_tiers.py                 # every tier, one after the other (what `make test` and CI run)
    python tests/run_tiers.py --side-by-side  # every tier at once (on 2 cores: over budget, see tests/README.md)
    python tests/run_tiers.py unit slurm      # some tiers
    python tests/run_tiers.py fast            # the edit loop: unit tests but the slow ones
    python tests/run_tiers.py slurm -- -k requeue   # pytest arguments after `--`

A tier is a marker expression (the markers come from tests/tiers.py) run with pytest-xdist.
Tiers that wait (on Slurm, on containers booting, on plays) get more workers than the machine's
cores; the unit tier, which computes, gets one worker per core. Files stay whole on one worker
(`--dist loadfile`): a module's fixtures (a built image, a provisioned container) are made once.

With --side-by-side the tiers run at once: the slurm and containers tiers spend much of their time waiting
(a job queued, a container booting, a play's round trips), which the unit tier fills. The unit
tier runs at a lower CPU priority (nice 10), so a waiting tier's next step is never starved by it.
Each tier's output goes to its own log, printed whole when the tier ends (a line per minute says
which tiers still run and what each is on), so the logs never interleave. Measured on an idle 2-core machine (tests/README.md) this is
not faster: the tiers contend for the CPU (load 20), the unit tier ran past its budget and slurm
jobs timed out, so `make test` runs the tiers one after the other.

Each tier has a budget in seconds, 1.7-2x its idle time on a 2-core machine beside the other
tiers (tests/README.md has the measured times). A tier still running at its budget is
interrupted the way Ctrl-C does (pytest prints what it ran and the slowest tests), and the run
fails with one line naming the tier: a suite that has grown past its budget says so, instead of
being killed by CI's own limit with nothing printed. `LAUNCH_TEST_BUDGET_SCALE=2` doubles every
budget (a machine known to be slower).

At the end: each tier's wall time and outcome, and the whole run's.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONTAINER_MARKS = "lxc or ansible or vm"


@dataclass(frozen=True)
class Tier:
    name: str
    marks: str
    workers: int
    budget_s: int
    what: str
    nice: int = 0  # added to the tier's CPU niceness when it runs beside the others


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def tiers() -> dict[str, Tier]:
    cores = _cores()
    return {t.name: t for t in (
        Tier("unit", f"not slurm and not ({CONTAINER_MARKS})", cores, 1500,
             "no cluster, container or play; the slow unit tests included", nice=10),
        Tier("slurm", f"slurm and not ({CONTAINER_MARKS})", 2 * cores + 1, 1200,
             "the embedded Slurm clusters (one per worker), jobs through submitit"),
        Tier("containers", f"({CONTAINER_MARKS})", 2 * cores, 1500,
             "real LXC containers, a KVM guest, Ansible plays, images"),
    )}


# The edit loop: the unit tier without what is marked slow.
FAST = Tier("fast", f"not slurm and not ({CONTAINER_MARKS}) and not slow", _cores(), 600,
            "`make test-fast`: unit tests but the slow ones")
HEARTBEAT_S = 60.0
GRACE_S = 120.0  # after the budget's SIGINT, how long pytest gets to write its report
# The SIGINT again this often within the grace: one that lands while pytest is still starting (a
# loaded machine took a tier with a 3 s budget there) can be swallowed and the tests then run on;
# pytest, once in its tests, reports on the first one and ends within a second.
RESEND_S = 10.0


def counts(junit: Path) -> Counter[str]:
    """passed / failed / skipped of one tier, from its JUnit XML (empty if pytest wrote none)."""
    out: Counter[str] = Counter()
    try:
        root = ET.parse(junit).getroot()
    except (OSError, ET.ParseError):
        return out
    for suite in root.iter("testsuite"):
        tests, skipped = int(suite.get("tests", 0)), int(suite.get("skipped", 0))
        failed = int(suite.get("failures", 0)) + int(suite.get("errors", 0))
        out.update(passed=tests - skipped - failed, failed=failed, skipped=skipped)
    return out


def pytest_argv(tier: Tier, extra: list[str], junit: Path) -> list[str]:
    argv = [sys.executable, "-m", "pytest", "-q", "-m", tier.marks, "--durations=20", "--durations-min=1",
            "-p", "no:cacheprovider", f"--junitxml={junit}"]
    if tier.workers > 1:
        argv += ["-n", str(tier.workers), "--dist", "loadfile"]
    return argv + extra


@dataclass
class Run:
    """One tier's pytest process, and what the runner knows of it."""

    tier: Tier
    proc: subprocess.Popen[bytes]
    budget: float
    log: Path | None  # None: the output goes straight to ours
    start: float
    interrupted: float | None = None
    last_sigint: float = 0.0
    rc: int | None = None
    wall: float = 0.0


def start_tier(tier: Tier, extra: list[str], scale: float, reports: Path, cwd: Path, alone: bool) -> Run:
    budget = tier.budget_s * scale
    argv = pytest_argv(tier, extra, reports / f"{tier.name}.xml")
    print(f"\n>> tier {tier.name}: {tier.what}\n>> {' '.join(argv[1:])}  (budget {budget:.0f} s)", flush=True)
    log = None if alone else reports / f"{tier.name}.log"
    out = None if log is None else log.open("wb")
    niceness = 0 if alone else tier.nice
    try:
        proc = subprocess.Popen(argv, cwd=cwd, start_new_session=True, stdout=out,
                                stderr=None if out is None else subprocess.STDOUT,
                                preexec_fn=(lambda: os.nice(niceness)) if niceness else None)
    finally:
        if out is not None:
            out.close()
    return Run(tier, proc, budget, log, time.monotonic())


def _last_line(log: Path | None) -> str:
    """The end of a tier's log: the file it is on (tests/tiers.py starts each line with it)."""
    if log is None:
        return ""
    try:
        with log.open("rb") as f:
            f.seek(max(0, log.stat().st_size - 400))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:70] if lines else ""


def _check(run: Run, now: float) -> bool:
    """Enforce the budget; True once the tier's process has ended."""
    rc = run.proc.poll()
    if rc is not None:
        run.rc, run.wall = rc, now - run.start
        return True
    if run.interrupted is None and now - run.start > run.budget:
        print(f"\n>> tier {run.tier.name} is still running at its budget of {run.budget:.0f} s: interrupting it",
              flush=True)
        os.killpg(run.proc.pid, signal.SIGINT)  # pytest's KeyboardInterrupt: it reports what ran
        run.interrupted = run.last_sigint = now
    elif run.interrupted is not None and now - run.interrupted > GRACE_S:
        os.killpg(run.proc.pid, signal.SIGKILL)
    elif run.interrupted is not None and now - run.last_sigint >= RESEND_S:
        os.killpg(run.proc.pid, signal.SIGINT)
        run.last_sigint = now
    return False


def run_tiers(chosen: list[Tier], extra: list[str], scale: float, reports: Path, *,
              serial: bool, cwd: Path = REPO, poll_s: float = 1.0) -> list[Run]:
    """Run the tiers side by side (or one after the other), each within its budget."""
    alone = serial or len(chosen) == 1
    pending, running, done = list(chosen), [], []
    start = last_beat = time.monotonic()
    try:
        while pending or running:
            while pending and (not alone or not running):
                running.append(start_tier(pending.pop(0), extra, scale, reports, cwd, alone))
            time.sleep(poll_s)
            now = time.monotonic()
            for run in [r for r in running if _check(r, now)]:
                running.remove(run)
                done.append(run)
                if run.log is not None:
                    print(f"\n>> tier {run.tier.name} ended after {run.wall:.0f} s; its output:", flush=True)
                    sys.stdout.write(run.log.read_text(errors="replace"))
                    sys.stdout.flush()
            if running and not alone and now - last_beat >= HEARTBEAT_S:
                last_beat = now
                on = "; ".join(f"{r.tier.name}: {_last_line(r.log) or 'starting'}" for r in running)
                print(f">> {(now - start) / 60:.0f} min, running {on}", flush=True)
    except KeyboardInterrupt:
        for run in running:
            os.killpg(run.proc.pid, signal.SIGINT)
        for run in running:
            run.proc.wait()
        raise
    order = {t.name: i for i, t in enumerate(chosen)}
    return sorted(done, key=lambda r: order[r.tier.name])


def main(argv: list[str] | None = None, table: dict[str, Tier] | None = None, cwd: Path = REPO) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    names = argv[:argv.index("--")] if "--" in argv else argv
    table = tiers() if table is None else table
    known = {**table, FAST.name: FAST}
    p = argparse.ArgumentParser(prog="python tests/run_tiers.py", description=__doc__.splitlines()[0])
    p.add_argument("tiers", nargs="*", metavar="TIER", help=f"one of {', '.join(known)} (default: every tier but fast)")
    p.add_argument("--side-by-side", action="store_true",
                   help="the tiers at once, each output printed when it ends (default: one after the other, live): "
                        "measured over the tiers' budgets and with load-caused failures on 2 cores")
    args = p.parse_args(names)
    unknown = [n for n in args.tiers if n not in known]
    if unknown:
        print(f"run_tiers: unknown tier {unknown[0]!r}; the tiers are {', '.join(known)}", file=sys.stderr)
        return 2
    chosen = [known[n] for n in args.tiers] or list(table.values())
    try:
        scale = float(os.environ.get("LAUNCH_TEST_BUDGET_SCALE", "1"))
    except ValueError:
        print("run_tiers: LAUNCH_TEST_BUDGET_SCALE must be a number", file=sys.stderr)
        return 2
    tally: Counter[str] = Counter()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="launch-tiers-") as tmp:
        runs = run_tiers(chosen, extra, scale, Path(tmp), serial=not args.side_by_side, cwd=cwd)
        for run in runs:
            tally.update(counts(Path(tmp) / f"{run.tier.name}.xml"))
    total = time.monotonic() - start
    how = "side by side" if args.side_by_side and len(chosen) > 1 else "one after the other"
    print(f"\n>> tiers, {how} (wall time, budget, outcome)")
    failed = False
    for run in runs:
        over = run.interrupted is not None
        # pytest's 5: no test selected (a tier whose tests all live elsewhere in a filtered run).
        outcome = "passed" if run.rc in (0, 5) and not over else ("over budget" if over else f"failed (pytest exit {run.rc})")
        failed |= outcome != "passed"
        print(f"   {run.tier.name:<11} {run.wall:7.0f} s  {run.budget:6.0f} s  {outcome}")
    print(f"   {'all':<11} {total:7.0f} s", flush=True)
    for run in runs:
        if run.interrupted is not None:
            print(f"FAILED: tier {run.tier.name} ran past its budget of {run.budget:.0f} s "
                  f"(stopped at {run.wall:.0f} s); its slowest tests are listed above", flush=True)
    # One closing line for the whole run, as pytest's own: the tiers' counts added up.
    print(f"{tally['passed']} passed, {tally['failed']} failed, {tally['skipped']} skipped", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
