"""What `submit --follow`, `logs -f` and `logs` show of a job's log by default (`--verbose`: all of it).

The log files keep every line; the terminal gets the run. Left out of the terminal:
- submitit's INFO and WARNING lines (job environment, pickles, "Bypassing signal SIGCONT",
  "Job completed successfully"), and srun's "got SIGCONT"; submitit's ERROR lines stay, but for
  its "Submitted job triggered an exception" and srun's "task N: Exited with exit code N" (the
  exception itself is the traceback's last line, and the launcher's closing line says it);
- progress bars (tqdm's `NN%|###| k/n [...]`, often several joined by carriage returns);
- the preflight table, when every row PASSed or was SKIPped: one `[launch] preflight:` line
  instead; a WARN or FAIL row is shown whole, with the table's header;
- before the first step of each attempt (a requeued job starts again): the trainer's set-up comments (`# kernels[...]`, `# MFU ...`, ...)
  except its header, cut to the facts a reader checks first (trainer, shape, params, device,
  ranks, steps), the step line's legend (`# step line: ...`), and comments about resuming,
  restarting, warnings or errors;
- the trainer's `# done: {json}` (the launcher prints the summary itself) and the launcher's
  own `[launch] running <module> <argv>` line (the command line is in the log and config.yaml).
"""

from __future__ import annotations

import re

_TQDM = re.compile(r"\d+%\|.*\|\s*\d+/\d+")
_SRUN_EXIT = re.compile(r"^srun: error: \S+: tasks? [\d,-]+: Exited with exit code \d+$")
_TABLE_HEAD = re.compile(r"^check\s+\| status \| found")
_TABLE_RULE = re.compile(r"^-+\+-+")
_TABLE_ROW = re.compile(r"^(\S*)\s*\| (PASS|WARN|FAIL|SKIP)\s*\|")
_TABLE_MORE = re.compile(r"^\s+\|")
_TABLE_SUM = re.compile(r"^(\d+) checks: (\d+) FAIL, (\d+) WARN$")
_HEADER_KEYS = ("trainer", "shape", "preset", "mode", "topology", "params", "device", "world", "start_step", "steps")
_KEEP_EARLY = ("resum", "restart", "warn", "error", "skipp", "refus")


def short_header(line: str) -> str:
    """`# trainer=stage1 shape=tiny params=5160600 ... steps=60` -> its first facts only."""
    facts = dict(re.findall(r"(?:^#|\s)(\w+)=(\S+)", line))
    parts = []
    for key in _HEADER_KEYS:
        value = facts.get(key)
        if value is None or (key == "start_step" and value == "0"):
            continue
        if key == "params" and value.isdigit():
            value = f"{int(value) / 1e6:.1f}M"
        parts.append(f"{key}={value}")
    return "# " + " ".join(parts)


class QuietFilter:
    """Feeds of log lines in, the lines worth a terminal out. One instance per followed stream
    set: it remembers whether a preflight table or the first step has been seen."""

    def __init__(self) -> None:
        self.table: list[str] | None = None  # rows held back while a preflight table is read
        self.table_bad = False
        self.stepped = False

    def feed(self, lines: list[str]) -> list[str]:
        out: list[str] = []
        for line in lines:
            out.extend(self._one(line))
        return out

    def _one(self, line: str) -> list[str]:
        prefix, body = "", line
        if line.startswith("[task ") and "] " in line:
            cut = line.index("] ") + 2
            prefix, body = line[:cut], line[cut:]
        if "\r" in body:  # progress bars redraw with CR; what is left after the last one is what shows
            body = body.rsplit("\r", 1)[-1]
            if not body.strip() or _TQDM.search(body):
                return []
        if self.table is not None:
            return [prefix + ln for ln in self._table_line(body)]
        if _TABLE_HEAD.match(body):  # a preflight: a (requeued) attempt starts, its set-up comments follow
            self.table, self.table_bad, self.stepped = [body], False, False
            return []
        if body.startswith(("submitit INFO", "submitit WARNING", "srun: got SIGCONT")) or _TQDM.search(body):
            return []
        # A failed task's echoes: submitit's "Submitted job triggered an exception" (its exception is
        # the traceback's last line, which stays) and srun's "task N: Exited with exit code N".
        if (body.startswith("submitit ERROR") and body.endswith("Submitted job triggered an exception")) \
                or _SRUN_EXIT.match(body):
            return []
        if body.startswith("[launch] running "):
            self.stepped = False
            return []
        if body.startswith("step "):
            self.stepped = True
            return [line]
        if body.startswith("# done: "):
            return []
        if body.startswith("# ") and not self.stepped:
            if body.startswith("# trainer="):
                return [prefix + short_header(body)]
            if body.startswith("# step line:"):  # the legend of the lines that follow
                return [prefix + body]
            if not any(word in body.lower() for word in _KEEP_EARLY):
                return []
        return [prefix + body]

    def _table_line(self, body: str) -> list[str]:
        assert self.table is not None
        total = _TABLE_SUM.match(body)
        if total:
            rows, self.table = self.table, None
            n, fails, warns = (int(g) for g in total.groups())
            if fails or warns:
                return [*rows, body]
            return [f"[launch] preflight: {n} checks, none failed or warned (the table is in the log)"]
        row = _TABLE_ROW.match(body)
        if row and row.group(2) in ("WARN", "FAIL"):
            self.table_bad = True
            self.table.append(body)
        elif row:
            self.table_bad = False
        elif _TABLE_MORE.match(body) and self.table_bad:
            self.table.append(body)
        elif not (_TABLE_RULE.match(body) or _TABLE_MORE.match(body) or not body.strip()):
            # Not the table after all (a torn table, other output): give back what was held.
            rows, self.table = self.table, None
            return [*rows, *self._one(body)]
        return []
