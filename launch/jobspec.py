"""Job specs: `launch/jobs/<name>.yaml`, validated strictly.

A spec says what a bundled job runs (a Python module with `main(argv) -> int`), on what
resources, with what environment, and which presets it offers. Every mistake (an unknown key,
a wrong type, an unknown preset) is reported as one line naming the file and the key.
"""

from __future__ import annotations

import copy
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from launch import values
from launch.errors import LaunchError
from launch.values import parse_slurm_time

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
    "main_task": (int, False),
}
MAX_SPEC_BYTES = 1 << 20
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
    def total_tasks(self) -> int:
        return self.nodes * self.tasks_per_node

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
    # The task whose log `launch logs` shows by default; negative counts from the last
    # (DFlash online: the drafter is the last rank).
    main_task: int = 0

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

    @property
    def main_task(self) -> int:
        """The main task's index in this job (spec's main_task; negative counts from the last)."""
        n = self.resources.total_tasks
        return min(max(self.spec.main_task if self.spec.main_task >= 0 else n + self.spec.main_task, 0), n - 1)

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
    """A Slurm time (see launch.values.parse_slurm_time) in whole minutes; an int is minutes."""
    if isinstance(value, int) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"time {value} must be positive")
        return parse_slurm_time(str(value))
    return parse_slurm_time(value)


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
    checks = {
        "nodes": lambda v: values.check_bounded_int(v, 1, values.MAX_NODES, "nodes"),
        "gpus_per_node": lambda v: values.check_bounded_int(v, 0, values.MAX_GPUS_PER_NODE, "gpus_per_node"),
        "cpus_per_task": lambda v: values.check_bounded_int(v, 1, values.MAX_CPUS_PER_TASK, "cpus_per_task"),
        "mem_gb": lambda v: v if v is None else values.check_mem_gb(v),
        "time": parse_time_minutes,
        "partition": lambda v: v if v is None else values.check_slurm_value(v, "partition"),
    }
    for key, check in checks.items():
        if key in data:
            try:
                check(data[key])
            except ValueError as exc:
                raise LaunchError(f"{source}: key '{where}.{key}': {exc}") from exc
    return data


# Anyone who can write a spec on LAUNCH_JOBS_PATH could otherwise run code as the submitting user.
SPEC_HIJACK_HOW = ("a job spec may not set it (whoever writes a spec on LAUNCH_JOBS_PATH would run code as the "
                   "submitting user); give it with `launch submit --env KEY=VALUE --allow-loader-env` if you mean it")


def _check_str_map(data: dict[str, Any], where: str, source: Path, *, shell_keys: bool = False) -> dict[str, str]:
    for key, value in data.items():
        if not isinstance(value, (str, int, float)) or isinstance(value, bool):
            raise LaunchError(f"{source}: key '{where}.{key}': expected a string, got {type(value).__name__}")
        if shell_keys:
            try:
                values.check_env_key(key)
                values.check_env_not_hijack(key, SPEC_HIJACK_HOW)
                values.check_env_value(str(key), str(value))
            except ValueError as exc:
                raise LaunchError(f"{source}: key '{where}.{key}': {exc}") from exc
    return {str(k): str(v) for k, v in data.items()}


def _check_args(data: dict[str, Any], where: str, source: Path) -> dict[str, Any]:
    """Entrypoint arguments: identifiers mapping to scalars (they become --key value)."""
    for key, value in data.items():
        if not isinstance(key, str) or not values.SHELL_NAME_RE.fullmatch(key.replace("-", "_")):
            raise LaunchError(f"{source}: key '{where}.{key}': an argument name is letters, digits, '_' or '-'")
        if value is not None and not isinstance(value, (str, int, float, bool)):
            raise LaunchError(f"{source}: key '{where}.{key}': expected a scalar (string, number, true/false "
                              f"or null), got {type(value).__name__}")
    return dict(data)


class _SpecYAMLError(Exception):
    """A YAML construct job specs do not allow; carries the line it is on."""


# PyYAML's int and float patterns without their base-60 forms (YAML 1.2 dropped them too).
_PLAIN_NUMBERS = {
    "tag:yaml.org,2002:int": re.compile(r"^(?:[-+]?0b[0-1_]+|[-+]?0[0-7_]+|[-+]?(?:0|[1-9][0-9_]*)|[-+]?0x[0-9a-fA-F_]+)$"),
    "tag:yaml.org,2002:float": re.compile(r"^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+][0-9]+)?"
                                          r"|\.[0-9][0-9_]*(?:[eE][-+][0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
}


def _without_base60(resolvers: dict) -> dict:
    return {first: [(tag, _PLAIN_NUMBERS.get(tag, regexp)) for tag, regexp in entries]
            for first, entries in resolvers.items()}


class _SpecLoader(yaml.SafeLoader):
    """safe_load that refuses duplicate keys (naming both lines) and aliases (an alias bomb
    expands exponentially; specs have no use for them), and reads `2:00:00` as the text it is
    (YAML 1.1 reads it as the base-60 integer 7200, which Slurm would take as 7200 minutes)."""

    yaml_implicit_resolvers = _without_base60(yaml.SafeLoader.yaml_implicit_resolvers)

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _SpecYAMLError(f"line {event.start_mark.line + 1}: YAML aliases (*{event.anchor}) are not "
                                 "allowed in job specs; write the value out")
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):  # type: ignore[no-untyped-def]
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key; SafeLoader reports it below
                continue
            if first is not None:
                raise _SpecYAMLError(f"duplicate key '{key}' at lines {first} and {line}")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _size(n: int) -> str:
    return f"{n} bytes ({n / 2**20:.1f} MiB)" if n >= 2**20 else f"{n} bytes"


def parse_yaml(raw: bytes, source: Path) -> Any:
    """Spec bytes to data: UTF-8 only, no duplicate keys, no aliases; errors are one line."""
    if len(raw) > MAX_SPEC_BYTES:
        raise LaunchError(f"{source}: a job spec is at most {MAX_SPEC_BYTES >> 10} KiB, this one is "
                          f"{_size(len(raw))}")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = raw[:exc.start].count(b"\n") + 1
        raise LaunchError(f"{source}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at line {line})") from None
    try:
        return yaml.load(text, Loader=_SpecLoader)  # noqa: S506 - a SafeLoader subclass
    except _SpecYAMLError as exc:
        raise LaunchError(f"{source}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise LaunchError(f"{source}: invalid YAML{where}: {problem}") from None
    except RecursionError:
        raise LaunchError(f"{source}: YAML nested too deeply") from None


def load_spec(path: str | os.PathLike[str]) -> JobSpec:
    """Parse and validate one spec file."""
    source = Path(path)
    try:
        # A FIFO or a device (/dev/zero) would block or never end: only a regular file, read bounded.
        fd = os.open(source, os.O_RDONLY | os.O_NONBLOCK)
        with open(fd, "rb") as f:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise LaunchError(f"{source}: not a regular file; a job spec is a .yaml file")
            if info.st_size > MAX_SPEC_BYTES:  # named by its real size, not by the bytes read
                raise LaunchError(f"{source}: a job spec is at most {MAX_SPEC_BYTES >> 10} KiB, this one is "
                                  f"{_size(info.st_size)}")
            raw = f.read(MAX_SPEC_BYTES + 1)
    except OSError as exc:
        raise LaunchError(f"{source}: cannot read job spec ({exc.strerror})") from None
    data = parse_yaml(raw, source)
    _check_mapping(data, SPEC_SCHEMA, "", source)
    resources = Resources(**_check_resources(data.get("resources", {}), "resources", source))
    presets: dict[str, Preset] = {}
    for name, body in (data.get("presets") or {}).items():
        where = f"presets.{name}"
        if not isinstance(name, str) or not values.NAME_RE.fullmatch(name.replace(".", "_")):
            raise LaunchError(f"{source}: key '{where}': a preset name is a letter, then letters, digits, "
                              "'.', '_' or '-'")
        _check_mapping(body or {}, PRESET_SCHEMA, where, source)
        body = body or {}
        presets[name] = Preset(
            name=name, description=body.get("description", ""),
            args=_check_args(body.get("args", {}), f"{where}.args", source),
            resources=_check_resources(body.get("resources", {}), f"{where}.resources", source),
            env=_check_str_map(body.get("env", {}), f"{where}.env", source, shell_keys=True))
    spec = JobSpec(
        name=data["name"], entrypoint=data["entrypoint"], source=source,
        description=data.get("description", ""), resources=resources,
        env=_check_str_map(data.get("env", {}), "env", source, shell_keys=True),
        scratch=data.get("scratch", DEFAULT_SCRATCH), args=_check_args(data.get("args", {}), "args", source),
        default_preset=data.get("default_preset"), presets=presets,
        lock=_check_str_map(data.get("lock", {}), "lock", source), main_task=data.get("main_task", 0))
    try:
        values.check_name(spec.name)
        values.scratch_shell(spec.scratch)
    except ValueError as exc:
        key = "name" if str(exc).startswith("name") else "scratch"
        raise LaunchError(f"{source}: key '{key}': {exc}") from exc
    if spec.default_preset is not None and spec.default_preset not in presets:
        raise LaunchError(f"{source}: key 'default_preset': '{spec.default_preset}' is not one of the presets "
                          f"({', '.join(sorted(presets)) or 'none'})")
    if not re.fullmatch(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*", spec.entrypoint):
        raise LaunchError(f"{source}: key 'entrypoint': '{spec.entrypoint}' is not a Python module name")
    if abs(spec.main_task) > values.MAX_GPUS_PER_NODE * values.MAX_NODES:
        raise LaunchError(f"{source}: key 'main_task': {spec.main_task} is not a task index")
    return spec


def _job_dirs() -> list[Path]:
    """The bundled specs, then each directory of LAUNCH_JOBS_PATH (colon-separated)."""
    return [JOBS_DIR] + [Path(p) for p in os.environ.get("LAUNCH_JOBS_PATH", "").split(os.pathsep) if p]


def known_jobs() -> dict[str, Path]:
    jobs: dict[str, Path] = {}
    for d in _job_dirs():
        for f in sorted(d.glob("*.yaml")):
            jobs.setdefault(f.stem, f)
    return jobs


def find_spec(job: str) -> JobSpec:
    """A job name (`stage1`) or a path to a spec file."""
    if job.endswith((".yaml", ".yml")) or os.sep in job:
        return load_spec(job)
    jobs = known_jobs()
    if job not in jobs:
        # A LAUNCH_JOBS_PATH entry that is not a directory is the likely reason: say so.
        odd = [p for p in os.environ.get("LAUNCH_JOBS_PATH", "").split(os.pathsep) if p and not Path(p).is_dir()]
        where = f"; LAUNCH_JOBS_PATH names {', '.join(map(repr, odd))}, not a directory" if odd else ""
        raise LaunchError(f"unknown job '{job}' (known: {', '.join(jobs) or 'none'}{where}; "
                          "or give a path to a .yaml spec)")
    # The first directory wins a name; a second spec of that name is a user's copy that would
    # be silently ignored.
    twins = [d / f"{job}.yaml" for d in _job_dirs() if (d / f"{job}.yaml").is_file() and d / f"{job}.yaml" != jobs[job]]
    if twins:
        raise LaunchError(f"job '{job}' is defined by {jobs[job]} and by {', '.join(map(str, twins))}; "
                          f"rename your copy, or submit it by path (`launch submit {twins[0]}`)")
    return load_spec(jobs[job])
