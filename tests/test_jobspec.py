"""Job spec validation and the CLI's one-line errors (no Slurm needed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from launch import feasibility, values
from launch.errors import LaunchError
from launch.jobs_cli import LogTail
from launch.jobspec import DEFAULT_SCRATCH, Resources, find_spec, known_jobs, load_spec, parse_time_minutes

REPO = Path(__file__).resolve().parents[1]

GOOD = """
name: demo
entrypoint: some.module
resources: {gpus_per_node: 2, time: "01:30:00"}
args: {steps: 10}
presets:
  small: {args: {steps: 2}, resources: {gpus_per_node: 0}}
"""


def _spec(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(text)
    return path


def test_bundled_specs_are_valid():
    jobs = known_jobs()
    assert "stage1" in jobs
    for name in jobs:
        spec = find_spec(name)
        for preset in spec.presets:
            spec.resolve(preset)


def test_preset_overrides_resources_and_args(tmp_path):
    spec = load_spec(_spec(tmp_path, GOOD))
    base = spec.resolve(None)
    assert base.resources.gpus_per_node == 2 and base.resources.tasks_per_node == 2
    small = spec.resolve("small")
    assert small.resources.gpus_per_node == 0 and small.resources.tasks_per_node == 1
    assert small.argv(["--x"]) == ["--steps", "2", "--x"]
    assert base.resources.time_minutes == 90


@pytest.mark.parametrize("value,minutes", [("1-00:00:00", 1440), ("00:20:00", 20), ("02:30", 3), ("90", 90), ("1-12", 2160), ("2-03:04", 3064),
                                           (45, 45), ("00:00:30", 1)])
def test_parse_time(value, minutes):
    assert parse_time_minutes(value) == minutes


@pytest.mark.parametrize("text,needle", [
    (GOOD + "bogus: 1\n", "unknown key 'bogus'"),
    (GOOD.replace("gpus_per_node: 2,", "gpu_per_node: 2,"), "unknown key 'resources.gpu_per_node'"),
    (GOOD.replace("gpus_per_node: 2,", "gpus_per_node: eight,"), "key 'resources.gpus_per_node': expected int"),
    (GOOD.replace('"01:30:00"', '"soon"'), "key 'resources.time'"),
    (GOOD.replace("{args: {steps: 2}", "{argz: {steps: 2}"), "unknown key 'presets.small.argz'"),
    (GOOD.replace("entrypoint: some.module\n", ""), "missing required key 'entrypoint'"),
    ("name: [unclosed\n", "invalid YAML at line"),
])
def test_bad_specs_name_file_and_key(tmp_path, text, needle):
    path = _spec(tmp_path, text)
    with pytest.raises(LaunchError) as err:
        load_spec(path)
    assert str(path) in str(err.value)
    assert needle in str(err.value)


def _cli(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "LAUNCH_HOME": str(tmp_path / "home"), "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "launch", *args], capture_output=True, text=True, env=env,
                          cwd=REPO)


@pytest.mark.parametrize("args,needle", [
    (["submit", "stage1", "--preset", "huge", "--dry-run"], "unknown preset 'huge'"),
    (["submit", "nosuchjob", "--dry-run"], "unknown job 'nosuchjob'"),
    (["submit", "stage1", "--time", "later", "--dry-run"], "--time"),
    (["status", "424242"], "job 424242 was not submitted from here"),
])
def test_cli_errors_are_one_line_without_traceback(tmp_path, args, needle):
    out = _cli(args, tmp_path)
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1
    assert needle in out.stderr


def test_cli_bad_spec_file_is_one_line(tmp_path):
    path = _spec(tmp_path, GOOD + "resourcez: {}\n")
    out = _cli(["submit", str(path), "--dry-run"], tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.strip() == f"launch submit: error: {path}: unknown key 'resourcez' (known: " \
        "name, description, entrypoint, resources, env, scratch, args, default_preset, presets, lock, main_task)"


@pytest.mark.parametrize("scratch,env,expected", [
    (DEFAULT_SCRATCH, {"USER": "u", "SLURM_JOB_ID": "7"}, "/tmp/launch-u/7"),
    (DEFAULT_SCRATCH, {"LAUNCH_NODE_SCRATCH": "/nvme", "SLURM_JOB_ID": "7"}, "/nvme/launch-root/7"),
    ("/scratch/a b;c*/$USER", {"USER": "u"}, "/scratch/a b;c*/u"),
    ("/x/${SLURM_JOB_ID}_$USER'q", {"USER": "u", "SLURM_JOB_ID": "9"}, "/x/9_u'q"),
])
def test_scratch_word_expands_only_its_variables_in_a_real_shell(scratch, env, expected):
    word = values.scratch_shell(scratch)
    out = subprocess.run(["bash", "-c", f"printf %s {word}"], env={"PATH": os.environ["PATH"], **env},
                         capture_output=True, text=True, check=True)
    assert out.stdout == expected


def test_feasibility_names_the_request_and_the_largest_node():
    cluster = feasibility.parse_sinfo("n1|gpu*|64|512000|gpu:h200:8(S:0-1)|2-00:00:00\n"
                                      "n2|gpu*|32|256000|gpu:4|2-00:00:00\n"
                                      "n2|cpu|32|256000|gpu:4|infinite\n")
    assert cluster.default_partition == "gpu" and cluster.time_limits == {"gpu": 2880, "cpu": None}
    fits = Resources(nodes=1, gpus_per_node=8, cpus_per_task=8, time="1-00:00:00")
    assert feasibility.check(fits, cluster, "job") == ""
    too_wide = Resources(nodes=1, gpus_per_node=16, cpus_per_task=1)
    assert feasibility.check(too_wide, cluster, "job") == (
        "job asks for 1 node with 16 GPUs, 16 CPUs; the largest node of partition gpu (n1) has 8 GPUs, 64 CPUs, "
        "500 GB; ask for less (--gpus-per-node, --cpus-per-task, --nodes) or a smaller preset")
    two_big = Resources(nodes=2, gpus_per_node=8, cpus_per_task=1)
    assert "only 1 node(s) of partition gpu have that" in feasibility.check(two_big, cluster, "job")
    too_long = Resources(nodes=1, gpus_per_node=1, time="3-00:00:00")
    assert "partition gpu allows 2880 min" in feasibility.check(too_long, cluster, "job")
    assert "partition 'x' does not exist (partitions: cpu, gpu)" in feasibility.check(
        Resources(partition="x"), cluster, "job")
    assert feasibility.check(Resources(partition="cpu", gpus_per_node=4, time="30-00:00:00"), cluster, "job") == ""


def test_log_tail_starts_at_the_end_keeps_partial_lines(tmp_path):
    path = tmp_path / "t.log"
    path.write_bytes(b"a\nb\nc\npar")
    assert LogTail(path, "", start_at_end=True, back_lines=2).read(final=True) == ["b", "c", "par"]
    tail = LogTail(path, "[task 1] ", start_at_end=True)
    assert tail.read() == []
    with open(path, "ab") as f:
        f.write(b"tial\nnext")
    assert tail.read() == ["[task 1] partial"]  # the unfinished "next" waits for its newline
    assert LogTail(path, "", start_at_end=False).read() == ["a", "b", "c", "partial"]


def test_unquoted_times_are_slurm_times_not_base60_integers(tmp_path):
    """YAML 1.1 reads `time: 2:00:00` as the integer 7200, which Slurm would take as 7200 minutes
    (five days); a spec reads it as the text it is: two hours, as sbatch --time reads it."""
    spec = load_spec(_spec(tmp_path, GOOD.replace('time: "01:30:00"', "time: 2:00:00")))
    assert spec.resources.time == "2:00:00" and spec.resources.time_minutes == 120
    spec = load_spec(_spec(tmp_path, GOOD.replace('time: "01:30:00"', "time: 90")))
    assert spec.resources.time_minutes == 90  # a plain number stays minutes
