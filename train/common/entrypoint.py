"""The shape every training entrypoint's main() shares: parse, Slurm guard, run, one-line errors."""

from __future__ import annotations

import errno
import sys
from collections.abc import Callable, Sequence
from typing import TypeVar

from toolkit.runlock import RunFolderLost
from train.common.checkpoint import CheckpointError
from train.common.config import ConfigError
from train.common.distributed import RendezvousError
from train.common.runtime import Cancelled, NonFiniteStep

C = TypeVar("C")
# What every trainer reports as one line: a bad flag, a checkpoint it cannot trust, a run stopped
# by a non-finite loss. A trainer adds its own (data errors, fast-path refusals).
COMMON_RUN_ERRORS: tuple[type[BaseException], ...] = (ConfigError, CheckpointError, NonFiniteStep, RunFolderLost,
                                                      RendezvousError)


def run_entrypoint(name: str, argv: Sequence[str] | None, *, parse: Callable[[list[str] | None], C],
                   run: Callable[[C], int], guard: bool, config_errors: tuple[type[BaseException], ...] = (),
                   run_errors: tuple[type[BaseException], ...] = ()) -> int:
    """Exit 2 for a bad command line, the guard's code outside Slurm, 1 for a user-facing run
    error, 128+signal for a run stopped by SIGTERM (outcome.json: cancelled at step N).

    `guard=False` exists only for tests of the loops' internals; `python -m ...` always guards.
    """
    try:
        cfg = parse(None if argv is None else list(argv))
    except (ConfigError, *config_errors) as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2
    if guard:
        from train.common.slurm_guard import require_slurm_allocation

        require_slurm_allocation(name)
    try:
        return run(cfg)
    except Cancelled as exc:
        print(f"{name}: {exc}", file=sys.stderr, flush=True)
        return 128 + exc.signum
    except (*COMMON_RUN_ERRORS, *run_errors) as exc:
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        where = f"cannot write {exc.filename}" if exc.filename else "a write failed"
        print(f"{name}: error: {where}: {exc.strerror}; the checkpoints written before are kept: free space and run "
              "the same command again, it resumes from the newest", file=sys.stderr)
        return 1
