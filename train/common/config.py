"""A trainer's command line made from its config dataclass: each flag and its default written once.

Every field `some_name` becomes `--some-name` with the field's default. The field's type gives
the parser: int, float and str as such; a bool defaulting to False is a switch
(`--allow-slow-path`); any other bool reads `on`/`off`. `X | None` accepts X. `opt(...)` adds a
help text, choices, or a converter for types argparse cannot read (a JSON object).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

C = TypeVar("C")


class ConfigError(ValueError):
    """A bad command line: the message is one line naming the flag."""


def opt(default: Any = dataclasses.MISSING, *, help: str = "", choices: tuple[Any, ...] | None = None,
        parse: Callable[[str], Any] | None = None, default_factory: Any = dataclasses.MISSING) -> Any:
    """A config field with command-line metadata (help, choices, a converter)."""
    meta = {"help": help, "choices": choices, "parse": parse}
    if default_factory is not dataclasses.MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _base_type(annotation: Any) -> tuple[Any, bool]:
    """(the type argparse should read, whether None is allowed) from an annotation."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return (rest[0] if len(rest) == 1 else str), True
    return annotation, False


def _on_off(text: str) -> bool:
    if text not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {text!r}")
    return text == "on"


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # No prefix matching: `--step 10` (a typo, or `launch submit --arg step=10`) is an
        # unknown flag, never `--steps 10`.
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> typing.NoReturn:
        # One line for the entrypoint to print (exit 2), not argparse's usage block.
        raise ConfigError(message)


def build_parser(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    hints = typing.get_type_hints(cls)
    parser = _Parser(prog=prog, description=description)
    for f in dataclasses.fields(cls):
        kind, _optional = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
        meta = f.metadata
        kwargs: dict[str, Any] = {"default": default, "help": meta.get("help") or None}
        if meta.get("parse"):
            kwargs["type"] = meta["parse"]
        elif kind is bool and default is False:
            parser.add_argument(flag_name(f.name), action="store_true", help=kwargs["help"])
            continue
        elif kind is bool:
            kwargs.update(type=_on_off, metavar="on|off")
        elif kind in (int, float, str):
            kwargs["type"] = kind
        else:
            kwargs["type"] = str
        if meta.get("choices"):
            kwargs["choices"] = meta["choices"]
        if kwargs["help"] and default not in (None, "", False):
            shown = ("on" if default else "off") if isinstance(default, bool) else default
            kwargs["help"] += f" (default: {shown})"
        parser.add_argument(flag_name(f.name), **kwargs)
    return parser


def parse_config(cls: type[C], argv: list[str] | None, prog: str, description: str) -> C:
    """The dataclass instance for `argv`; a bad flag or value is a ConfigError (one line)."""
    args = build_parser(cls, prog, description).parse_args(argv)
    return cls(**vars(args))


def json_object(text: str) -> dict[str, float]:
    """A `{"name": number}` JSON object from the command line (mixture weights)."""
    import json

    try:
        value = json.loads(text)
        return {str(k): float(v) for k, v in value.items()}
    except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
        raise argparse.ArgumentTypeError(f"must be a JSON object of name -> number, got {text!r}") from None


# The optional sinks: the flag that asks for one, its package, and how to get it.
SINKS = {"tensorboard": ("--tensorboard", "pip install 'gpu-train-toolkit[metrics]'"),
         "wandb": ("--wandb-project", "pip install wandb (offline runs: WANDB_MODE=offline)")}


def require_sink(module: str) -> None:
    """A sink that was asked for and cannot run is a one-line error before the run starts, never
    a run that silently writes nothing there."""
    try:
        __import__(module)
    except ImportError:
        flag, how = SINKS[module]
        raise ConfigError(f"{flag} needs the {module} package, which is not installed here ({how})") from None


def not_a_directory(flag: str) -> Callable[[str], None]:
    """The check of an input file's path that exists on the submitting machine: a file, not a folder."""
    def check(path: str) -> None:
        if Path(path).is_dir():
            raise ConfigError(f"{flag} {path}: a directory, not a file")

    return check
