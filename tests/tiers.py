"""Test tiers and progress output (a pytest plugin, loaded by tests/conftest.py).

Tiers: `make test-fast` runs `-m "not slurm and not lxc"` (unit tests: no cluster, no
container); `make test` runs everything. A test gets its tier without anyone remembering:

- at collection, a test that uses a fixture of TIER_FIXTURES (directly or through another
  fixture, such as launch_env) is marked with its tier;
- at run time, a test that starts an embedded Slurm cluster or an LXC container (or builds a
  rootfs with debootstrap) without its marker fails with one line that says which marker to add,
  so the fast tier can never start a cluster or a container by accident.

Progress: with -q, pytest names no file; this plugin turns the file names back on (each line
starts with the file it runs), so a long file never looks hung, and the summary ends with the
slowest files' wall times.
"""

from __future__ import annotations

import functools
import os
import subprocess
import time
from collections.abc import Iterator

import pytest

# A fixture that gives every test using it a tier (marker name).
TIER_FIXTURES = {"slurm_cluster": "slurm"}
# Programs whose start means "a container" (argv[0]'s basename).
LXC_PROGRAMS = frozenset({"lxc-create", "lxc-start", "lxc-copy", "lxc-execute", "debootstrap"})
SLOWEST_FILES = 10

_current: list[pytest.Item] = []
_file_seconds: dict[str, float] = {}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        for name in getattr(item, "fixturenames", ()):
            tier = TIER_FIXTURES.get(name)
            if tier and item.get_closest_marker(tier) is None:
                item.add_marker(tier)


def _require(tier: str, what: str) -> None:
    """Fail the running test unless it carries `tier` (outside a test: nothing to check)."""
    if _current and _current[-1].get_closest_marker(tier) is None:
        pytest.fail(f"{_current[-1].nodeid} {what} but is not marked `{tier}`: add @pytest.mark.{tier} "
                    f"(or use a fixture of tests/tiers.py TIER_FIXTURES)", pytrace=False)


def _guard_cluster_start() -> None:
    from launch.cluster.embedded import EmbeddedCluster

    start = EmbeddedCluster._start_fresh
    if getattr(start, "_tier_guard", False):
        return

    @functools.wraps(start)
    def guarded(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        _require("slurm", "starts an embedded Slurm cluster")
        return start(self, *args, **kwargs)

    guarded._tier_guard = True  # type: ignore[attr-defined]
    EmbeddedCluster._start_fresh = guarded  # type: ignore[method-assign]


def _guard_container_start() -> None:
    init = subprocess.Popen.__init__
    if getattr(init, "_tier_guard", False):
        return

    @functools.wraps(init)
    def guarded(self, args, *rest, **kwargs):  # type: ignore[no-untyped-def]
        argv0 = args if isinstance(args, (str, bytes, os.PathLike)) else (args[0] if args else "")
        name = os.path.basename(os.fsdecode(argv0).split()[0]) if argv0 else ""
        if name in LXC_PROGRAMS:
            self._child_created = False  # what Popen.__del__ reads when __init__ stops early
            _require("lxc", f"runs {name}")
        return init(self, args, *rest, **kwargs)

    guarded._tier_guard = True  # type: ignore[attr-defined]
    subprocess.Popen.__init__ = guarded  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    _guard_cluster_start()
    _guard_container_start()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _current.append(item)
    t0 = time.monotonic()
    try:
        return (yield)
    finally:
        _current.pop()
        path = item.nodeid.split("::", 1)[0]
        _file_seconds[path] = _file_seconds.get(path, 0.0) + time.monotonic() - t0


@pytest.hookimpl(trylast=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    # -q hides the file names; -qq (or -v) is left as asked.
    if reporter is not None and session.config.get_verbosity() == -1:
        reporter.showfspath = True


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # type: ignore[no-untyped-def]
    if len(_file_seconds) < 2 or config.get_verbosity() < -1:
        return
    slowest = sorted(_file_seconds.items(), key=lambda kv: kv[1], reverse=True)[:SLOWEST_FILES]
    terminalreporter.write_sep("-", f"slowest {len(slowest)} files (wall s, setup to teardown)")
    for path, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
