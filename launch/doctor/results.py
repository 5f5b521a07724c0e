"""What a check returns, and how a list of them is shown: a table, JSON, or one error line."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from enum import Enum


class Status(str, Enum):
    PASS = "PASS"
    WARN = "WARN"  # worth reading, does not stop a job
    FAIL = "FAIL"  # the job would fail or run wrong/slow: the doctor exits non-zero
    SKIP = "SKIP"  # not applicable here (no GPU, not in an allocation, no lock)


@dataclass(frozen=True)
class CheckResult:
    check: str  # dotted name, e.g. "kernels.fla" or "cache.triton"
    status: Status
    found: str  # what the doctor saw, with the real error text where there is one
    fix: str = ""  # what to do about it; empty on PASS/SKIP

    def to_dict(self) -> dict[str, str]:
        d = asdict(self)
        d["status"] = self.status.value
        return d


def worst(statuses: Sequence[Status]) -> Status:
    for s in (Status.FAIL, Status.WARN, Status.PASS):
        if s in statuses:
            return s
    return Status.SKIP


def has_failure(results: Sequence[CheckResult]) -> bool:
    return any(r.status is Status.FAIL for r in results)


_WIDTHS = {"check": 22, "status": 6, "found": 64, "fix": 60}


def render_table(results: Sequence[CheckResult]) -> str:
    """A plain-text table; long cells wrap inside their column so the table stays readable."""
    header = ("check", "status", "found", "fix")
    rows = [header, *((r.check, r.status.value, r.found, r.fix) for r in results)]
    widths = [min(_WIDTHS[h], max(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    lines: list[str] = []
    for n, row in enumerate(rows):
        cells = [textwrap.wrap(cell, width=w, break_on_hyphens=False) or [""] for cell, w in zip(row, widths, strict=True)]
        for k in range(max(len(c) for c in cells)):
            parts = [(c[k] if k < len(c) else "").ljust(w) for c, w in zip(cells, widths, strict=True)]
            lines.append(" | ".join(parts).rstrip())
        if n == 0:
            lines.append("-+-".join("-" * w for w in widths))
    fails = sum(r.status is Status.FAIL for r in results)
    warns = sum(r.status is Status.WARN for r in results)
    lines.append("")
    lines.append(f"{len(results)} checks: {fails} FAIL, {warns} WARN")
    return "\n".join(lines)


def to_json(results: Sequence[CheckResult], extra: dict | None = None) -> str:
    return json.dumps({"checks": [r.to_dict() for r in results], **(extra or {})}, indent=2)


def failure_message(results: Sequence[CheckResult]) -> str:
    """One line naming every FAIL with what was found and the fix (for LaunchError)."""
    failed = [r for r in results if r.status is Status.FAIL]
    parts = [f"{r.check}: {r.found} -> fix: {r.fix}" if r.fix else f"{r.check}: {r.found}" for r in failed]
    return f"doctor found {len(failed)} failing check(s): " + " | ".join(parts)
