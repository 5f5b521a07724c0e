"""`launch keepalive`: the GPU holder (`run`), its state (`status`), and its Slurm hooks.

    launch keepalive run [--gpus auto|0,1] [--devices-dir DIR] [--socket P] [--state P]
    launch keepalive status [--json]
    launch keepalive prolog | epilog        (run by slurmd as root; read SLURM_JOB_ID/GPUS)
    launch keepalive hooks --dir DIR        (write prolog/epilog wrappers with absolute paths)
    launch keepalive unit                   (print the systemd unit)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

from launch.errors import LaunchError, debug
from launch.keepalive.protocol import DEFAULT_STATE, seconds, socket_path, state_path


def _env_seconds(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise LaunchError(f"{name}={raw!r} is not a number of seconds") from None
    return seconds(value, f"{name}={raw!r}")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="keepalive_cmd", metavar="CMD")
    sub.required = True

    run = sub.add_parser("run", help="the holder daemon (normally a systemd unit)")
    run.add_argument("--gpus", default="auto", help="'auto' (all found) or indices like 0,1")
    run.add_argument("--devices-dir", type=Path, default=None,
                     help="hold stand-in GPUs (nvidiaN char devices, major 195) in DIR by lock "
                          "instead of real GPUs through CUDA")
    run.add_argument("--socket", default=None, help="control socket (env LAUNCH_KEEPALIVE_SOCKET)")
    run.add_argument("--state", default=None, help="state file (env LAUNCH_KEEPALIVE_STATE)")
    run.add_argument("--mem-fraction", type=float, default=0.9,
                     help="share of each real GPU's memory to hold (default 0.9)")
    run.add_argument("--hold-timeout", type=float, default=None,
                     help="seconds to wait for a GPU to be held (default 2 for locks, 30 for CUDA; later ones are retried in the background)")
    run.add_argument("--reconcile-interval", type=float, default=30.0,
                     help="seconds between checks with Slurm for jobs that ended without an epilog "
                          "(0: never)")
    run.add_argument("--node-name", action="append", default=None,
                     help="Slurm node name(s) of this machine (default: from scontrol show node)")
    run.add_argument("--no-slurm", action="store_true",
                     help="do not ask Slurm for running jobs at start (only for a node without Slurm)")

    status = sub.add_parser("status", help="what the holder holds and has released")
    status.add_argument("--state", default=None)
    status.add_argument("--json", action="store_true", help="print the state file as JSON")

    for hook, default in (("prolog", 10.0), ("epilog", 60.0)):
        p = sub.add_parser(hook, help=f"Slurm {hook.capitalize()} hook (run as root by slurmd)")
        p.add_argument("--socket", default=None)
        p.add_argument("--timeout", type=float, default=None,
                       help=f"seconds to wait for the holder's ack (env LAUNCH_KEEPALIVE_TIMEOUT, "
                            f"default {default:g})")
        p.add_argument("--log", default=None,
                       help="hook log file (env LAUNCH_KEEPALIVE_HOOK_LOG, default "
                            "/var/log/launch-keepalive/hooks.log; '' for stderr only)")

    hooks = sub.add_parser("hooks", help="write executable prolog/epilog wrappers for slurm.conf")
    hooks.add_argument("--dir", type=Path, required=True)
    hooks.add_argument("--python", default=sys.executable, help="absolute path of the venv's python")
    hooks.add_argument("--socket", default=None)
    hooks.add_argument("--prolog-timeout", type=float, default=10.0)
    hooks.add_argument("--epilog-timeout", type=float, default=60.0)
    hooks.add_argument("--log", default=str(Path("/var/log/launch-keepalive/hooks.log")))

    unit = sub.add_parser("unit", help="print the systemd unit for the holder")
    unit.add_argument("--python", default=sys.executable)
    unit.add_argument("--args", default="", help="extra arguments for `launch keepalive run`")


def _hook_log(arg: str | None) -> Path | None:
    from launch.keepalive.hooks import DEFAULT_HOOK_LOG

    raw = arg if arg is not None else os.environ.get("LAUNCH_KEEPALIVE_HOOK_LOG")
    if raw is None:
        return DEFAULT_HOOK_LOG
    return Path(raw) if raw else None


def run(args: argparse.Namespace) -> int:
    cmd = args.keepalive_cmd
    if cmd == "run":
        return _run_daemon(args)
    if cmd == "status":
        return _status(args)
    if cmd in ("prolog", "epilog"):
        from launch.keepalive import hooks

        timeout = args.timeout
        try:
            if timeout is None:
                default = hooks.DEFAULT_PROLOG_TIMEOUT_S if cmd == "prolog" else hooks.DEFAULT_EPILOG_TIMEOUT_S
                timeout = _env_seconds("LAUNCH_KEEPALIVE_TIMEOUT", default)
            seconds(timeout, f"--timeout {timeout:g}")
        except LaunchError as exc:
            if cmd == "prolog":
                raise
            # A failing epilog drains the node: it logs the line and exits 0, as for any epilog error.
            hooks.hook_logger(_hook_log(args.log)).error("epilog: %s", exc)
            return 0
        hook = hooks.run_prolog if cmd == "prolog" else hooks.run_epilog
        return hook(socket_path(args.socket), timeout, _hook_log(args.log))
    if cmd == "hooks":
        import launch
        from launch.keepalive.hooks import write_hook_wrappers

        # Bake in the directory this `launch` package came from, so slurmd's python imports
        # the same code even when it is not installed in that venv.
        package_root = str(Path(launch.__file__).resolve().parent.parent)
        for name in ("prolog_timeout", "epilog_timeout"):
            seconds(getattr(args, name), f"--{name.replace('_', '-')} {getattr(args, name):g}")
        paths = write_hook_wrappers(args.dir.resolve(), args.python, socket_path(args.socket).resolve(),
                                    args.prolog_timeout, args.epilog_timeout,
                                    Path(args.log).resolve() if args.log else None, package_root)
        for hook, path in paths.items():
            print(f"{hook}: {path}")
        return 0
    if cmd == "unit":
        from launch.keepalive.systemd import render_unit

        print(render_unit(args.python, args.args), end="")
        return 0
    raise LaunchError(f"unknown keepalive command {cmd!r}")


def _run_daemon(args: argparse.Namespace) -> int:
    from launch.keepalive.daemon import KeepaliveDaemon
    from launch.keepalive.holders import build_holders, node_gpus

    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s launch-keepalive %(levelname)s %(message)s")
    holders = build_holders(args.gpus, args.devices_dir, args.mem_fraction)
    hold_timeout = args.hold_timeout
    if hold_timeout is None:
        hold_timeout = 2.0 if args.devices_dir is not None else 30.0
    seconds(hold_timeout, f"--hold-timeout {hold_timeout:g}", allow_zero=True)
    seconds(args.reconcile_interval, f"--reconcile-interval {args.reconcile_interval:g}", allow_zero=True)
    query = None
    if not args.no_slurm:
        from launch.keepalive import slurm_state

        node_names = set(args.node_name) if args.node_name else slurm_state.local_node_names()

        def query() -> dict[str, list[int]]:
            return slurm_state.current_allocations(node_names)

    daemon = KeepaliveDaemon(holders, socket_path(args.socket), state_path(args.state), query,
                             hold_timeout=hold_timeout, reconcile_interval=args.reconcile_interval,
                             present=node_gpus(args.devices_dir)[1])
    daemon.install_signal_handlers()
    try:
        daemon.start()
        daemon.serve_forever()
    finally:
        if daemon.started:
            daemon.shutdown()
    return 0


def read_state(path: Path) -> dict | None:
    """The holder's state, or None when no holder runs (no file, or its pid is gone)."""
    try:
        text = path.read_bytes().decode()
        state = json.loads(text)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise LaunchError(f"cannot read keepalive state {path}: it is a directory; pass the state file") from None
    except UnicodeDecodeError as exc:
        raise LaunchError(f"cannot read keepalive state {path}: not UTF-8 (byte {exc.object[exc.start]:#04x} "
                          f"at offset {exc.start}); is it a launch keepalive file?") from None
    except ValueError as exc:
        raise LaunchError(f"cannot read keepalive state {path}: not JSON ({exc})") from None
    except OSError as exc:
        raise LaunchError(f"cannot read keepalive state {path}: {exc.strerror}") from None
    pid = state.get("pid") if isinstance(state, dict) else None
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        # kill(0 or -1, 0) would ask about a process group, not a holder
        raise LaunchError(f"keepalive state {path} has no valid pid; is it a launch keepalive file?")
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, owned by root
    _check_state(path, state)
    return state


def _gpu_indices(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(g, int) and not isinstance(g, bool) and g >= 0 for g in value)


def _check_state(path: Path, state: dict) -> None:
    """What `status` prints must be what the holder writes (daemon.py `_state`)."""
    if not _gpu_indices(state.get("held")):
        raise LaunchError(f"keepalive state {path}: 'held' is missing or not a list of GPU indices")
    released = state.get("released", {})
    if not (isinstance(released, dict) and all(_gpu_indices(g) for g in released.values())):
        raise LaunchError(f"keepalive state {path}: 'released' is not a map of job ids to GPU indices")
    if not _gpu_indices(state.get("pending", [])):
        raise LaunchError(f"keepalive state {path}: 'pending' is not a list of GPU indices")


def _status(args: argparse.Namespace) -> int:
    path = state_path(args.state)
    if path != DEFAULT_STATE and not path.parent.is_dir():
        # The default's directory is missing when no holder ever ran; a given path's is a typo.
        what = f"{path.parent} is not a directory" if path.parent.exists() else f"no such directory {path.parent}"
        raise LaunchError(f"keepalive state {path}: {what}; is --state right (the holder's default is {DEFAULT_STATE})?")
    state = read_state(path)
    if state is None:
        print(f"keepalive holder: not running (no live holder behind {path})")
        return 1
    if args.json:
        print(json.dumps(state, indent=1))
        return 0
    print(f"keepalive holder: running, pid {state['pid']}, backend {state.get('backend', '?')}")
    print(f"  held:     {state['held']}")
    for job, gpus in state.get("released", {}).items():
        print(f"  job {job}: {gpus}")
    if state.get("pending"):
        print(f"  pending:  {state['pending']} (busy; retrying)")
    print(f"  updated:  {state.get('updated_at', '?')}  ({time.strftime('%H:%M:%S', time.gmtime())} UTC now)")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry for `python -m launch.keepalive.cli ...` (what the Slurm hook wrappers run)."""
    from launch.cli import OneLineParser  # no prefix matching, here and in its subcommands

    parser = OneLineParser(prog="launch keepalive", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except LaunchError as exc:
        if debug():
            raise
        print(f"launch keepalive: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
