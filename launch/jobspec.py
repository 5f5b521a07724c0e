"""Job specs: `launch/jobs/<name>.yaml`, validated strictly.

A spec says what a bundled job runs (a Python module with `main(argv) -> int`), on what
resources, with what environment, and which presets it offers. Every mistake (an unknown key,
a wrong type, an unknown preset) is reported as one line naming the file and the key.
"""

from __future__ import annotations

import copy
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from launch.errors import LaunchError

JOBS_DIR = Path(__file__).with_name("jobs")

# key -> (type, required). Nested dicts are described by their own schema.
RESOURCES_SCHEMA: dict[str, tuple[type | tuple[type, ...], bool]] = {
    "nodes": (int, False),
    "gpus_per_node": (int, False),
    "cpus_per_task": (int, False),
    "mem_gb": ((int, float), False),
    "time": ((str, int), False),
    "partition": (str, False),
}
PRESET_SCHEMA: dict[str, tuple[type | tuple[type, ...], bool]] = {
    "description": (str, False),
    "args": (dict, False),
    "resources": (dict, False),
    "env": (dict, False),
}
SPEC_SCHEMA: dict[str, tuple[type | tuple[type, ...], bool]] = {
    "name": (str, True),
    "description": (str, False),
    "entrypoint": (str, True),
    "resources": (dict, False),
    "env": (dict, False),
    "scratch": (str, False),
    "args": (dict, False),
    "default_preset": (str, False),
    "presets": (dict, False),
    "lock": (dict, False),
}
_TIME_RE = re.compile(r"^(?:(?P<d>\d+)-)?(?P<h>\d+):(?P<m>\d{1,2})(?::(?P<s>\d{1,2}))?$")
# Node-local scratch for compile and model caches. Per job by default; point
# LAUNCH_NODE_SCRATCH at the node's NVMe (the node_caches role does) to keep caches warm.
DEFAULT_SCRATCH = "${LAUNCH_NODE_SCRATCH:-/tmp}/launch-${USER:-root}/${SLURM_JOB_ID}"


@dataclass
class Resources:
    nodes: int = 1
    gpus_per_node: int = 0
    cpus_per_task: int = 1
    mem_gb: float | None = None
    time: str = "01:00:00"
    partition: str | None = None

    @property
    def tasks_per_node(self) -> int:
        # One process per GPU (torchrun-style), or a single process on CPU.
        return max(1, self.gpus_per_node)

    @property
    def time_minutes(self) -> int:
        return parse_time_minutes(self.time)


@dataclass
class Preset:
    name: str
    description: str = ""
    args: dict[str, Any] = field(default_factory=dict)
    resources: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class JobSpec:
    name: str
    entrypoint: str
    source: Path
    description: str = ""
    resources: Resources = field(default_factory=Resources)
    env: dict[str, str] = field(default_factory=dict)
    scratch: str = DEFAULT_SCRATCH
    args: dict[str, Any] = field(default_factory=dict)
    default_preset: str | None = None
    presets: dict[str, Preset] = field(default_factory=dict)
    lock: dict[str, str] = field(default_factory=dict)

    def resolve(self, preset: str | None) -> ResolvedJob:
        """Apply a preset (or the default one) and return what will be submitted."""
        name = preset or self.default_preset
        resources = copy.deepcopy(self.resources)
        args = dict(self.args)
        env = dict(self.env)
        if name is not None:
            if name not in self.presets:
                known = ", ".join(sorted(self.presets)) or "none"
                raise LaunchError(f"{self.source}: unknown preset '{name}' for job '{self.name}' (known: {known})")
            p = self.presets[name]
            for key, value in p.resources.items():
                setattr(resources, key, value)
            args.update(p.args)
            env.update(p.env)
        return ResolvedJob(spec=self, preset=name, resources=resources, args=args, env=env)


@dataclass
class ResolvedJob:
    spec: JobSpec
    preset: str | None
    resources: Resources
    args: dict[str, Any]
    env: dict[str, str]

    def argv(self, extra: list[str] | None = None) -> list[str]:
        """The entrypoint's command line: --key value for each arg, in spec order."""
        out: list[str] = []
        for key, value in self.args.items():
            flag = "--" + key.replace("_", "-")
            if value is True:
                out.append(flag)
            elif value is False or value is None:
                continue
            else:
                out += [flag, str(value)]
        return out + list(extra or [])


def parse_time_minutes(value: str | int) -> int:
    """Slurm time ('D-HH:MM:SS', 'HH:MM:SS', 'HH:MM' or minutes) to whole minutes (rounded up)."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError("time must be positive")
        return value
    text = str(value).strip()
    if text.isdigit():
        return parse_time_minutes(int(text))
    m = _TIME_RE.match(text)
    if not m:
        raise ValueError(f"time '{value}' is not D-HH:MM:SS, HH:MM:SS, HH:MM or minutes")
    seconds = (int(m["d"] or 0) * 86400 + int(m["h"]) * 3600 + int(m["m"]) * 60 + int(m["s"] or 0))
    if seconds <= 0:
        raise ValueError("time must be positive")
    return -(-seconds // 60)


def _type_name(t: type | tuple[type, ...]) -> str:
    if isinstance(t, tuple):
        return " or ".join(x.__name__ for x in t)
    return t.__name__


def _check_mapping(data: Any, schema: dict[str, tuple[type | tuple[type, ...], bool]], where: str,
                   source: Path) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise LaunchError(f"{source}: {where or 'top level'}: expected a mapping, got {type(data).__name__}")
    for key, value in data.items():
        path = f"{where}.{key}" if where else str(key)
        if key not in schema:
            raise LaunchError(f"{source}: unknown key '{path}' (known: {', '.join(schema)})")
        expected, _ = schema[key]
        if value is None and key in ("mem_gb", "partition", "default_preset"):
            continue
        bad_bool = isinstance(value, bool) and expected in (int, (int, float), (str, int))
        if not isinstance(value, expected) or bad_bool:
            raise LaunchError(f"{source}: key '{path}': expected {_type_name(expected)}, "
                              f"got {type(value).__name__} ({value!r})")
    for key, (_, required) in schema.items():
        if required and key not in data:
            raise LaunchError(f"{source}: missing required key '{where + '.' if where else ''}{key}'")
    return data


def _check_resources(data: dict[str, Any], where: str, source: Path) -> dict[str, Any]:
    _check_mapping(data, RESOURCES_SCHEMA, where, source)
    for key in ("nodes", "cpus_per_task"):
        if key in data and data[key] < 1:
            raise LaunchError(f"{source}: key '{where}.{key}': must be >= 1, got {data[key]}")
    if "gpus_per_node" in data and data["gpus_per_node"] < 0:
        raise LaunchError(f"{source}: key '{where}.gpus_per_node': must be >= 0, got {data['gpus_per_node']}")
    if "time" in data:
        try:
            parse_time_minutes(data["time"])
        except ValueError as exc:
            raise LaunchError(f"{source}: key '{where}.time': {exc}") from exc
    return data


def _check_str_map(data: dict[str, Any], where: str, source: Path) -> dict[str, str]:
    for key, value in data.items():
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise LaunchError(f"{source}: key '{where}.{key}': expected a string, got {type(value).__name__}")
    return {str(k): str(v) for k, v in data.items()}


def load_spec(path: str | os.PathLike[str]) -> JobSpec:
    """Parse and validate one spec file."""
    source = Path(path)
    try:
        text = source.read_text()
    except OSError as exc:
        raise LaunchError(f"{source}: cannot read job spec ({exc.strerror})") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise LaunchError(f"{source}: invalid YAML{where}: {problem}") from exc
    _check_mapping(data, SPEC_SCHEMA, "", source)
    resources = Resources(**_check_resources(data.get("resources", {}), "resources", source))
    presets: dict[str, Preset] = {}
    for name, body in (data.get("presets") or {}).items():
        where = f"presets.{name}"
        _check_mapping(body or {}, PRESET_SCHEMA, where, source)
        body = body or {}
        presets[str(name)] = Preset(
            name=str(name), description=body.get("description", ""), args=dict(body.get("args", {})),
            resources=_check_resources(body.get("resources", {}), f"{where}.resources", source),
            env=_check_str_map(body.get("env", {}), f"{where}.env", source))
    spec = JobSpec(
        name=data["name"], entrypoint=data["entrypoint"], source=source,
        description=data.get("description", ""), resources=resources,
        env=_check_str_map(data.get("env", {}), "env", source),
        scratch=data.get("scratch", DEFAULT_SCRATCH), args=dict(data.get("args", {})),
        default_preset=data.get("default_preset"), presets=presets,
        lock=_check_str_map(data.get("lock", {}), "lock", source))
    if spec.default_preset is not None and spec.default_preset not in presets:
        raise LaunchError(f"{source}: key 'default_preset': '{spec.default_preset}' is not one of the presets "
                          f"({', '.join(sorted(presets)) or 'none'})")
    if not re.fullmatch(r"[A-Za-z_][\w.]*", spec.entrypoint):
        raise LaunchError(f"{source}: key 'entrypoint': '{spec.entrypoint}' is not a Python module name")
    return spec


def known_jobs() -> dict[str, Path]:
    dirs = [JOBS_DIR] + [Path(p) for p in os.environ.get("LAUNCH_JOBS_PATH", "").split(os.pathsep) if p]
    jobs: dict[str, Path] = {}
    for d in dirs:
        for f in sorted(d.glob("*.yaml")):
            jobs.setdefault(f.stem, f)
    return jobs


def find_spec(job: str) -> JobSpec:
    """A job name (`stage1`) or a path to a spec file."""
    if job.endswith((".yaml", ".yml")) or os.sep in job:
        return load_spec(job)
    jobs = known_jobs()
    if job not in jobs:
        raise LaunchError(f"unknown job '{job}' (known: {', '.join(jobs) or 'none'}; or give a path to a .yaml spec)")
    return load_spec(jobs[job])
