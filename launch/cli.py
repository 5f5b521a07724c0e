"""`launch`: the command line of the toolkit.

Verbs follow submitit/SkyPilot habits: submit, resume, status, logs -f, cancel, list, doctor,
cluster up|down|status, keepalive, report. Every user error is one line on stderr and a
non-zero exit (2 for a bad command line or input); tracebacks are for bugs only (set
LAUNCH_DEBUG=1 to see them for errors too). A new verb is one VERBS entry naming its module.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

from launch.errors import LaunchError, debug

# verb -> module that owns it. Each module exposes add_arguments(parser) and run(args) -> int.
# Modules are imported only when their verb is built, so `launch --help` stays fast and a
# broken optional module cannot take the whole CLI down.
VERBS: dict[str, tuple[str, str]] = {
    "cluster": ("launch.cluster.cli", "embedded single-node Slurm: up | down | status"),
    "submit": ("launch.submit", "submit a bundled job (stage1, dflash, extract) through submitit"),
    "resume": ("launch.resume", "continue a job's run (same folder, from its last checkpoint) as a new job"),
    "status": ("launch.jobs_cli", "state of one job, or of the recent ones"),
    "logs": ("launch.jobs_cli", "print (or -f follow) a job's log"),
    "cancel": ("launch.jobs_cli", "cancel a job"),
    "list": ("launch.jobs_cli", "jobs submitted from here"),
    "doctor": ("launch.doctor", "preflight checks: kernels, compiler, caches, GPUs, versions"),
    "keepalive": ("launch.keepalive.cli", "GPU keepalive holder and its Slurm hooks"),
    "report": ("launch.report", "plot a job's loss, tok/s and MFU to PNG"),
    "buckets": ("launch.buckets", "bucket edges and padding efficiency for a lengths file"),
    "kernels": ("launch.kernels", "kernel caches baked once per GPU kind and versions: bake | list"),
    "export": ("launch.export", "write a job's checkpoint as a transformers checkpoint (from_pretrained loads it)"),
}


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line (`launch submit: error: ...`), not usage + error.
    No prefix matching: `--step` must never be taken for `--steps` (a typo would change the run)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}{_entrypoint_hint(self.prog, message)} "
                     f"(see `{self.prog} --help`)\n")


def _entrypoint_hint(prog: str, message: str) -> str:
    """`launch submit ... --steps 10`: the flag is the trainer's, which goes through --arg."""
    if not prog.endswith(" submit") or not message.startswith("unrecognized arguments: "):
        return ""
    words = message.removeprefix("unrecognized arguments: ").split()
    if not words or not words[0].startswith("--") or len(words[0]) < 3:
        return ""
    key, _, inline = words[0][2:].partition("=")
    value = inline or (words[1] if len(words) > 1 and not words[1].startswith("--") else "V")
    return f"; an argument of the job's entrypoint goes through --arg: `--arg {key.replace('-', '_')}={value}`"


def version() -> str:
    try:
        return importlib.metadata.version("gpu-train-toolkit")
    except importlib.metadata.PackageNotFoundError:
        return "unknown (not installed)"


# verb -> its parser, once build_parser has run: an unknown flag is the verb's error, with its hint.
VERB_PARSERS: dict[str, argparse.ArgumentParser] = {}


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Callable[[argparse.Namespace], int]]]:
    parser = OneLineParser(prog="launch", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"launch (gpu-train-toolkit) {version()}")
    sub = parser.add_subparsers(dest="verb", metavar="VERB", parser_class=OneLineParser)
    runners: dict[str, Callable[[argparse.Namespace], int]] = {}
    for verb, (module_name, help_text) in VERBS.items():
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            # Only a verb whose own module is absent is skipped; a missing dependency is a bug.
            if exc.name is None or not module_name.startswith(exc.name):
                raise
            continue
        p = sub.add_parser(verb, help=help_text, description=help_text)
        VERB_PARSERS[verb] = p
        add = getattr(module, f"add_{verb}_arguments", None) or module.add_arguments
        add(p)
        runners[verb] = getattr(module, f"run_{verb}", None) or module.run
    return parser, runners


def main(argv: Sequence[str] | None = None) -> int:
    parser, runners = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        (VERB_PARSERS.get(args.verb) or parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if passthrough:
        if not hasattr(args, "extra"):
            parser.error(f"'{args.verb}' takes no arguments after --")
        args.extra = passthrough
    if not args.verb:
        parser.print_help()
        print(f"launch: error: no verb given (one of: {', '.join(runners)})", file=sys.stderr)
        return 2
    try:
        return int(runners[args.verb](args) or 0)
    except LaunchError as exc:
        if debug():
            raise
        print(f"launch {args.verb}: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"launch {args.verb}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `launch list --json | head`: the reader left. Point stdout at /dev/null so the
        # interpreter's final flush cannot raise again; exit like a command killed by SIGPIPE.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141


if __name__ == "__main__":
    sys.exit(main())
