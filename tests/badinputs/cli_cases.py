"""Bad inputs to the launcher's command line and to job specs (both run through `launch.cli.main`)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.badinputs import Case, spec

GOOD_SPEC = """name: demo
entrypoint: fixture_entry
resources: {nodes: 1, gpus_per_node: 0, cpus_per_task: 1, time: "00:05:00"}
env: {A: "1"}
presets:
  small: {args: {sleep: 0}}
"""


# A Slurm whose controller does not answer: port 9 (discard) is closed here; 1 s, not 10, per try.
DEAD_SLURM = ("ClusterName=dead\nSlurmctldHost=localhost(127.0.0.1)\nSlurmctldPort=9\nAuthType=auth/none\n"
              "CredType=cred/none\nMessageTimeout=1\nNodeName=n1 NodeAddr=127.0.0.1 CPUs=1 State=UNKNOWN\n"
              "PartitionName=p Nodes=n1 Default=YES\n")
SPEC = "{tmp}/job.yaml"
SUBMIT = ["submit", "fixture", "--dry-run"]
STATE = "home/cluster/cluster.json"
REGISTRY = "home/jobs.jsonl"
METRICS = "run/metrics.jsonl"
REPORT = ["report", "{tmp}/run"]
HEADER = json.dumps({"event": "header", "trainer": "stage1"}) + "\n"


def _step(step: object, **fields: object) -> str:
    return json.dumps({"event": "step", "step": step, "loss": 1.0, **fields}) + "\n"


def _mkdir(rel: str):  # noqa: ANN202 - a Case.setup
    return lambda tmp: (tmp / rel).mkdir(parents=True)


def _record_with(**fields: object):  # noqa: ANN202 - a Case.setup: a registry line of job 1 with these fields
    def setup(tmp: Path) -> None:
        (tmp / "home").mkdir(parents=True, exist_ok=True)
        (tmp / REGISTRY).write_text(json.dumps({
            "job_id": "1", "name": "fixture", "preset": None, "folder": str(tmp / "runs" / "1"), "submitted_at": 0.0,
            "slurm_conf": str(tmp / "no-slurm.conf"), "argv": [],
            **{k: v.replace("{tmp}", str(tmp)) if isinstance(v, str) else v for k, v in fields.items()}}) + "\n")
    return setup


def _job_folder_with_log_dir(tmp: Path) -> None:
    (tmp / "runs" / "1" / "1_0_log.out").mkdir(parents=True)

CASES = [
    # ---- command-line values
    Case("cli", "nodes-power", [*SUBMIT, "--nodes", "10**20"], r"argument --nodes: expected an integer, got '10\*\*20'"),
    Case("cli", "nodes-zero", [*SUBMIT, "--nodes", "0"], r"--nodes: must be between 1 and 10000, got 0"),
    Case("cli", "nodes-huge", [*SUBMIT, "--nodes", "100000000000000000000"], r"--nodes: expected an integer"),
    Case("cli", "gpus-negative", [*SUBMIT, "--gpus-per-node", "-1"], r"--gpus-per-node: must be between 0 and 256"),
    Case("cli", "cpus-zero", [*SUBMIT, "--cpus-per-task", "0"], r"--cpus-per-task: must be between 1"),
    Case("cli", "time-99:99", [*SUBMIT, "--time", "99:99"], r"time '99:99': MM:SS needs SS < 60"),
    Case("cli", "time-1:99:99", [*SUBMIT, "--time", "1:99:99"], r"time '1:99:99': HH:MM:SS needs MM < 60"),
    Case("cli", "time-zero", [*SUBMIT, "--time", "0"], r"time '0' must be positive"),
    Case("cli", "time-400-days", [*SUBMIT, "--time", "400-00:00:00"], r"over 365 days"),
    Case("cli", "time-words", [*SUBMIT, "--time", "soon"], r"time 'soon' is not a Slurm time"),
    Case("cli", "time-day-hours", [*SUBMIT, "--time", "1-25"], r"after D- the fields are HH < 24"),
    Case("cli", "mem-negative", [*SUBMIT, "--mem-gb", "-4"], r"--mem-gb: mem_gb must be > 0"),
    Case("cli", "mem-nan", [*SUBMIT, "--mem-gb", "nan"], r"--mem-gb: mem_gb must be a number"),
    Case("cli", "mem-tiny", [*SUBMIT, "--mem-gb", "1e-9"], r"--mem-gb: mem_gb 1e-09 is below 0.125 \(128 MB\)"),
    Case("cli", "time-leading-space", [*SUBMIT, "--time", " 10"], r"time ' 10' has spaces around it; give '10'"),
    Case("cli", "scratch-relative", [*SUBMIT, "--scratch", "relative/dir"], r"scratch 'relative/dir' is a relative path"),
    Case("cli", "scratch-user-relative", [*SUBMIT, "--scratch", "$USER/x"], r"scratch '\$USER/x' is a relative path"),
    Case("cli", "runs-dir-proc", [*SUBMIT, "--runs-dir", "/proc/self"], r"runs directory /proc/\d+ is under /proc, a kernel"),
    Case("cli", "runs-dir-sys", [*SUBMIT, "--runs-dir", "/sys/kernel"], r"runs directory /sys/kernel is under /sys"),
    Case("cli", "partition-space", [*SUBMIT, "--partition", "a b"], r"--partition 'a b' has characters Slurm does not use"),
    Case("cli", "partition-newline", [*SUBMIT, "--partition", "gpu\n#SBATCH --wrap=x"], r"--partition 'gpu\\n#SBATCH"),
    Case("cli", "name-shell", [*SUBMIT, "--name", "a;touch x"], r"--name 'a;touch x' is not a plain identifier"),
    Case("cli", "name-newline", [*SUBMIT, "--name", "x\n#SBATCH --wrap=1"], r"--name 'x\\n#SBATCH --wrap=1' is not a plain"),
    Case("cli", "env-key-digit", [*SUBMIT, "--env", "1X=a"], r"environment key '1X' is not a shell variable name"),
    Case("cli", "env-key-space", [*SUBMIT, "--env", "A B=c"], r"environment key 'A B' is not a shell variable name"),
    Case("cli", "env-no-value", [*SUBMIT, "--env", "JUSTKEY"], r"--env: 'JUSTKEY': expected KEY=VALUE"),
    Case("cli", "dependency-no-id", [*SUBMIT, "--dependency", "afterok"], r"dependency 'afterok' is not TYPE:JOBID"),
    Case("cli", "dependency-shell", [*SUBMIT, "--dependency", "afterok:12;rm"], r"dependency 'afterok:12;rm' is not"),
    Case("cli", "scratch-command", [*SUBMIT, "--scratch", "/tmp/$(touch /tmp/pwned)"],
         r"only \$SLURM_JOB_ID, \$LAUNCH_NODE_SCRATCH, \$USER may be expanded, found '\$\(touch"),
    Case("cli", "scratch-backtick", [*SUBMIT, "--scratch", "/tmp/`id`"], r"contains a control character, '`'"),
    Case("cli", "scratch-other-var", [*SUBMIT, "--scratch", "$HOME/x"], r"may be expanded .*found '\$HOME'"),
    Case("cli", "scratch-default-expands", [*SUBMIT, "--scratch", "${USER:-$(id)}/x"], r"found '\$\{USER:-\$\(id\)\}'"),
    Case("cli", "scratch-tilde", [*SUBMIT, "--scratch", "~/x"], r"'~' is not expanded"),
    Case("cli", "arg-bogus", [*SUBMIT, "--arg", "bogus=1"], r"fixture: unknown argument\(s\): --arg bogus=1"),
    Case("cli", "arg-no-key", [*SUBMIT, "--arg", "=1"], r"--arg '=1': expected KEY=VALUE"),
    Case("cli", "arg-bad-choice", [*SUBMIT, "--arg", "mode=nope"], r"--arg mode: invalid choice: 'nope'"),
    Case("cli", "arg-entry-check", [*SUBMIT, "--arg", "sleep=-1"], r"fixture: --arg sleep must be >= 0, got -1.0; nothing submitted"),
    Case("cli", "arg-passthrough", [*SUBMIT, "--", "--steps", "many"], r"--arg steps: invalid int value: 'many'"),
    # the bundled trainers' own parsers, run at submit (no model is built)
    Case("cli", "stage1-arg-bogus", ["submit", "stage1", "--preset", "tiny", "--dry-run", "--arg", "bogus=1"],
         r"stage1: unknown argument\(s\): --arg bogus=1"),
    # No prefix matching (issue 38.6): `--arg step=10` is not `--steps 10`; a trainer flag given to
    # submit itself is named with the --arg that would carry it.
    Case("cli", "stage1-arg-prefix-of-a-flag", ["submit", "stage1", "--preset", "tiny", "--dry-run", "--arg", "step=10"],
         r"stage1: unknown argument\(s\): --arg step=10"),
    Case("cli", "submit-prefix-of-a-flag", [*SUBMIT, "--no-pre"], r"unrecognized arguments: --no-pre"),
    Case("cli", "submit-trainer-flag-hints-arg", ["submit", "stage1", "--preset", "tiny", "--dry-run", "--steps", "10"],
         r"unrecognized arguments: --steps 10; an argument of the job's entrypoint goes through --arg: `--arg steps=10`"),
    # What a job reads at its start is checked at submit (38.2): where it exists here, its contents;
    # where it does not, a warning naming it (it may exist on the nodes only; the embedded cluster's
    # nodes are this machine: refused there, tests/test_cli_light.py).
    Case("cli", "stage1-data-dir-without-manifests", ["submit", "stage1", "--preset", "tiny", "--dry-run", "--arg",
         "data_dir={tmp}/data"], r"stage1: --arg data_dir=\S+/data: no stage-1 manifests in \S+/data \(expected one or more "
         r"of gen_img.jsonl.*\); nothing submitted", setup=_mkdir("data")),
    Case("cli", "stage1-data-dir-absent-here", ["submit", "stage1", "--preset", "tiny", "--dry-run", "--arg",
         "data_dir={tmp}/nowhere"], r"warning: --arg data_dir=\S+/nowhere does not exist on this machine; the job reads it "
         r"on its node\(s\)", outcome="counted"),
    Case("cli", "dflash-data-not-an-extraction", ["submit", "dflash", "--preset", "tiny", "--dry-run", "--arg",
         "data={tmp}/shards"], r"dflash: --arg data=\S+/shards: no meta.json there, not an extraction directory",
         setup=_mkdir("shards")),
    Case("cli", "extract-data-a-directory", ["submit", "extract", "--preset", "tiny", "--dry-run", "--arg",
         "data={tmp}/chat"], r"extract: --arg data=\S+/chat: a directory, not a file; nothing submitted", setup=_mkdir("chat")),
    Case("cli", "stage1-lr-negative", ["submit", "stage1", "--preset", "tiny", "--dry-run", "--arg", "lr=-1"],
         r"stage1: .*--arg lr.*nothing submitted"),
    # image tasks never leave the mixture silently: a text-only model with them weighted is refused
    Case("cli", "stage1-vision-off-image-tasks", ["submit", "stage1", "--preset", "qwen35-2b", "--dry-run",
                                                  "--arg", "vision=off"],
         r"stage1: task\(s\) gen_img, replay_img carry images but --arg vision=off: "
         r"use --arg vision=on, or weights without them \(--arg weights=.*nothing submitted"),
    Case("cli", "stage1-text-checkpoint-image-tasks",
         ["submit", "stage1", "--preset", "tiny", "--dry-run", "--arg", "init_from={tmp}/ckpt",
          "--arg", 'weights={"gen_img": 1, "und": 1}'],
         r"task\(s\) gen_img carry images but checkpoint \S*ckpt has no vision tower: use weights without them "
         r"\(--arg weights=.*\), or an --arg init_from checkpoint with one", {"ckpt/config.json": '{"model_type": "qwen3_5_text"}'}),
    Case("cli", "dflash-offline-no-data", ["submit", "dflash", "--preset", "tiny", "--dry-run"],
         r"dflash: --arg mode=offline needs --arg data"),
    Case("cli", "extract-budget-word", ["submit", "extract", "--preset", "tiny", "--dry-run", "--arg", "token_budget=lots"],
         r"--arg token_budget: invalid int value: 'lots'"),
    Case("cli", "preset-unknown", [*SUBMIT, "--preset", "huge"], r"unknown preset 'huge' for job 'fixture' \(known: "),
    Case("cli", "job-unknown", ["submit", "nosuchjob", "--dry-run"], r"unknown job 'nosuchjob'"),
    Case("cli", "job-missing", ["submit"], r"the following arguments are required: job"),
    Case("cli", "verb-missing", [], r"launch: error: no verb given \(one of: cluster, submit, "),
    Case("cli", "report-out-empty", [*REPORT, "--out", ""], r"--out is empty", {METRICS: HEADER + _step(1)}),
    Case("cli", "verb-unknown", ["sumbit", "fixture"], r"invalid choice: 'sumbit'"),
    Case("cli", "follow-and-json", ["submit", "fixture", "--follow", "--json"], r"not allowed with argument"),
    Case("cli", "list-n-zero", ["list", "-n", "0"], r"argument -n: must be between 1"),
    Case("cli", "list-n-negative", ["list", "-n", "-5"], r"argument -n: must be between 1"),
    Case("cli", "status-not-an-id", ["status", "abc"], r"'abc' is not a Slurm job id"),
    Case("cli", "status-unknown", ["status", "424242"], r"job 424242 was not submitted from here"),
    Case("cli", "logs-task-negative", ["logs", "1", "--task", "-1"], r"--task: must be between 0"),
    Case("cli", "logs-tail-zero", ["logs", "1", "--tail", "0"], r"--tail: must be between 1"),
    Case("cli", "logs-task-absent", ["logs", "1", "--task", "3"], r"job 1 has 1 task\(s\) \(0..0\); there is no task 3",
         job_record=True),
    Case("cli", "logs-from-start-alone", ["logs", "1", "--from-start"], r"--from-start goes with -f", job_record=True),
    Case("cli", "cluster-gpus-negative", ["cluster", "up", "--gpus", "-1"], r"--gpus: must be between 0"),
    # ---- a checkpoint to start from is checked at submit, not minutes later in the job
    Case("cli", "init-from-absent-at-submit", ["submit", "regen", "--preset", "tiny", "--arg", "init_from={tmp}/nope",
                                               "--arg", "data={tmp}/c.jsonl"],
         r"regen: --arg init_from=\S*nope: not a directory .*nothing submitted"),
    Case("cli", "init-from-no-config-at-submit", ["submit", "stage1", "--preset", "tiny", "--arg", "init_from={tmp}"],
         r"stage1: --arg init_from=\S*: no config.json there"),
    Case("cli", "arg-job-output-unknown", ["submit", "fixture", "--arg", "sleep=job:424242", "--dry-run"],
         r"--arg sleep=job:424242: job 424242 was not submitted from here"),
    Case("cli", "arg-job-output-not-an-id", ["submit", "fixture", "--arg", "sleep=job:x1", "--dry-run"],
         r"--arg sleep=job:x1: 'x1' is not a Slurm job id"),
    # ---- `resume`: a continuation of a job's run, never of nothing or into another preset
    Case("cli", "resume-no-checkpoints", ["resume", "1", "--steps", "40"],
         r"job 1 has no checkpoints in .*runs/1: nothing to resume from", job_record=True),
    Case("cli", "resume-other-preset", ["resume", "1", "--preset", "slow"],
         r"--preset: a resume continues JOB's run with JOB's preset and folder", job_record=True),
    Case("cli", "resume-unknown", ["resume", "424242"], r"job 424242 was not submitted from here"),
    Case("cli", "resume-steps-zero", ["resume", "1", "--steps", "0"], r"--steps must be >= 1", job_record=True,
         setup=_mkdir("runs/1/checkpoints")),
    # A total the run has already reached trains nothing: refused before anything is queued (38.4).
    Case("cli", "resume-steps-not-past-the-run", ["resume", "1", "--steps", "50"],
         r"job 1's run is at step 70 \(its newest checkpoint\): --steps 50 would train nothing; give the new total, "
         r"above 70 \(e.g. `launch resume 1 --steps 140`\); nothing submitted", job_record=True,
         files={"runs/1/checkpoints/step_00000050/MANIFEST.json": "{}", "runs/1/checkpoints/step_00000070/MANIFEST.json": "{}",
                "runs/1/checkpoints/step_00000090/partial": ""}),
    Case("cli", "resume-steps-equal-to-the-run", ["resume", "1", "--steps", "70"],
         r"job 1's run is at step 70 \(its newest checkpoint\): --steps 70 would train nothing", job_record=True,
         files={"runs/1/checkpoints/step_00000070/MANIFEST.json": "{}"}),
    Case("cli", "verbose-without-follow", ["submit", "fixture", "--verbose"], r"--verbose is about what --follow shows"),
    # ---- no Slurm reachable: one line saying which Slurm was tried and how to bring one up
    Case("cli", "submit-no-cluster", ["submit", "fixture"],
         r"no Slurm reachable: tried SLURM_CONF=.*no-slurm.conf, and that file does not exist; start the embedded "
         r"cluster with `launch cluster up`"),
    Case("cli", "follow-no-cluster", ["logs", "-f", "1"], r"no Slurm reachable: tried SLURM_CONF=", job_record=True),
    Case("cli", "cancel-no-cluster", ["cancel", "1"], r"no Slurm reachable", job_record=True),
    Case("cli", "embedded-half-down", ["submit", "fixture"],
         r"the embedded cluster in .* is partly down \(not running: mariadb, munged, slurmdbd, slurmctld, slurmd\); "
         r"bring it back with `launch cluster up`", embedded_half_down=True),
    # ---- `cluster up | down | status`: values, options that the action does not read, its state file
    Case("cli", "cluster-nodes-zero", ["cluster", "up", "--nodes", "0"], r"argument --nodes: must be between 1"),
    Case("cli", "cluster-nodes-word", ["cluster", "up", "--nodes", "two"], r"argument --nodes: expected an integer, got 'two'"),
    Case("cli", "cluster-nodes-huge", ["cluster", "up", "--nodes", "100000"], r"--nodes 100000: the embedded cluster has at most"),
    Case("cli", "cluster-gpus-word", ["cluster", "up", "--gpus", "lots"], r"argument --gpus: expected an integer, got 'lots'"),
    Case("cli", "cluster-prolog-missing", ["cluster", "up", "--prolog", "{tmp}/nope"], r"--prolog .*/nope: not an executable file"),
    Case("cli", "cluster-down-with-gpus", ["cluster", "down", "--gpus", "2"], r"--gpus go\(es\) with `cluster up`"),
    Case("cli", "cluster-up-json", ["cluster", "up", "--json"], r"--json goes with `cluster status`, not `cluster up`"),
    Case("cli", "cluster-home-is-file", ["cluster", "status"], r"LAUNCH_HOME=.*/afile is not a directory",
         {"afile": "x"}, env={"LAUNCH_HOME": "{tmp}/afile"}),
    Case("cli", "cluster-state-dir-is-file", ["cluster", "status", "--state-dir", "{tmp}/afile"],
         r"afile is not a directory: the embedded cluster keeps its state there", {"afile": "x"}),
    Case("cli", "cluster-state-garbage", ["cluster", "status"],
         r"cluster.json: unreadable cluster state \(not JSON: .*\); `launch cluster down` stops", {STATE: "{not json"}),
    Case("cli", "cluster-state-not-utf8", ["cluster", "up"], r"unreadable cluster state \(byte 0xff at offset 0 is not UTF-8\)",
         {STATE: b"\xff\xfe{}"}),
    Case("cli", "cluster-state-list", ["cluster", "up"], r"unreadable cluster state \(expected a JSON object, got list\)",
         {STATE: "[1, 2]"}),
    Case("cli", "cluster-state-pids", ["cluster", "status", "--json"], r"'pids' is not a mapping of daemon names to process ids",
         {STATE: '{"pids": {"slurmctld": "abc"}}'}),
    Case("cli", "cluster-state-is-dir", ["cluster", "status"], r"cannot read the cluster state \(Is a directory\)",
         setup=_mkdir(STATE)),
    Case("cli", "cluster-state-dir-unwritable", ["cluster", "up", "--state-dir", "/proc/launch-nope"],
         r"cannot create the cluster's state in /proc/launch-nope \(No such file or directory: /proc/launch-nope\); "
         r"give a writable --state-dir"),
    Case("cli", "submit-state-garbage", ["submit", "fixture"], r"unreadable cluster state \(not JSON", {STATE: "{"},
         env={"SLURM_CONF": ""}),
    # ---- the job registry ($LAUNCH_HOME/jobs.jsonl): never rewritten, its bad lines named
    Case("cli", "registry-garbage-list", ["list"], r"1 line\(s\) of .*jobs.jsonl are not job records \(line 1: not JSON "
         r"\(torn or edited\)\); left as they are", {REGISTRY: "garbage\n"}, outcome="counted"),
    Case("cli", "registry-garbage-status", ["status", "1"], r"job 1 is not in the registry, and 2 line\(s\) of .* are not "
         r"job records \(line 1: not JSON", {REGISTRY: 'garbage\n{"job_id": "1", "na'}),
    Case("cli", "registry-not-utf8", ["logs", "1"], r"line 1: not UTF-8", {REGISTRY: b"\xff\xfe\n"}),
    Case("cli", "registry-record-types", ["logs", "1"], r"line 1: tasks/main_task are not task counts",
         setup=_record_with(tasks="many")),
    Case("cli", "registry-record-id", ["cancel", "1"], r"line 1: job_id is not a string", setup=_record_with(job_id=1)),
    Case("cli", "registry-is-dir", ["list"], r"cannot read the job registry .*jobs.jsonl \(Is a directory\)",
         setup=_mkdir(REGISTRY)),
    Case("cli", "status-no-cluster", ["status", "1"], r"no Slurm reachable: tried SLURM_CONF=.*no-slurm.conf, and that file "
         r"does not exist", job_record=True),
    Case("cli", "list-no-cluster", ["list", "--json"], r"no Slurm reachable: tried SLURM_CONF=", job_record=True),
    Case("cli", "status-slurm-conf-garbage", ["status", "1"], r"Slurm's clients cannot run with .*bad.conf: squeue: fatal: "
         r"Unable to process configuration file \(squeue: error: .*garbage\)",
         {"bad.conf": "garbage = = =\n"}, setup=_record_with(slurm_conf="{tmp}/bad.conf")),
    # slurmctld not answering (a slurm.conf whose controller port is closed): said once, with what the job recorded
    Case("cli", "status-slurm-unreachable", ["status", "1"], r"^launch: Slurm not reachable \(.*Unable to contact slurm "
         r"controller.*\); job 1 recorded no outcome, so its state is unknown$", {"dead.conf": DEAD_SLURM},
         setup=_record_with(slurm_conf="{tmp}/dead.conf")),
    Case("cli", "status-slurm-unreachable-recorded", ["status", "1"], r"recorded outcome: completed at step 6 "
         r"\(outcome.json; Slurm not asked\)\n(?s:.*)Slurm not reachable \(.*\); showing what job 1 recorded in",
         {"dead.conf": DEAD_SLURM, "runs/1/outcome.json": '{"state": "completed", "step": 6, "error": null}'},
         setup=_record_with(slurm_conf="{tmp}/dead.conf"), outcome="counted"),
    Case("cli", "list-slurm-unreachable", ["list"], r"^launch: Slurm not reachable \(.*\); states marked \* are what "
         r"the jobs recorded", {"dead.conf": DEAD_SLURM}, setup=_record_with(slurm_conf="{tmp}/dead.conf")),
    Case("cli", "list-slurm-unreachable-recorded", ["list"], r"\n1 +fixture +- +failed\* (?s:.*)Slurm not reachable",
         {"dead.conf": DEAD_SLURM, "runs/1/outcome.json": '{"state": "failed", "step": 2, "error": "boom"}'},
         setup=_record_with(slurm_conf="{tmp}/dead.conf"), outcome="counted"),
    Case("cli", "logs-folder-gone", ["logs", "1"], r"job 1's folder .*runs/1 is gone \(moved or deleted\?\)", job_record=True),
    Case("cli", "logs-log-is-dir", ["logs", "1"], r"cannot read .*1_0_log.out \(Is a directory\)", job_record=True,
         setup=_job_folder_with_log_dir),
    # ---- the launcher's environment variables
    Case("cli", "debug-zero", ["status", "abc"], r"'abc' is not a Slurm job id", env={"LAUNCH_DEBUG": "0"}),
    Case("cli", "home-newline", ["list"], r"LAUNCH_HOME='.*a\\nb' has a control character", env={"LAUNCH_HOME": "{tmp}/a\nb"}),
    Case("cli", "jobs-path-is-a-spec", ["submit", "fixture", "--dry-run"],
         r"unknown job 'fixture' \(known: .*LAUNCH_JOBS_PATH names '.*fixture.yaml', not a directory",
         {"fixture.yaml": "name: x\n"}, env={"LAUNCH_JOBS_PATH": "{tmp}/fixture.yaml"}),
    Case("cli", "jobs-path-shadowed", ["submit", "stage1", "--preset", "tiny", "--dry-run"],
         r"job 'stage1' is defined by .*launch/jobs/stage1.yaml and by .*/specs/stage1.yaml; rename your copy",
         {"specs/stage1.yaml": "name: stage1\nentrypoint: fixture_entry\n"}, env={"LAUNCH_JOBS_PATH": "{tmp}/specs"}),
    # ---- `launch report`: what each trainer logs, and nothing empty
    Case("cli", "report-missing", ["report", "{tmp}/nope"], r"no run found for '.*/nope'"),
    Case("cli", "report-no-metrics", REPORT, r"run has no metrics.jsonl; the trainer writes it", setup=_mkdir("run")),
    Case("cli", "report-empty", REPORT, r"metrics.jsonl has no step records yet", {METRICS: ""}),
    Case("cli", "report-garbage", REPORT, r"no step records yet \(2 unreadable line\(s\): line 1: not a JSON record",
         {METRICS: "garbage\n\x00\x01\n"}),
    Case("cli", "report-torn-last-line", REPORT, r"skipped line 4: not a JSON record \(torn or corrupt\)",
         {METRICS: HEADER + _step(1) + _step(2) + '{"event": "step", "st'}, outcome="counted"),
    Case("cli", "report-not-utf8-line", REPORT, r"skipped line 2: not a JSON record",
         {METRICS: HEADER.encode() + b'{"event": "step", "step": 9, "loss": \xff}\n' + _step(1).encode()},
         outcome="counted"),
    Case("cli", "report-task-loss-list", REPORT, r"skipped step 2: task_loss is not a mapping of task to loss",
         {METRICS: HEADER + _step(1, task_loss={"a": 1.0}) + _step(2, task_loss=[1, 2])}, outcome="counted"),
    Case("cli", "report-rank-times-text", REPORT, r"skipped step 1: rank_fwd_ms is not a list of times",
         {METRICS: HEADER + _step(1, rank_fwd_ms="abc")}, outcome="counted"),
    Case("cli", "report-unknown-trainer", REPORT, r"unknown trainer 'gpt9' in the metrics header",
         {METRICS: '{"event": "header", "trainer": "gpt9"}\n' + _step(1)}),
    Case("cli", "report-trainer-list", REPORT, r"unknown trainer \[1\] in the metrics header",
         {METRICS: '{"event": "header", "trainer": [1]}\n' + _step(1)}),
    Case("cli", "report-step-word", REPORT, r"line 2: step 'x' is not a whole number", {METRICS: HEADER + _step("x")}),
    Case("cli", "report-nothing-to-draw", REPORT, r"none of its 1 step record\(s\) has a finite value for loss, mfu, .* "
         r"\(what a stage1 run logs\); nothing drawn", {METRICS: HEADER + '{"event": "step", "step": 1, "lr": 0.1}\n'}),
    Case("cli", "report-only-nan", REPORT, r"nothing drawn", {METRICS: HEADER + _step(1, loss=float("nan"))}),
    Case("cli", "report-other-schema", REPORT, r"finite value for acc, .* \(what a dflash run logs\); nothing drawn",
         {METRICS: '{"event": "header", "trainer": "dflash"}\n{"event": "step", "step": 1, "mfu": 0.4}\n'}),
    Case("cli", "report-out-is-file", [*REPORT, "--out", "{tmp}/afile"], r"afile is not a directory; give another --out",
         {METRICS: HEADER + _step(1), "afile": "x"}),
    Case("cli", "report-png-is-dir", [*REPORT, "--out", "{tmp}/o"], r"cannot write .*/o/loss.png \(Is a directory\)",
         {METRICS: HEADER + _step(1)}, setup=_mkdir("o/loss.png")),
    # ---- `launch submit`: the job's environment, its folder, options that cannot go together
    Case("cli", "env-slurm-job-id", [*SUBMIT, "--env", "SLURM_JOB_ID=7"],
         r"environment key SLURM_JOB_ID is set by Slurm for each job and task"),
    Case("cli", "env-slurm-conf", [*SUBMIT, "--env", "SLURM_CONF=/x"], r"environment key SLURM_CONF is set by Slurm"),
    Case("cli", "env-launch-job-dir", [*SUBMIT, "--env", "LAUNCH_JOB_DIR=/x"],
         r"environment key LAUNCH_JOB_DIR is the launcher's own \(where the job writes: use --runs-dir\)"),
    Case("cli", "runs-dir-newline", [*SUBMIT, "--runs-dir", "{tmp}/x\n#SBATCH --wrap=touch"],
         r"runs directory '.*/x\\n#SBATCH --wrap=touch' has '\\n': Slurm's --output/--error lines cannot carry it"),
    Case("cli", "runs-dir-percent", [*SUBMIT, "--runs-dir", "{tmp}/100%j"], r"runs directory '.*/100%j' has '%'"),
    Case("cli", "runs-dir-is-file", [*SUBMIT, "--runs-dir", "{tmp}/afile"], r"afile exists and is not a directory",
         {"afile": "x"}),
    Case("cli", "runs-dir-empty", [*SUBMIT, "--runs-dir", ""], r"--runs-dir is empty"),
    Case("cli", "dry-run-and-follow", [*SUBMIT, "--follow"], r"--follow is about a submitted job, and --dry-run submits none"),
    Case("cli", "dry-run-and-json", [*SUBMIT, "--json"], r"--json is about a submitted job"),
    Case("cli", "list-presets-and-preset", ["submit", "fixture", "--list-presets", "--preset", "slow"],
         r"--list-presets submits nothing, so --preset would do nothing"),
    Case("cli", "arg-nul", [*SUBMIT, "--arg", "mode=ok\x00x"], r"--arg 'mode=ok\\x00x': the value contains a NUL byte"),
    Case("cli", "passthrough-nul", [*SUBMIT, "--", "--mode", "ok\x00"], r"argument 'ok\\x00' after --: contains a NUL byte"),
    Case("cli", "arg-key-newline", [*SUBMIT, "--arg", "mo\nde=ok"], r"--arg 'mo\\nde=ok': expected KEY=VALUE"),
    Case("cli", "nodes-arabic-digit", [*SUBMIT, "--nodes", "\u0661"], r"argument --nodes: expected an integer, got '\u0661'"),
    Case("cli", "time-arabic-digit", [*SUBMIT, "--time", "\u0661\u0660"], r"is not a Slurm time"),
    Case("cli", "dependency-arabic-digit", [*SUBMIT, "--dependency", "afterok:\u0661"], r"is not TYPE:JOBID"),
    Case("cli", "dflash-topology-tasks", ["submit", "dflash", "--preset", "tiny-online", "--gpus-per-node", "2", "--dry-run"],
         r"dflash: --arg topology=2-1 needs 3 ranks, this job has 2; .*nothing submitted"),
    Case("cli", "preset-empty", [*SUBMIT, "--preset", ""], r"--preset is empty"),
    # a pattern is not a job id: with one run under $LAUNCH_HOME/runs it used to be picked silently
    Case("cli", "report-pattern", ["report", "*"], r"no run found for '\*'",
         {"home/runs/fixture/5/metrics.jsonl": HEADER + _step(1)}),
    Case("cli", "arg-twice", [*SUBMIT, "--arg", "sleep=1", "--arg", "sleep=2"], r"--arg sleep given twice \('1', then '2'\)"),
    Case("cli", "env-twice", [*SUBMIT, "--env", "X=1", "--env", "X=2"], r"--env X given twice \('1', then '2'\)"),
    Case("cli", "cluster-state-dir-empty", ["cluster", "status", "--state-dir", ""], r"--state-dir is empty"),
    # ---- `launch doctor` and `launch buckets`
    Case("cli", "doctor-lock-not-utf8", ["doctor", "--lock", "{tmp}/lock.txt"], r"lock.txt is not UTF-8 text",
         {"lock.txt": b"torch\xff>=2\n"}),
    Case("cli", "doctor-lock-bad-line", ["doctor", "--lock", "{tmp}/lock.txt"], r"lock.txt:2: not a requirement line",
         {"lock.txt": "torch>=2\ntorch >>> 3\n"}),
    Case("cli", "doctor-lock-dir", ["doctor", "--lock", "{tmp}"], r"--lock .*: not a file"),
    Case("cli", "doctor-preset-no-job", ["doctor", "--preset", "tiny"], r"--preset needs --job"),
    Case("cli", "doctor-nodes-no-cluster", ["doctor", "--nodes", "2"], r"--nodes needs --on-cluster"),
    Case("cli", "buckets-zero", ["buckets", "--lengths", "{tmp}/l.txt", "--buckets", "0"],
         r"argument --buckets: must be between 1", {"l.txt": "5\n3\n"}),
    Case("cli", "buckets-budget-zero", ["buckets", "--lengths", "{tmp}/l.txt", "--token-budget", "0"],
         r"argument --token-budget: must be between 1", {"l.txt": "5\n3\n"}),
    Case("cli", "buckets-not-utf8", ["buckets", "--lengths", "{tmp}/l.txt"], r"l.txt: not UTF-8 text", {"l.txt": b"\xff\n"}),
    Case("cli", "buckets-dev-null", ["buckets", "--lengths", "/dev/null"], r"/dev/null: not a regular file"),
    Case("cli", "buckets-blank-lines", ["buckets", "{tmp}/l.txt"], r"l.txt: empty: no lengths in it", {"l.txt": "\n \n"}),
    Case("cli", "buckets-no-file", ["buckets"], r"no lengths file: `launch buckets FILE`"),
    Case("cli", "buckets-npy-pickle", ["buckets", "--lengths", "{tmp}/l.npy"], r"l.npy: not a .npy array of lengths",
         {"l.npy": "not an array"}),
    # ---- job specs
    Case("job-spec", "yaml-duplicate-key", ["submit", SPEC, "--dry-run"], r"duplicate key 'name' at lines 1 and 7",
         spec(GOOD_SPEC + "name: other\n")),
    Case("job-spec", "yaml-duplicate-nested", ["submit", SPEC, "--dry-run"], r"duplicate key 'nodes' at lines 3 and 3",
         spec(GOOD_SPEC.replace("{nodes: 1,", "{nodes: 1, nodes: 2,"))),
    Case("job-spec", "yaml-not-utf8", ["submit", SPEC, "--dry-run"], r"not UTF-8 text \(byte 0xff at line 2\)",
         {"job.yaml": b"name: demo\ndescription: \xff\xfe\n"}),
    Case("job-spec", "yaml-alias-bomb", ["submit", SPEC, "--dry-run"], r"line 2: YAML aliases \(\*a\) are not allowed",
         spec('a: &a ["x","x","x","x","x","x","x","x","x"]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\n'
              'c: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\nd: [*c,*c,*c,*c,*c,*c,*c,*c,*c]\n')),
    Case("job-spec", "yaml-python-tag", ["submit", SPEC, "--dry-run"], r"invalid YAML at line 1: could not determine a constructor",
         spec('name: !!python/object/apply:os.system ["touch /tmp/pwned"]\n')),
    Case("job-spec", "yaml-syntax", ["submit", SPEC, "--dry-run"], r"invalid YAML at line", spec("name: [unclosed\n")),
    Case("job-spec", "yaml-empty", ["submit", SPEC, "--dry-run"], r"top level: expected a mapping, got NoneType", spec("")),
    Case("job-spec", "yaml-list", ["submit", SPEC, "--dry-run"], r"top level: expected a mapping, got list", spec("- a\n- b\n")),
    Case("job-spec", "yaml-huge", ["submit", SPEC, "--dry-run"], r"a job spec is at most 1024 KiB",
         spec(GOOD_SPEC + "# " + "x" * (1 << 20) + "\n")),
    # the real size, not the 1 MiB + 1 bytes read of it
    Case("job-spec", "yaml-huge-real-size", ["submit", SPEC, "--dry-run"],
         r"a job spec is at most 1024 KiB, this one is 5242880 bytes \(5\.0 MiB\)", spec("#" * ((5 << 20) - 1) + "\n")),
    Case("job-spec", "spec-env-injection", ["submit", SPEC, "--dry-run"],
         r"key 'env.A;touch /tmp/pwned': environment key 'A;touch /tmp/pwned' is not a shell variable name",
         spec(GOOD_SPEC.replace('env: {A: "1"}', 'env: {"A;touch /tmp/pwned": "1"}'))),
    Case("job-spec", "spec-preset-env-key", ["submit", SPEC, "--dry-run"], r"key 'presets.small.env.\$X': environment key",
         spec(GOOD_SPEC.replace("{args: {sleep: 0}}", '{env: {"$X": "1"}}'))),
    Case("job-spec", "spec-name-newline", ["submit", SPEC, "--dry-run"], r"key 'name': name 'x\\n#SBATCH --wrap=touch' is not a plain",
         spec(GOOD_SPEC.replace("name: demo", 'name: "x\\n#SBATCH --wrap=touch"'))),
    Case("job-spec", "spec-scratch-injection", ["submit", SPEC, "--dry-run"], r"key 'scratch': .*found '\$\(touch",
         spec(GOOD_SPEC + 'scratch: "/tmp/$(touch /tmp/pwned)"\n')),
    Case("job-spec", "spec-time-25:99", ["submit", SPEC, "--dry-run"], r"key 'resources.time': time '25:99': MM:SS needs SS < 60",
         spec(GOOD_SPEC.replace('"00:05:00"', '"25:99"'))),
    Case("job-spec", "spec-mem-negative", ["submit", SPEC, "--dry-run"], r"key 'resources.mem_gb': mem_gb must be > 0 and <= 100000, got -4",
         spec(GOOD_SPEC.replace("cpus_per_task: 1,", "cpus_per_task: 1, mem_gb: -4,"))),
    Case("job-spec", "spec-nodes-zero", ["submit", SPEC, "--dry-run"], r"key 'resources.nodes': nodes must be between 1",
         spec(GOOD_SPEC.replace("nodes: 1,", "nodes: 0,"))),
    Case("job-spec", "spec-nodes-huge", ["submit", SPEC, "--dry-run"], r"key 'resources.nodes': nodes must be between 1 and 10000",
         spec(GOOD_SPEC.replace("nodes: 1,", "nodes: 100000000000000000000,"))),
    Case("job-spec", "spec-gpus-float", ["submit", SPEC, "--dry-run"], r"key 'resources.gpus_per_node': expected int, got float",
         spec(GOOD_SPEC.replace("gpus_per_node: 0,", "gpus_per_node: 1.5,"))),
    Case("job-spec", "spec-partition-newline", ["submit", SPEC, "--dry-run"], r"key 'resources.partition': partition 'a\\n#SBATCH",
         spec(GOOD_SPEC.replace("cpus_per_task: 1,", 'cpus_per_task: 1, partition: "a\\n#SBATCH --x",'))),
    Case("job-spec", "spec-arg-list", ["submit", SPEC, "--dry-run"], r"key 'presets.small.args.sleep': expected a scalar",
         spec(GOOD_SPEC.replace("{sleep: 0}", "{sleep: [1, 2]}"))),
    Case("job-spec", "spec-preset-name", ["submit", SPEC, "--dry-run"], r"key 'presets.bad name': a preset name is",
         spec(GOOD_SPEC.replace("  small:", "  bad name:"))),
    Case("job-spec", "spec-main-task-word", ["submit", SPEC, "--dry-run"], r"key 'main_task': expected int, got str",
         spec(GOOD_SPEC + "main_task: last\n")),
    Case("job-spec", "spec-entrypoint", ["submit", SPEC, "--dry-run"], r"key 'entrypoint': 'os; rm' is not a Python module name",
         spec(GOOD_SPEC.replace("entrypoint: fixture_entry", 'entrypoint: "os; rm"'))),
    Case("job-spec", "spec-unknown-resource", ["submit", SPEC, "--dry-run"], r"unknown key 'presets.small.resources.gpu'",
         spec(GOOD_SPEC.replace("{args: {sleep: 0}}", "{resources: {gpu: 1}}"))),
    Case("job-spec", "spec-missing", ["submit", "{tmp}/absent.yaml", "--dry-run"], r"absent.yaml: cannot read job spec"),

    Case("job-spec", "spec-is-dir", ["submit", SPEC, "--dry-run"], r"job.yaml: cannot read job spec \(Is a directory\)",
         setup=_mkdir("job.yaml")),
    Case("job-spec", "spec-symlink-loop", ["submit", SPEC, "--dry-run"], r"cannot read job spec \(Too many levels of symbolic",
         setup=lambda tmp: os.symlink("job.yaml", tmp / "job.yaml")),
    Case("job-spec", "spec-fifo", ["submit", SPEC, "--dry-run"], r"job.yaml: not a regular file",
         setup=lambda tmp: os.mkfifo(tmp / "job.yaml")),
    Case("job-spec", "spec-dev-zero", ["submit", "/dev/zero", "--dry-run"], r"/dev/zero: not a regular file"),
    Case("job-spec", "spec-utf16", ["submit", SPEC, "--dry-run"], r"not UTF-8 text \(byte 0xff at line 1\)",
         {"job.yaml": GOOD_SPEC.encode("utf-16")}),
    Case("job-spec", "spec-tab-indent", ["submit", SPEC, "--dry-run"], r"invalid YAML at line 6: found character '\\t'",
         spec(GOOD_SPEC.replace("  small", "\tsmall"))),
    Case("job-spec", "spec-two-documents", ["submit", SPEC, "--dry-run"], r"invalid YAML at line 7: but found another document",
         spec(GOOD_SPEC + "---\nname: x\n")),
    Case("job-spec", "spec-deep-nesting", ["submit", SPEC, "--dry-run"], r"YAML nested too deeply",
         spec("a: " + "[" * 3000 + "]" * 3000 + "\n")),
    Case("job-spec", "spec-unhashable-key", ["submit", SPEC, "--dry-run"], r"invalid YAML at line 7: found unhashable key",
         spec(GOOD_SPEC + "? [a, b]\n: 2\n")),
    # YAML 1.1 reads an unquoted 6:00:00:00 as the base-60 integer 1296000 (900 days); specs read it as text
    Case("job-spec", "spec-time-base60", ["submit", SPEC, "--dry-run"], r"key 'resources.time': time '6:00:00:00' is not a Slurm time",
         spec(GOOD_SPEC.replace('"00:05:00"', "6:00:00:00"))),
    Case("job-spec", "spec-preset-time", ["submit", SPEC, "--dry-run"], r"key 'presets.small.resources.time': time '1:99:99'",
         spec(GOOD_SPEC.replace("{args: {sleep: 0}}", '{resources: {time: "1:99:99"}}'))),
    Case("job-spec", "spec-env-null", ["submit", SPEC, "--dry-run"], r"key 'env': expected dict, got NoneType",
         spec(GOOD_SPEC.replace('env: {A: "1"}', "env:"))),
    Case("job-spec", "spec-env-slurm", ["submit", SPEC, "--dry-run"],
         r"key 'env.SLURM_PROCID': environment key SLURM_PROCID is set by Slurm",
         spec(GOOD_SPEC.replace('A: "1"', 'SLURM_PROCID: "3"'))),
    Case("job-spec", "spec-env-launch-scratch", ["submit", SPEC, "--dry-run"],
         r"key 'presets.small.env.LAUNCH_SCRATCH': environment key LAUNCH_SCRATCH is the launcher's own",
         spec(GOOD_SPEC.replace("{args: {sleep: 0}}", '{env: {LAUNCH_SCRATCH: "/x"}}'))),
    Case("job-spec", "spec-entrypoint-absent", ["submit", SPEC, "--dry-run"],
         r"key 'entrypoint': there is no module 'no_such_module_xyz' here",
         spec(GOOD_SPEC.replace("entrypoint: fixture_entry", "entrypoint: no_such_module_xyz"))),
    Case("job-spec", "spec-env-value-nul", ["submit", SPEC, "--dry-run"], r"key 'env.A': environment value of A contains a NUL",
         spec(GOOD_SPEC.replace('A: "1"', 'A: "x\\0y"'))),
    Case("job-spec", "spec-env-hijack-ld-preload", ["submit", SPEC, "--dry-run"],
         r"key 'env.LD_PRELOAD': environment key LD_PRELOAD chooses which code the job runs .*a job spec may not set it",
         spec(GOOD_SPEC.replace('A: "1"', 'LD_PRELOAD: "/tmp/x"'))),
    Case("job-spec", "spec-env-hijack-ld-audit", ["submit", SPEC, "--dry-run"],
         r"key 'env.LD_AUDIT': environment key LD_AUDIT chooses which code the job runs .*a job spec may not set it",
         spec(GOOD_SPEC.replace('A: "1"', 'LD_AUDIT: "/tmp/x"'))),
    Case("job-spec", "spec-env-hijack-ld-library-path", ["submit", SPEC, "--dry-run"],
         r"key 'env.LD_LIBRARY_PATH': environment key LD_LIBRARY_PATH chooses which code the job runs .*a job spec may not set it",
         spec(GOOD_SPEC.replace('A: "1"', 'LD_LIBRARY_PATH: "/tmp/x"'))),
    Case("job-spec", "spec-env-hijack-bash-env", ["submit", SPEC, "--dry-run"],
         r"key 'env.BASH_ENV': environment key BASH_ENV chooses which code the job runs .*a job spec may not set it",
         spec(GOOD_SPEC.replace('A: "1"', 'BASH_ENV: "/tmp/x"'))),
    Case("job-spec", "spec-env-hijack-env", ["submit", SPEC, "--dry-run"],
         r"key 'env.ENV': environment key ENV chooses which code the job runs .*a job spec may not set it",
         spec(GOOD_SPEC.replace('A: "1"', 'ENV: "/tmp/x"'))),
    Case("job-spec", "spec-env-hijack-path", ["submit", SPEC, "--dry-run"],
         r"key 'env.PATH': environment key PATH chooses which code the job runs .*a job spec may not set it",
         spec(GOOD_SPEC.replace('A: "1"', 'PATH: "/tmp/x"'))),
    Case("job-spec", "spec-env-hijack-pythonpath", ["submit", SPEC, "--dry-run"],
         r"key 'env.PYTHONPATH': environment key PYTHONPATH chooses which code the job runs .*a job spec may not set it",
         spec(GOOD_SPEC.replace('A: "1"', 'PYTHONPATH: "/tmp/x"'))),
    Case("job-spec", "spec-env-hijack-pythonhome", ["submit", SPEC, "--dry-run"],
         r"key 'env.PYTHONHOME': environment key PYTHONHOME chooses which code the job runs .*a job spec may not set it",
         spec(GOOD_SPEC.replace('A: "1"', 'PYTHONHOME: "/tmp/x"'))),
    Case("job-spec", "spec-env-hijack-pythonstartup", ["submit", SPEC, "--dry-run"],
         r"key 'env.PYTHONSTARTUP': environment key PYTHONSTARTUP chooses which code the job runs .*a job spec may not set it",
         spec(GOOD_SPEC.replace('A: "1"', 'PYTHONSTARTUP: "/tmp/x"'))),
    Case("job-spec", "spec-env-hijack-glibc-tunables", ["submit", SPEC, "--dry-run"],
         r"key 'env.GLIBC_TUNABLES': environment key GLIBC_TUNABLES chooses which code the job runs .*a job spec may not set it",
         spec(GOOD_SPEC.replace('A: "1"', 'GLIBC_TUNABLES: "/tmp/x"'))),
    Case("job-spec", "spec-preset-env-hijack", ["submit", SPEC, "--dry-run"],
         r"key 'presets.small.env.LD_PRELOAD': environment key LD_PRELOAD chooses which code",
         spec(GOOD_SPEC.replace("{args: {sleep: 0}}", '{env: {LD_PRELOAD: "/tmp/x.so"}}'))),
    Case("cli", "env-hijack-ld-preload", [*SUBMIT, "--env", "LD_PRELOAD=/tmp/x"],
         r"--env LD_PRELOAD: environment key LD_PRELOAD chooses which code the job runs .*add --allow-loader-env if you mean it"),
    Case("cli", "env-hijack-ld-audit", [*SUBMIT, "--env", "LD_AUDIT=/tmp/x"],
         r"--env LD_AUDIT: environment key LD_AUDIT chooses which code the job runs .*add --allow-loader-env if you mean it"),
    Case("cli", "env-hijack-ld-library-path", [*SUBMIT, "--env", "LD_LIBRARY_PATH=/tmp/x"],
         r"--env LD_LIBRARY_PATH: environment key LD_LIBRARY_PATH chooses which code the job runs .*add --allow-loader-env if you mean it"),
    Case("cli", "env-hijack-bash-env", [*SUBMIT, "--env", "BASH_ENV=/tmp/x"],
         r"--env BASH_ENV: environment key BASH_ENV chooses which code the job runs .*add --allow-loader-env if you mean it"),
    Case("cli", "env-hijack-env", [*SUBMIT, "--env", "ENV=/tmp/x"],
         r"--env ENV: environment key ENV chooses which code the job runs .*add --allow-loader-env if you mean it"),
    Case("cli", "env-hijack-path", [*SUBMIT, "--env", "PATH=/tmp/x"],
         r"--env PATH: environment key PATH chooses which code the job runs .*add --allow-loader-env if you mean it"),
    Case("cli", "env-hijack-pythonpath", [*SUBMIT, "--env", "PYTHONPATH=/tmp/x"],
         r"--env PYTHONPATH: environment key PYTHONPATH chooses which code the job runs .*add --allow-loader-env if you mean it"),
    Case("cli", "env-hijack-pythonhome", [*SUBMIT, "--env", "PYTHONHOME=/tmp/x"],
         r"--env PYTHONHOME: environment key PYTHONHOME chooses which code the job runs .*add --allow-loader-env if you mean it"),
    Case("cli", "env-hijack-pythonstartup", [*SUBMIT, "--env", "PYTHONSTARTUP=/tmp/x"],
         r"--env PYTHONSTARTUP: environment key PYTHONSTARTUP chooses which code the job runs .*add --allow-loader-env if you mean it"),
    Case("cli", "allow-loader-env-for-nothing", [*SUBMIT, "--env", "X=1", "--allow-loader-env"],
         r"--allow-loader-env allows --env to set .* and no --env sets one; drop it"),
]


