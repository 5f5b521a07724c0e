"""`make test` and `make test-fast`: the suite's tiers, each one pytest run, timed and budgeted.

    python tests/run_tiers.py                 # every tier, in order (what `make test` and CI run)
    python tests/run_tiers.py unit slurm      # some tiers
    python tests/run_tiers.py fast            # the edit loop: unit tests but the slow ones
    python tests/run_tiers.py slurm -- -k requeue   # pytest arguments after `--`

A tier is a marker expression (the markers come from tests/tiers.py) run with pytest-xdist.
Tiers that wait (on Slurm, on containers booting, on plays) get more workers than the machine's
cores; the unit tier, which computes, gets one worker per core. Files stay whole on one worker
(`--dist loadfile`): a module's fixtures (a built image, a provisioned container) are made once.

Each tier has a budget in seconds, 1.7-2x its idle time on a 2-core machine (tests/README.md
has the measured times); the budgets add up to 70 minutes, inside CI's 90 with its set-up. A tier still
running at its budget is interrupted the way Ctrl-C does (pytest prints what it ran and the
slowest tests), and the run fails with one line naming the tier: a suite that has grown past
its budget says so, instead of being killed by CI's own limit with nothing printed.
`LAUNCH_TEST_BUDGET_SCALE=2` doubles every budget (a machine known to be slower).

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


def _cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def tiers() -> dict[str, Tier]:
    cores = _cores()
    return {t.name: t for t in (
        Tier("unit", f"not slurm and not ({CONTAINER_MARKS})", cores, 1500,
             "no cluster, container or play; the slow unit tests included"),
        Tier("slurm", f"slurm and not ({CONTAINER_MARKS})", 2 * cores + 1, 1200,
             "the embedded Slurm clusters (one per worker), jobs through submitit"),
        Tier("containers", f"({CONTAINER_MARKS})", 2 * cores, 1500,
             "real LXC containers, Ansible plays, images"),
    )}


# The edit loop: the unit tier without what is marked slow.
FAST = Tier("fast", f"not slurm and not ({CONTAINER_MARKS}) and not slow", _cores(), 600,
            "`make test-fast`: unit tests but the slow ones")


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


def run_tier(tier: Tier, extra: list[str], scale: float, junit: Path) -> tuple[int, float, bool]:
    """Run one tier; (pytest's exit code, wall seconds, whether it ran past its budget)."""
    budget = tier.budget_s * scale
    argv = [sys.executable, "-m", "pytest", "-q", "-m", tier.marks, "--durations=20", "--durations-min=1",
            "-p", "no:cacheprovider", f"--junitxml={junit}"]
    if tier.workers > 1:
        argv += ["-n", str(tier.workers), "--dist", "loadfile"]
    argv += extra
    print(f"\n>> tier {tier.name}: {tier.what}\n>> {' '.join(argv[1:])}  (budget {budget:.0f} s)", flush=True)
    start = time.monotonic()
    proc = subprocess.Popen(argv, cwd=REPO, start_new_session=True)
    over = False
    try:
        rc = proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        over = True
        print(f"\n>> tier {tier.name} is still running at its budget of {budget:.0f} s: interrupting it", flush=True)
        os.killpg(proc.pid, signal.SIGINT)  # pytest's KeyboardInterrupt: it reports what ran
        try:
            rc = proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    except KeyboardInterrupt:
        os.killpg(proc.pid, signal.SIGINT)
        rc = proc.wait()
        raise
    return rc, time.monotonic() - start, over


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    names = argv[:argv.index("--")] if "--" in argv else argv
    known = {**tiers(), FAST.name: FAST}
    p = argparse.ArgumentParser(prog="python tests/run_tiers.py", description=__doc__.splitlines()[0])
    p.add_argument("tiers", nargs="*", metavar="TIER", help=f"one of {', '.join(known)} (default: every tier but fast)")
    args = p.parse_args(names)
    unknown = [n for n in args.tiers if n not in known]
    if unknown:
        print(f"run_tiers: unknown tier {unknown[0]!r}; the tiers are {', '.join(known)}", file=sys.stderr)
        return 2
    chosen = [known[n] for n in args.tiers] or list(tiers().values())
    try:
        scale = float(os.environ.get("LAUNCH_TEST_BUDGET_SCALE", "1"))
    except ValueError:
        print("run_tiers: LAUNCH_TEST_BUDGET_SCALE must be a number", file=sys.stderr)
        return 2
    results: list[tuple[Tier, int, float, bool]] = []
    tally: Counter[str] = Counter()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="launch-tiers-") as reports:
        for tier in chosen:
            junit = Path(reports) / f"{tier.name}.xml"
            rc, wall, over = run_tier(tier, extra, scale, junit)
            results.append((tier, rc, wall, over))
            tally.update(counts(junit))
    total = time.monotonic() - start
    print("\n>> tiers (wall time, budget, outcome)")
    failed = False
    for tier, rc, wall, over in results:
        # pytest's 5: no test selected (a tier whose tests all live elsewhere in a filtered run).
        outcome = "passed" if rc in (0, 5) and not over else ("over budget" if over else f"failed (pytest exit {rc})")
        failed |= outcome != "passed"
        print(f"   {tier.name:<11} {wall:7.0f} s  {tier.budget_s * scale:6.0f} s  {outcome}")
    print(f"   {'all':<11} {total:7.0f} s", flush=True)
    for tier, _rc, wall, over in results:
        if over:
            print(f"FAILED: tier {tier.name} ran past its budget of {tier.budget_s * scale:.0f} s "
                  f"(stopped at {wall:.0f} s); its slowest tests are listed above", flush=True)
    # One closing line for the whole run, as pytest's own: the tiers' counts added up.
    print(f"{tally['passed']} passed, {tally['failed']} failed, {tally['skipped']} skipped", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
