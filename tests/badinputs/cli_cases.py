"""Bad inputs to the launcher's command line and to job specs (both run through `launch.cli.main`)."""

from __future__ import annotations

from tests.badinputs import Case, spec

GOOD_SPEC = """name: demo
entrypoint: fixture_entry
resources: {nodes: 1, gpus_per_node: 0, cpus_per_task: 1, time: "00:05:00"}
env: {A: "1"}
presets:
  small: {args: {sleep: 0}}
"""


SPEC = "{tmp}/job.yaml"
SUBMIT = ["submit", "fixture", "--dry-run"]

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
    Case("cli", "arg-bogus", [*SUBMIT, "--arg", "bogus=1"], r"fixture does not accept these arguments: unrecognized arguments: --bogus 1"),
    Case("cli", "arg-no-key", [*SUBMIT, "--arg", "=1"], r"--arg '=1': expected KEY=VALUE"),
    Case("cli", "arg-bad-choice", [*SUBMIT, "--arg", "mode=nope"], r"argument --mode: invalid choice: 'nope'"),
    Case("cli", "arg-entry-check", [*SUBMIT, "--arg", "sleep=-1"], r"fixture does not accept these arguments: --sleep must be >= 0, got -1.0 \(see `python -m fixture_entry --help`\); nothing submitted"),
    Case("cli", "arg-passthrough", [*SUBMIT, "--", "--steps", "many"], r"argument --steps: invalid int value: 'many'"),
    # the bundled trainers' own parsers, run at submit (no model is built)
    Case("cli", "stage1-arg-bogus", ["submit", "stage1", "--preset", "tiny", "--dry-run", "--arg", "bogus=1"],
         r"stage1 does not accept these arguments: unrecognized arguments: --bogus 1"),
    Case("cli", "stage1-lr-negative", ["submit", "stage1", "--preset", "tiny", "--dry-run", "--arg", "lr=-1"],
         r"stage1 does not accept these arguments: .*--lr.*nothing submitted"),
    Case("cli", "dflash-offline-no-data", ["submit", "dflash", "--preset", "tiny", "--dry-run"],
         r"dflash does not accept these arguments: --mode offline needs --data"),
    Case("cli", "extract-budget-word", ["submit", "extract", "--preset", "tiny", "--dry-run", "--arg", "token_budget=lots"],
         r"argument --token-budget: invalid int value: 'lots'"),
    Case("cli", "preset-unknown", [*SUBMIT, "--preset", "huge"], r"unknown preset 'huge' for job 'fixture' \(known: "),
    Case("cli", "job-unknown", ["submit", "nosuchjob", "--dry-run"], r"unknown job 'nosuchjob'"),
    Case("cli", "job-missing", ["submit"], r"the following arguments are required: job"),
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
    # ---- no Slurm reachable: one line saying which Slurm was tried and how to bring one up
    Case("cli", "submit-no-cluster", ["submit", "fixture"],
         r"no Slurm reachable: tried SLURM_CONF=.*no-slurm.conf, and that file does not exist; start the embedded "
         r"cluster with `launch cluster up`"),
    Case("cli", "follow-no-cluster", ["logs", "-f", "1"], r"no Slurm reachable: tried SLURM_CONF=", job_record=True),
    Case("cli", "cancel-no-cluster", ["cancel", "1"], r"no Slurm reachable", job_record=True),
    Case("cli", "embedded-half-down", ["submit", "fixture"],
         r"the embedded cluster in .* is partly down \(not running: mariadb, munged, slurmdbd, slurmctld, slurmd\); "
         r"bring it back with `launch cluster up`", embedded_half_down=True),
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
]


