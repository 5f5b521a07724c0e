"""The run's resolved config: `config.yaml` next to its checkpoints, written when a job starts.

Like torchtitan's and llm-foundry's saved configs: what this run was, complete enough to run it
again without the spec or the shell history that made it. Every argument of the trainer as its
own parser resolved it (defaults included), the job's resources, the spec and preset it came
from, the command line, and the versions that ran it. The main task writes it (atomically) at
every start: a requeue or a `launch resume` rewrites it with its own job id; `launch status JOB`
shows it.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import os
import platform
import stat
import sys
from pathlib import Path
from typing import Any

import yaml

from toolkit.fsutil import atomic_write_text

CONFIG = "config.yaml"
VERSIONED = ("gpu-train-toolkit", "torch", "transformers", "deepspeed", "submitit", "triton", "flash-linear-attention")


def plain(value: Any) -> Any:
    """A value YAML's safe dumper writes: paths and enums as text, tuples as lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)


def trainer_args(parsed: Any) -> dict[str, Any]:
    """The entrypoint's parsed arguments (a config dataclass or an argparse Namespace) as a dict."""
    if dataclasses.is_dataclass(parsed) and not isinstance(parsed, type):
        return plain(parsed)
    return plain(dict(vars(parsed))) if hasattr(parsed, "__dict__") else {"value": plain(parsed)}


def versions() -> dict[str, str]:
    found = {"python": platform.python_version()}
    for dist in VERSIONED:
        try:
            found[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def build(module: str, argv: list[str], parsed: Any, meta: dict[str, Any]) -> dict[str, Any]:
    env = os.environ
    return {
        "job_id": env.get("SLURM_JOB_ID"),
        "job": meta.get("job"),
        "preset": meta.get("preset"),
        "spec": meta.get("spec"),
        "entrypoint": module,
        "argv": list(argv),
        "args": trainer_args(parsed) if parsed is not None else None,
        "resources": plain(meta.get("resources")),
        "allocation": {k.removeprefix("SLURM_").lower(): env[k] for k in
                       ("SLURM_JOB_NODELIST", "SLURM_JOB_NUM_NODES", "SLURM_NTASKS", "SLURM_CPUS_PER_TASK",
                        "SLURM_JOB_GPUS", "SLURM_JOB_PARTITION") if k in env},
        "versions": versions(),
    }


def write(run_dir: Path, config: dict[str, Any]) -> Path:
    path = run_dir / CONFIG
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, yaml.dump(config, Dumper=_NoAliasDumper, sort_keys=False, allow_unicode=True))
    return path


class _NoAliasDumper(yaml.SafeDumper):
    """The same value twice is written out twice: the reader refuses aliases."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


class _NoAliasLoader(yaml.SafeLoader):
    """safe_load without aliases: an alias bomb (a billion laughs) would take minutes and gigabytes."""

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        if self.check_event(yaml.AliasEvent):
            raise yaml.YAMLError("YAML aliases are not written by the launcher")
        return super().compose_node(parent, index)


MAX_CONFIG_BYTES = 1 << 20


def read(run_dir: Path) -> dict[str, Any] | None:
    """The run's config.yaml, or None when there is none (yet) or it is not the launcher's: not a
    regular file (a FIFO would block the reader), over 1 MiB, with aliases, or not a mapping.
    Other than a missing file, the reason is said on stderr once."""
    path = run_dir / CONFIG
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        with open(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ValueError("not a regular file")
            raw = f.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ValueError(f"over {MAX_CONFIG_BYTES >> 20} MiB")
        data = yaml.load(raw.decode("utf-8"), Loader=_NoAliasLoader)  # noqa: S506 - a SafeLoader subclass
    except (OSError, ValueError, yaml.YAMLError, RecursionError) as exc:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc).splitlines()[0][:120]
        print(f"launch: {path} not read ({why}); the run's config is not shown", file=sys.stderr)
        return None
    return data if isinstance(data, dict) else None


def summary(config: dict[str, Any]) -> list[str]:
    """A few lines for `launch status`: the resources, the non-default command line, the versions."""
    lines = []
    r = config.get("resources")
    if isinstance(r, dict):
        lines.append(f"resources: {r.get('nodes')} node(s) x {r.get('gpus_per_node')} GPU, "
                     f"{r.get('cpus_per_task')} CPU/task, time {r.get('time')}")
    argv = config.get("argv")
    if isinstance(argv, list):
        lines.append(f"argv: {' '.join(map(str, argv))}")
    v = config.get("versions")
    if isinstance(v, dict):
        lines.append("versions: " + ", ".join(f"{k} {val}" for k, val in v.items()))
    return lines
