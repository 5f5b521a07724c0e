"""Test tiers and progress output (a pytest plugin, loaded by tests/conftest.py).

Tiers: `make test-fast` runs `-m "not slurm and not lxc and not ansible and not slow"` (unit
tests: no cluster, no container, no whole Ansible play, none marked slow by hand); `make test`
runs everything. A test gets its tier
without anyone remembering:

- at collection, a test that uses a fixture of TIER_FIXTURES (directly or through another
  fixture, such as launch_env) is marked with its tier; a test whose code, or the code of a
  fixture it uses, calls a PLAY_RUNNERS function (or a helper of its module that does) is marked
  `ansible`, unless it is `lxc` already;
- at run time, a test that starts an embedded Slurm cluster, an LXC container (or builds a
  rootfs with debootstrap) or an ansible-playbook play without its marker fails with one line
  that says which marker to add, so the fast tier never starts one by accident.

Progress: with -q, pytest names no file; this plugin turns the file names back on (each line
starts with the file it runs), so a long file never looks hung, and the summary ends with the
slowest files' wall times.
"""

from __future__ import annotations

import functools
import inspect
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

# A fixture that gives every test using it a tier (marker name).
TIER_FIXTURES = {"slurm_cluster": "slurm"}
# Programs whose start means "a container" (argv[0]'s basename).
LXC_PROGRAMS = frozenset({"lxc-create", "lxc-start", "lxc-copy", "lxc-execute", "debootstrap"})
# Programs whose start means "a virtual machine".
VM_PROGRAMS = frozenset({"qemu-system-x86_64"})
# Functions that run a whole Ansible play (tens of seconds each on 2 cores).
PLAY_RUNNERS = ("run_playbook",)
SLOWEST_FILES = 10
# The containers tier's files, longest first (a fresh clone's serial run, 2026-12-04: the image
# build 516 s, the plays against the stand-in Proxmox host about 390 and 350 s, the README's LXC
# path 341 s, the provisioned container 200 s, the unprivileged CT 189 s): xdist hands out whole
# files (--dist loadfile) in collection order, so the long ones start first, on their own workers.
LONGEST_FIRST = ("test_image.py", "test_ansible_backend_reboots.py", "test_ansible_backend_devices.py",
                 "test_provision_local.py", "test_ansible_provision.py", "test_slurm_unprivileged_ct.py")

_current: list[pytest.Item] = []
_file_seconds: dict[str, float] = {}


@functools.cache
def _source(obj: object) -> str:
    try:
        return inspect.getsource(obj)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""


@functools.cache
def _play_pattern(module: ModuleType) -> re.Pattern[str]:
    """A call of PLAY_RUNNERS or of a function/class of `module`, or of the tests' helper modules
    it imports from (tests/pve_backend.py's PveHost), whose code calls one of them."""
    runners = re.compile(r"\b(?:{})\s*\(".format("|".join(PLAY_RUNNERS)))
    helpers = [name for name, obj in vars(module).items()
               if (inspect.isfunction(obj) or inspect.isclass(obj))
               and (obj.__module__ == module.__name__ or obj.__module__.startswith("tests."))
               and runners.search(_source(obj))]
    return re.compile(r"\b(?:{})\s*\(".format("|".join([*PLAY_RUNNERS, *helpers])))


def _runs_a_play(item: pytest.Item) -> bool:
    """The test's own code, or a fixture's of this project it uses, runs a play (itself or
    through a helper of its module). Installed packages (pytest's own fixtures) are not read."""
    fixtures = [d.func for defs in item._fixtureinfo.name2fixturedefs.values() for d in defs]  # type: ignore[attr-defined]
    for func in [getattr(item, "function", None), *fixtures]:
        module = inspect.getmodule(func) if func is not None else None
        path = Path(getattr(module, "__file__", None) or "/")
        if module is not None and path.is_relative_to(item.config.rootpath) and "site-packages" not in path.parts \
                and _play_pattern(module).search(_source(func)):
            return True
    return False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: LONGEST_FIRST.index(item.path.name) if item.path.name in LONGEST_FIRST
               else len(LONGEST_FIRST))  # stable: every other file keeps its place, after these
    for item in items:
        for name in getattr(item, "fixturenames", ()):
            tier = TIER_FIXTURES.get(name)
            if tier and item.get_closest_marker(tier) is None:
                item.add_marker(tier)
        if item.get_closest_marker("lxc") is None and item.get_closest_marker("ansible") is None and _runs_a_play(item):
            item.add_marker("ansible")


def _require(tier: str, what: str, also: tuple[str, ...] = ()) -> None:
    """Fail the running test unless it carries `tier` (or one of `also`); outside a test, nothing."""
    if _current and not any(_current[-1].get_closest_marker(t) for t in (tier, *also)):
        pytest.fail(f"{_current[-1].nodeid} {what} but is not marked `{tier}`: add @pytest.mark.{tier} "
                    f"(or use a fixture of tests/tiers.py TIER_FIXTURES)", pytrace=False)


def _guard_cluster_start() -> None:
    """The first process of a fresh `up` (the database's initialisation) and every daemon spawn;
    an `up` refused before those (bad resources, an unwritable state dir) is a unit test."""
    from launch.cluster.embedded import EmbeddedCluster

    for name in ("_init_mariadb", "_spawn"):
        method = getattr(EmbeddedCluster, name)
        if getattr(method, "_tier_guard", False):
            continue

        def guarded(self, *args, _method=method, **kwargs):  # type: ignore[no-untyped-def]
            _require("slurm", "starts an embedded Slurm cluster")
            return _method(self, *args, **kwargs)

        functools.update_wrapper(guarded, method)
        guarded._tier_guard = True  # type: ignore[attr-defined]
        setattr(EmbeddedCluster, name, guarded)


def _guard_container_start() -> None:
    init = subprocess.Popen.__init__
    if getattr(init, "_tier_guard", False):
        return

    @functools.wraps(init)
    def guarded(self, args, *rest, **kwargs):  # type: ignore[no-untyped-def]
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        words = os.fsdecode(argv[0]).split() if argv else []
        name = os.path.basename(words[0]) if words else ""
        if name in LXC_PROGRAMS:
            self._child_created = False  # what Popen.__del__ reads when __init__ stops early
            _require("lxc", f"runs {name}", also=("vm",))  # a KVM guest's root is debootstrap'd too
        elif name in VM_PROGRAMS:
            self._child_created = False
            _require("vm", f"runs {name}")
        elif name == "ansible-playbook" and "--syntax-check" not in [*words, *map(os.fsdecode, argv[1:])]:
            self._child_created = False
            _require("ansible", "runs an ansible-playbook play", also=("lxc",))
        return init(self, args, *rest, **kwargs)

    guarded._tier_guard = True  # type: ignore[attr-defined]
    subprocess.Popen.__init__ = guarded  # type: ignore[method-assign]


def pytest_configure(config: pytest.Config) -> None:
    _guard_cluster_start()
    _guard_container_start()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    _current.append(item)
    try:
        return (yield)
    finally:
        _current.pop()


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """Each phase's time (a module fixture's set-up counts in its first test's). Under xdist the
    controller gets every worker's reports, so the summary covers the whole run."""
    path = report.nodeid.split("::", 1)[0]
    _file_seconds[path] = _file_seconds.get(path, 0.0) + report.duration


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
    terminalreporter.write_sep("-", f"slowest {len(slowest)} files (s of test time, set-up to teardown)")
    for path, seconds in slowest:
        terminalreporter.write_line(f"{seconds:8.1f}  {path}")
