"""tests/tiers.py in a pytest of its own (one child run over a scratch test directory): a test that
uses the slurm_cluster fixture is marked `slurm`, one that runs a play through a helper `ansible`;
an unmarked test that starts an embedded cluster, an LXC container or a play fails in one line
naming the marker, before anything starts; a marked one goes through; with -q each line names its
file; the summary lists the slowest files."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.conftest import REPO

CONFTEST = '''
import pytest

@pytest.fixture
def slurm_cluster():
    return "not a cluster: only the name counts"

@pytest.fixture
def launch_env(slurm_cluster):
    return {}
'''

TESTS = '''
import subprocess
from pathlib import Path

import pytest
import pytest
from launch.cluster.embedded import EmbeddedCluster

def test_through_launch_env(launch_env, request):
    assert request.node.get_closest_marker("slurm") is not None

def test_plain(request):
    assert request.node.get_closest_marker("slurm") is None

def test_unmarked_cluster(monkeypatch):
    # as on a machine with Slurm installed, so the guard is what stops it here too
    monkeypatch.setattr(EmbeddedCluster, "_check_prerequisites", lambda self: None)
    EmbeddedCluster(Path(__file__).with_name("c")).up(gpus=1, cpus=1)

def test_unmarked_container():
    subprocess.run(["lxc-start", "-n", "never-started"])

def run_playbook():
    try:
        return subprocess.run(["ansible-playbook", "--version"], capture_output=True)
    except FileNotFoundError:
        return None  # not on PATH here: the guard let it through, which is what is checked


class Host:
    def run(self):
        return run_playbook()


def test_play_through_a_helper_is_marked_ansible(request):
    Host().run()
    assert request.node.get_closest_marker("ansible") is not None

def test_unmarked_play():
    subprocess.run(["ansible-playbook", "site.yml"])

def test_syntax_check_is_no_play(request):
    try:
        subprocess.run(["ansible-playbook", "--syntax-check", "site.yml"], capture_output=True)
    except FileNotFoundError:
        pass
    assert request.node.get_closest_marker("ansible") is None

@pytest.mark.lxc
def test_marked_container():
    try:
        subprocess.run(["lxc-start", "--version"], capture_output=True)
    except FileNotFoundError:
        pass  # no LXC here: the guard let it through, which is what is checked
'''


def test_tiers_plugin_marks_guards_and_names_files(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_scratch.py").write_text(textwrap.dedent(TESTS))
    (tmp_path / "test_other.py").write_text("def test_other():\n    pass\n")
    ini = tmp_path / "pytest.ini"
    ini.write_text("[pytest]\nmarkers =\n  slurm: x\n  lxc: x\n  ansible: x\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "tests.tiers", "-p", "no:cacheprovider",
                           "-c", str(ini), "--rootdir", str(tmp_path), str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "3 failed, 6 passed" in out, out
    lines = out.splitlines()
    # each progress line starts with its file
    assert any(ln.startswith("test_other.py .") for ln in lines), out
    assert any(ln.startswith("test_scratch.py ..FF.F..") for ln in lines), out
    assert ("test_scratch.py::test_unmarked_cluster starts an embedded Slurm cluster but is not marked `slurm`: "
            "add @pytest.mark.slurm") in out, out
    assert "test_scratch.py::test_unmarked_container runs lxc-start but is not marked `lxc`" in out, out
    assert "test_scratch.py::test_unmarked_play runs an ansible-playbook play but is not marked `ansible`" in out, out
    assert not (tmp_path / "c" / "mysql" / "mysql").exists(), "the guard let the cluster's database start"
    summary = lines[lines.index(next(ln for ln in lines if "slowest 2 files" in ln)) + 1:][:2]
    assert sorted(ln.split()[-1] for ln in summary) == ["test_other.py", "test_scratch.py"], out


def test_no_slurm_job_output_is_committed_at_the_repo_root():
    """`slurm-<id>.out` at the root is a job some test ran from there (sbatch's default output):
    the tests run `launch` from conftest.RUN_CWD, and the session fails if one appears."""
    listed = subprocess.run(["git", "ls-files", "slurm-*.out"], cwd=REPO, capture_output=True, text=True)
    if listed.returncode != 0:
        pytest.skip("not a git checkout")
    assert listed.stdout.split() == []


RENDEZVOUS_TESTS = '''
import os, time
from pathlib import Path

import pytest

MEET = Path(os.environ["MEET_DIR"])


def _meet(me: str, other: str) -> None:
    (MEET / me).touch()
    deadline = time.monotonic() + 60
    while not (MEET / other).exists():
        assert time.monotonic() < deadline, f"{other} never ran beside {me}"
        time.sleep(0.05)


@pytest.mark.a
def test_a():
    _meet("a", "b")


@pytest.mark.b
def test_b():
    _meet("b", "a")


@pytest.mark.c
def test_c_outlasts_its_budget():
    time.sleep(600)
'''


def test_run_tiers_runs_tiers_side_by_side_and_stops_one_at_its_budget(tmp_path: Path, monkeypatch, capsys) -> None:
    """Tiers a and b each wait for the other's test to start (they pass only if run side by side);
    tier c sleeps past its 3 s budget: interrupted, one FAILED line, its slowest tests reported.
    Each tier's pytest ignores SIGINT until 5 s into its start, as a loaded machine's slow start
    swallowed the budget's first one: the runner's next SIGINT still gets tier c's report."""
    from tests import run_tiers

    scratch = tmp_path / "suite"
    scratch.mkdir()
    (scratch / "test_meet.py").write_text(RENDEZVOUS_TESTS)
    (scratch / "conftest.py").write_text(
        "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "def pytest_collection_finish(session):\n"
        "    time.sleep(5)\n    signal.signal(signal.SIGINT, signal.default_int_handler)\n")
    (scratch / "pytest.ini").write_text("[pytest]\nmarkers =\n  a: x\n  b: x\n  c: x\n")
    monkeypatch.setenv("MEET_DIR", str(tmp_path))
    table = {t.name: t for t in (run_tiers.Tier("a", "a", 1, 120, "tier a", nice=5),
                                 run_tiers.Tier("b", "b", 1, 120, "tier b"),
                                 run_tiers.Tier("c", "c", 1, 3, "tier c"))}
    rc = run_tiers.main(["--side-by-side"], table=table, cwd=scratch)
    out = capsys.readouterr().out
    assert rc == 1, out
    summary = out[out.index(">> tiers, side by side"):]
    assert [ln.split()[0] for ln in summary.splitlines()[1:4]] == ["a", "b", "c"], out
    assert " passed" in summary.splitlines()[1] and " passed" in summary.splitlines()[2], out
    assert "over budget" in summary.splitlines()[3], out
    assert "FAILED: tier c ran past its budget of 3 s" in out, out
    # an interrupted pytest writes no JUnit report: its FAILED line above is what counts it
    assert out.rstrip().endswith("2 passed, 0 failed, 0 skipped"), out
    # each tier's own output, whole, once it ended
    assert out.count(">> tier a ended after") == 1 and "KeyboardInterrupt" in out, out
