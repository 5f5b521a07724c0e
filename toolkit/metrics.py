"""The metrics.jsonl format the trainers write and `launch report` reads.

One JSON object per line. `{"event": "header", ...}` once per (re)start with the run's facts;
`{"event": "step", "step": N, ...}` once per logged step. A resumed run appends to the same file
and logs its steps again, so readers keep the last record of each step. Torch-free, so the CLI
on a login node and the trainers share this reader.

SCHEMAS holds, per trainer (the header's `trainer`), the fields of its step records, the fixed
columns of its console step line and the plots `launch report` draws; the one throughput figure
of its summary.json is named there too.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def step_records(metrics: str | os.PathLike[str], bad: list[str] | None = None) -> list[dict[str, Any]]:
    """Step records of a metrics.jsonl, sorted by step; the last record of a step wins (a resumed
    run logs its steps again), a torn line (a killed run) or a record without a whole-number step
    is skipped, and named in `bad` ("line N: why") when the caller passes a list."""
    by_step = {}
    for n, rec in _numbered(metrics, "step", bad):
        step = rec.get("step")
        if type(step) is not int or step < 0:
            if bad is not None:
                bad.append(f"line {n}: step {step!r} is not a whole number")
            continue
        by_step[step] = rec
    return [by_step[s] for s in sorted(by_step)]


def logged_step_records(metrics: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every step record in file order, a step logged again after a resume included (what
    `step_records` collapses); a torn line is skipped; none while the file does not exist yet."""
    return list(_records(metrics, "step")) if Path(metrics).exists() else []


def header_records(metrics: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The header records of a metrics.jsonl, in order: one per (re)start."""
    return list(_records(metrics, "header"))


def _records(metrics: str | os.PathLike[str], event: str) -> Iterator[dict[str, Any]]:
    """The records of one event kind, in file order; a torn line (a killed run) is skipped."""
    return (rec for _, rec in _numbered(metrics, event))


def _numbered(metrics: str | os.PathLike[str], event: str, bad: list[str] | None = None
              ) -> Iterator[tuple[int, dict[str, Any]]]:
    """(line number, record) of one event kind; a line that is not a JSON object (torn, not
    UTF-8) is skipped, and named in `bad` when given."""
    with open(metrics, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError:  # JSONDecodeError, or UnicodeDecodeError for bytes that are not UTF-8
                if bad is not None:
                    bad.append(f"line {n}: not a JSON record (torn or corrupt)")
                continue
            if not isinstance(rec, dict):
                if bad is not None:
                    bad.append(f"line {n}: a JSON {type(rec).__name__}, not a record")
                continue
            if rec.get("event") == event:
                yield n, rec


# --- the schema: what each trainer logs, how its console line reads, what `launch report` plots


@dataclass(frozen=True)
class Column:
    """One fixed column of the console step line: `label value[unit]`, `-` when absent."""

    key: str
    label: str
    spec: str = ".4g"
    unit: str = ""
    scale: float = 1.0
    missing: str = "-"  # what an absent value reads as (MFU: "n/a" where no peak is known)


@dataclass(frozen=True)
class Plot:
    """One PNG of `launch report`: `keys` share the axes; drawn only when one of them has data."""

    name: str
    keys: tuple[str, ...]
    ylabel: str
    scale: float = 1.0


@dataclass(frozen=True)
class Schema:
    trainer: str
    fields: tuple[str, ...]  # the keys every step record carries (a value may be null)
    columns: tuple[Column, ...]
    plots: tuple[Plot, ...]
    throughput: str  # the one throughput figure of summary.json, named for what it counts
    first_label: str = "step"
    total_key: str | None = None  # a record field holding the count of first_label's units: `shard 3/12`
    per_task: bool = False  # a task_loss{task: loss} dict, one console column and one curve per task
    per_rank: bool = False  # rank_fwd_ms lists on runs of several ranks
    # Short task names for a compact step line (compact_step_line); empty: the column line.
    task_labels: tuple[tuple[str, str], ...] = ()


SCHEMAS: dict[str, Schema] = {
    "stage1": Schema(
        trainer="stage1",
        # steps_total / eta_s: progress, read by `launch status` and the follow heartbeat; a
        # stalled step (> 2x the running median and >= 0.5 s over it) also carries `stall`, its cause.
        fields=("step", "loss", "task_loss", "tok_s", "real_tok_s", "mfu", "mfu_useful", "data_ms", "compute_ms",
                "peak_mem_mb", "compiles", "recompiles", "lr", "grad_norm", "packing_efficiency", "batch_index",
                "batch_digest", "steps_total", "eta_s"),
        columns=(
            Column("loss", "loss", ".4f"),
            Column("tok_s", "tok/s", ".0f"),
            Column("mfu", "MFU", ".3g", "%", 100.0, missing="n/a"),
            Column("mfu_useful", "uMFU", ".3g", "%", 100.0, missing="n/a"),  # padding left out
            Column("data_ms", "data", ".0f", " ms"),
            Column("compute_ms", "compute", ".0f", " ms"),
            Column("peak_mem_mb", "mem", ".0f", " MB"),
            Column("recompiles", "recomp", "d"),
        ),
        plots=(
            Plot("loss", ("loss",), "loss"),
            Plot("tok_s", ("tok_s", "real_tok_s"), "tokens/s"),
            Plot("mfu", ("mfu", "mfu_useful"), "MFU (%)", 100.0),
        ),
        throughput="tok_s_all_ranks",
        per_task=True,
        per_rank=True,
        task_labels=(("gen_img", "gi"), ("gen_txt", "gt"), ("und", "un"), ("replay_img", "ri"),
                     ("replay_text", "rt")),
    ),
    "dflash": Schema(
        trainer="dflash",
        # acc_slot: accuracy of each predicted slot 1..K-1 (a list); acc1 its first; tau the
        # acceptance-length estimate 1 + sum_j prod_{i<=j} acc_slot[i]; acc_rows: the rows of the
        # step they (and target_agree) are measured on (--acc-rows); anchors: blocks in the step
        fields=("step", "loss", "ce", "acc", "acc1", "tau", "acc_slot", "acc_rows", "anchors", "tok_s", "data_ms", "compute_ms",
                "lr", "grad_norm", "epoch", "batch_rows", "padding_efficiency", "steps_total", "eta_s"),
        columns=(
            Column("loss", "loss", ".4f"),
            Column("acc", "acc", ".3f"),
            Column("acc1", "acc1", ".3f"),
            Column("tau", "tau", ".2f"),
            Column("tok_s", "tok/s", ".0f"),
            Column("data_ms", "data", ".1f", " ms"),
            Column("compute_ms", "compute", ".1f", " ms"),
        ),
        plots=(
            Plot("loss", ("loss", "ce", "kl"), "loss"),
            Plot("acc", ("acc", "acc1", "target_agree", "selector_acc"), "accuracy"),
            Plot("tau", ("tau",), "tau (tokens per block)"),
            Plot("tok_s", ("tok_s",), "real tokens/s"),
        ),
        throughput="real_tok_s",
    ),
    "extract": Schema(
        trainer="extract",
        fields=("step", "samples", "samples_per_s", "tok_s", "mib", "location"),
        columns=(
            Column("samples", "samples", "d"),
            Column("samples_per_s", "samples/s", ".1f"),
            Column("tok_s", "tok/s", ".0f"),
            Column("mib", "MiB", ".1f"),
            Column("location", "at", "s"),
        ),
        plots=(
            Plot("samples_per_s", ("samples_per_s",), "samples/s"),
            Plot("tok_s", ("tok_s",), "tokens/s"),
        ),
        throughput="samples_per_s",
        first_label="shard",
        total_key="shards",
    ),
}


def schema_for(header: dict[str, Any] | None) -> Schema:
    """The schema a run's header names; stage-1's for files written before headers named one."""
    name = (header or {}).get("trainer", "stage1")
    if not isinstance(name, str) or name not in SCHEMAS:
        raise ValueError(f"unknown trainer {name!r} in the metrics header (known: {', '.join(SCHEMAS)})")
    return SCHEMAS[name]


def _value(x: Any, spec: str, scale: float, missing: str) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return missing
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return format(x * scale if scale != 1.0 else x, spec)
    return str(x)


LINE_MAX = 120  # characters of a compact step line, whatever the values


def format_eta(seconds: Any) -> str:
    """A duration in at most 6 characters: 42s, 12m05s, 5h32m, 12d05h; `-` when unknown."""
    if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not math.isfinite(seconds):
        return "-"
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 100 * 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{min(s // 86400, 999)}d{s % 86400 // 3600:02d}h"


def _si(x: Any) -> str:
    """A rate in at most 5 characters: 950, 33.1k, 331k, 1.23M."""
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
        return "-"
    for div, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            v = x / div
            return f"{v:.3g}{suffix}" if v < 1000 else f"{v:.0f}{suffix}"
    return f"{x:.0f}"


def _loss(x: Any, decimals: int = 2) -> str:
    if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x):
        return "-"
    return f"{x:.{decimals if abs(x) < 10 else max(0, decimals - 1) if abs(x) < 100 else 0}f}"


def compact_step_line(schema: Schema, record: dict[str, Any], tasks: tuple[str, ...] = ()) -> str:
    """One step in at most LINE_MAX characters, the same fields at every step (`-` where absent):

        step 120/20000 loss 3.123 (gi 3.21 gt 3.30 un 2.95 ri 3.40 rt 4.10) 33.1k tok/s uMFU 50.1% 950+3ms 96.1G eta 5h32m

    `(..)` the per-task losses by the schema's short names, uMFU the useful-token MFU (`n/a`
    without a known peak), compute+data ms, peak memory in GiB, and `STALL(cause)` on a stalled
    step. Where the values would run over, the task losses lose a digit, then memory, tok/s and
    the task losses go.
    """
    step, total = record["step"], record.get("steps_total")
    head = f"step {step}/{total}" if isinstance(total, int) else f"step {step}"
    labels = dict(schema.task_labels)
    losses = record.get("task_loss") or {}
    mfu = record.get("mfu_useful")
    mem = record.get("peak_mem_mb")
    compute, data = record.get("compute_ms"), record.get("data_ms")
    timing = (f"{compute:.0f}+{data:.0f}ms" if isinstance(compute, (int, float)) and isinstance(data, (int, float))
              else "-")
    stall = record.get("stall")

    def line(decimals: int, with_mem: bool, with_tok: bool, with_tasks: bool = True) -> str:
        parts = [head, f"loss {_loss(record.get('loss'), 3)}"]
        if tasks and with_tasks:
            parts.append("(" + " ".join(f"{labels.get(t, t)} {_loss(losses.get(t), decimals)}" for t in tasks) + ")")
        if with_tok:
            parts.append(f"{_si(record.get('tok_s'))} tok/s")
        parts.append("uMFU n/a" if not isinstance(mfu, (int, float)) else f"uMFU {100 * mfu:.1f}%")
        parts.append(timing)
        if with_mem:
            parts.append(f"{mem / 1024:.1f}G" if isinstance(mem, (int, float)) else "-G")
        parts.append(f"eta {format_eta(record.get('eta_s'))}")
        if stall:
            parts.append(f"STALL({stall})")
        return " ".join(parts)

    for args in ((2, True, True), (1, True, True), (1, False, True), (1, False, False), (1, False, False, False)):
        text = line(*args)
        if len(text) <= LINE_MAX:
            return text
    return text[:LINE_MAX]


def dflash_step_line(record: dict[str, Any]) -> str:
    """One DFlash step in at most LINE_MAX characters, the same fields at every step:

        step 120/2000 loss 3.123 acc1 0.412 tau 1.83 33.1k tok/s 950+3ms eta 5h32m

    acc1 the first slot's accuracy, tau the acceptance-length estimate, tok/s real tokens,
    compute+data ms, and `STALL(cause)` on a stalled step (the trainer's `# step line:` legend)."""
    step, total = record["step"], record.get("steps_total")
    compute, data = record.get("compute_ms"), record.get("data_ms")
    acc1, tau = record.get("acc1"), record.get("tau")
    parts = [f"step {step}/{total}" if isinstance(total, int) else f"step {step}",
             f"loss {_loss(record.get('loss'), 3)}",
             f"acc1 {acc1:.3f}" if isinstance(acc1, (int, float)) and math.isfinite(acc1) else "acc1 -",
             f"tau {tau:.2f}" if isinstance(tau, (int, float)) and math.isfinite(tau) else "tau -",
             f"{_si(record.get('tok_s'))} tok/s",
             f"{compute:.0f}+{data:.0f}ms" if isinstance(compute, (int, float)) and isinstance(data, (int, float))
             else "-", f"eta {format_eta(record.get('eta_s'))}"]
    if record.get("stall"):
        parts.append(f"STALL({record['stall']})")
    return " ".join(parts)[:LINE_MAX]


DFLASH_LEGEND = ("step line: step n/N, loss, acc1 (first slot's accuracy), tau (accepted tokens per block), "
                 "real tok/s, compute+data ms, eta; STALL(cause) on a stalled step: compile, allocator, data, or "
                 "unknown (none of those moved)")


def step_line(schema: Schema, record: dict[str, Any], tasks: tuple[str, ...] = ()) -> str:
    """The console line of one step record: the same columns at every step, `-` where absent."""
    if schema.task_labels:
        return compact_step_line(schema, record, tasks)
    if schema.trainer == "dflash":
        return dflash_step_line(record)
    total = record.get(schema.total_key) if schema.total_key else None
    parts = [f"{schema.first_label} {record['step']:>5}" + (f"/{total}" if total is not None else "")]
    for col in schema.columns:
        value = _value(record.get(col.key), col.spec, col.scale, col.missing)
        unit = col.unit if value not in ("-", col.missing) else ""
        parts.append(f"{col.label} {value}{unit}")
        if schema.per_task and col.key == "loss" and tasks:
            losses = record.get("task_loss") or {}
            parts.append(" ".join(f"{t} {_value(losses.get(t), '.2f', 1.0, '-')}" for t in tasks))
    return " | ".join(parts)
