"""`launch submit JOB`: a bundled job through submitit into whichever Slurm the environment names.

Before anything is queued: the spec and every value are checked, the entrypoint's own parser
reads the command line (so `--arg bogus=1` is a one-line error here, not in the job's log), and
the request is compared with the cluster's nodes (a request no node can ever satisfy is refused
rather than left PENDING forever). `--dry-run` does the same checks and prints the script.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import re
import shlex
import sys
from pathlib import Path

from launch import feasibility, registry, values
from launch.cluster.embedded import real_gpu_nodes
from launch.errors import LaunchError
from launch.executor import SlurmOptions, make_executor, sbatch_failure, sbatch_script
from launch.fsutil import foreign_ancestor, launch_home, private_files
from launch.jobs_cli import follow, next_line
from launch.jobspec import JobSpec, ResolvedJob, find_spec, known_jobs
from launch.runner import EntrypointRun, entry_gpu_work, entry_inputs, entry_parser, entry_task_check
from launch.slurmenv import (
    TERMINAL_STATES,
    describe_slurm,
    is_embedded,
    job_states,
    require_cluster,
    slurm_env,
)
from toolkit import outcome, runlock


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.usage = "launch submit JOB [--preset P] [resources] [Slurm options] [options] [-- ARGS]"
    p.epilog = (f"jobs: {', '.join(known_jobs())}; `launch submit JOB --list-presets` lists a job's presets "
                "with their descriptions and resources. ARGS after a bare `--` reach the entrypoint verbatim "
                "(e.g. `launch submit stage1 --preset tiny -- --lr 1e-3`).")
    p.add_argument("job", help=f"job name ({', '.join(known_jobs())}) or path to a job spec .yaml")
    p.add_argument("--preset", help="preset from the job spec (see --list-presets)")
    p.add_argument("--list-presets", action="store_true", help="list the job's presets with their resources; submit nothing")
    r = p.add_argument_group("resources (override the preset's)")
    r.add_argument("--nodes", type=values.int_range(1, values.MAX_NODES))
    r.add_argument("--gpus-per-node", type=values.int_range(0, values.MAX_GPUS_PER_NODE))
    r.add_argument("--cpus-per-task", type=values.int_range(1, values.MAX_CPUS_PER_TASK))
    r.add_argument("--mem-gb", type=float, help="memory per node in GB")
    r.add_argument("--time", type=values.slurm_time,
                   help="wall-clock limit in Slurm's grammar: MINUTES, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS")
    r.add_argument("--partition", type=values.slurm_value("--partition"))
    s = p.add_argument_group("Slurm options (passed to sbatch)")
    s.add_argument("--name", type=values.job_name, help="Slurm job name (default: the spec's name)")
    s.add_argument("--account", type=values.slurm_value("--account"))
    s.add_argument("--qos", type=values.slurm_value("--qos"))
    s.add_argument("--constraint", type=values.slurm_value("--constraint"))
    s.add_argument("--exclude", type=values.slurm_value("--exclude"), metavar="NODES")
    s.add_argument("--dependency", type=values.dependency, metavar="TYPE:JOBID",
                   help="e.g. afterok:1234 (start after job 1234 completed)")
    s.add_argument("--env", type=values.env_pair, action="append", default=[], metavar="KEY=VALUE",
                   help="set an environment variable in the job (repeatable)")
    s.add_argument("--allow-loader-env", action="store_true",
                   help="let --env set variables that choose which code the job runs: the loader's (LD_PRELOAD, "
                   "LD_LIBRARY_PATH, LD_AUDIT, ...), shell start-up hooks (BASH_ENV, ENV, ...) and search paths "
                   "(PATH, PYTHONPATH, PYTHONHOME, PYTHONSTARTUP, ...); the job then runs whatever they point to")
    p.add_argument("--scratch", type=values.scratch_value,
                   help="node-local scratch for caches; may expand $SLURM_JOB_ID, $LAUNCH_NODE_SCRATCH, $USER "
                   "(default: per job under $LAUNCH_NODE_SCRATCH, else /tmp)")
    p.add_argument("--arg", action="append", default=[], metavar="KEY=VALUE",
                   help="override an entrypoint argument (repeatable); checked with the entrypoint's parser")
    p.add_argument("--runs-dir", help="where job folders go (default $LAUNCH_HOME/runs)")
    p.add_argument("--no-preflight", action="store_true", help="skip the doctor's fast checks in the job")
    p.add_argument("--dry-run", action="store_true", help="check everything, print the sbatch script; submit nothing")
    out = p.add_mutually_exclusive_group()
    out.add_argument("--follow", "-f", action="store_true", help="stream the main task's log until the job ends")
    out.add_argument("--json", action="store_true", help="print the submitted job as JSON")
    out.add_argument("--parsable", action="store_true", help="print only the job id")
    p.add_argument("--verbose", "-v", action="store_true",
                   help="with --follow: every line of the log (submitit's INFO lines, progress bars, the whole preflight)")
    # Arguments after a bare `--` reach the entrypoint verbatim (split off in launch.cli).
    p.set_defaults(extra=[])


def _apply_overrides(job: ResolvedJob, args: argparse.Namespace) -> None:
    r = job.resources
    for attr in ("nodes", "gpus_per_node", "cpus_per_task", "partition", "time"):
        value = getattr(args, attr)
        if value is not None:
            setattr(r, attr, value)
    if args.mem_gb is not None:
        try:
            r.mem_gb = values.check_mem_gb(args.mem_gb)
        except ValueError as exc:
            raise LaunchError(f"--mem-gb: {exc}") from None
    given: dict[str, str] = {}
    for item in args.arg:
        key, sep, value = item.partition("=")
        if not sep or not values.SHELL_NAME_RE.fullmatch(key.replace("-", "_")):
            raise LaunchError(f"--arg {item!r}: expected KEY=VALUE with KEY an argument name (e.g. --arg steps=10)")
        if "\0" in value:
            raise LaunchError(f"--arg {item!r}: the value contains a NUL byte, which no command line can carry")
        key = key.replace("-", "_")
        value = job_output(value, f"--arg {key}")
        if given.get(key, value) != value:
            raise LaunchError(f"--arg {key} given twice ({given[key]!r}, then {value!r}); give it once")
        given[key] = job.args[key] = value
    for item in args.extra:
        if "\0" in item:
            raise LaunchError(f"argument {item!r} after --: contains a NUL byte, which no command line can carry")


def job_output(value: str, what: str) -> str:
    """`job:<id>`: the run folder of a job submitted from here (an extraction's shards for DFlash),
    `job:<id>/<path>` a file in it (a regen's `data.jsonl` for extraction); any other value as it is."""
    if not value.startswith("job:"):
        return value
    job_id, _, inside = value.removeprefix("job:").partition("/")
    try:
        rec = registry.find(job_id)
    except LaunchError as exc:
        raise LaunchError(f"{what}={value}: {exc}") from None
    if ".." in Path(inside).parts or inside.startswith("/"):  # job:1//etc would be /etc
        raise LaunchError(f"{what}={value}: the path after job:<id>/ stays inside that job's run folder (no '..', "
                          "no leading '/')")
    return str(rec.run_folder / inside) if inside else str(rec.run_folder)


def _check_option_combinations(args: argparse.Namespace) -> None:
    """Options that would be silently ignored together are errors."""
    if args.preset is not None and not args.preset.strip():
        raise LaunchError("--preset is empty; name one (`launch submit JOB --list-presets`) or leave it out for the default")
    env: dict[str, str] = {}
    for key, value in args.env:
        if env.get(key, value) != value:
            raise LaunchError(f"--env {key} given twice ({env[key]!r}, then {value!r}); give it once")
        env[key] = value
        if not args.allow_loader_env:
            try:
                values.check_env_not_hijack(key, "add --allow-loader-env if you mean it")
            except ValueError as exc:
                raise LaunchError(f"--env {key}: {exc}") from None
    if args.allow_loader_env and not any(values.is_hijack_var(k) for k in env):
        raise LaunchError("--allow-loader-env allows --env to set loader, shell start-up or search-path variables, "
                          "and no --env sets one; drop it")
    printed = [f for f, on in (("--follow", args.follow), ("--json", args.json), ("--parsable", args.parsable)) if on]
    if args.verbose and not args.follow:
        raise LaunchError("--verbose is about what --follow shows; add --follow (or use `launch logs JOB --verbose`)")
    if args.dry_run and printed:
        raise LaunchError(f"{printed[0]} is about a submitted job, and --dry-run submits none; drop one of them")
    if args.list_presets:
        ignored = [f"--{k.replace('_', '-')}" for k in ("preset", "nodes", "gpus_per_node", "cpus_per_task", "mem_gb",
                                                        "time", "partition", "name", "scratch", "runs_dir")
                   if getattr(args, k) is not None]
        ignored += [f for f, on in (("--arg", args.arg), ("--env", args.env), ("--dry-run", args.dry_run),
                                    ("--follow", args.follow), ("--parsable", args.parsable), ("--", args.extra)) if on]
        if ignored:
            raise LaunchError(f"--list-presets submits nothing, so {', '.join(ignored)} would do nothing; "
                              "use it alone (or with --json)")


def job_folder(args: argparse.Namespace, spec: JobSpec) -> Path:
    """<runs dir>/<job name>: its path reaches the #SBATCH --output/--error lines, where a
    newline would start a new #SBATCH line and Slurm expands '%' patterns."""
    if args.runs_dir is not None and not args.runs_dir.strip():
        raise LaunchError("--runs-dir is empty; give a directory (default $LAUNCH_HOME/runs)")
    runs = Path(args.runs_dir or launch_home() / "runs").expanduser().resolve()
    virtual = next((top for top in ("/proc", "/sys", "/dev") if runs == Path(top) or Path(top) in runs.parents), None)
    if virtual:
        raise LaunchError(f"runs directory {runs} is under {virtual}, a kernel file system that holds no job folders; "
                          "choose another --runs-dir or LAUNCH_HOME")
    bad = sorted({c for c in str(runs) if ord(c) < 32 or c in "%\x7f"})
    if bad:
        raise LaunchError(f"runs directory {str(runs)!r} has {', '.join(map(repr, bad))}: Slurm's --output/--error "
                          "lines cannot carry it; choose another --runs-dir or LAUNCH_HOME")
    for path in (runs, runs / spec.name):
        if path.exists() and not path.is_dir():
            raise LaunchError(f"runs directory {path} exists and is not a directory; choose another --runs-dir")
    # The job's pickled call is unpickled in the job, as the user: a folder another uid could
    # swap before the job starts would run that uid's pickle as the user.
    foreign = foreign_ancestor(runs / spec.name)
    if foreign:
        raise LaunchError(f"runs directory {runs}: {foreign}, who could swap a job folder before the job starts; "
                          "choose a --runs-dir only you can write (default $LAUNCH_HOME/runs)")
    return runs / spec.name


def check_entrypoint_args(spec: JobSpec, argv: list[str], tasks: int | None = None) -> object | None:
    """Parse the job's command line with the entrypoint's own `parse_args(argv)`, here and now:
    no model is built, nothing is queued. An entrypoint without one, or one that cannot be
    imported here (a login node without the `train` extra's torch), is checked in the job."""
    try:
        parse = entry_parser(spec.entrypoint)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (spec.entrypoint + ".").startswith(exc.name + "."):
            raise LaunchError(f"{spec.source}: key 'entrypoint': there is no module {spec.entrypoint!r} here "
                              f"({exc}); nothing submitted") from None
        print(f"launch submit: note: arguments not checked here ({spec.entrypoint} does not import: {exc}); "
              "the job checks them", file=sys.stderr)
        return None
    except ImportError as exc:
        print(f"launch submit: note: arguments not checked here ({spec.entrypoint} does not import: {exc}); "
              "the job checks them", file=sys.stderr)
        return None
    if parse is None:
        return None
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parsed = parse(list(argv))
            check_tasks = entry_task_check(spec.entrypoint) if tasks is not None else None
            if check_tasks is not None:
                check_tasks(parsed, tasks)
    except SystemExit as exc:  # an argparse parser: its message went to stderr
        if exc.code in (0, None):  # --help in the passthrough: nothing to submit
            raise LaunchError(f"the arguments for {spec.name} ask for help (`python -m {spec.entrypoint} --help`)") from None
        lines = [ln.strip() for ln in err.getvalue().splitlines() if ln.strip()]
        said = next((ln.split(": error: ", 1)[1] for ln in reversed(lines) if ": error: " in ln), lines[-1] if lines else "")
        said = said.replace("unrecognized arguments:", "unknown argument(s):").replace("argument --", "--")
        raise LaunchError(f"{spec.name}: {in_arg_terms(said, argv)} (its arguments: `python -m {spec.entrypoint} "
                          "--help`, each given as --arg KEY=VALUE); nothing submitted") from None
    except (ValueError, TypeError, OSError) as exc:  # a config check (ConfigError is a ValueError)
        said = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        said = said.replace("unrecognized arguments:", "unknown argument(s):")
        raise LaunchError(f"{spec.name}: {in_arg_terms(said, argv)}; nothing submitted") from None
    return parsed


_FLAG_AND_NEXT = re.compile(r"(?<![\w-])--([a-z][a-z0-9]*(?:-[a-z0-9]+)*)( \S+)?")


def in_arg_terms(text: str, argv: list[str]) -> str:
    """A trainer's message names its own flags (`--data-dir X`); through `launch submit` the user
    gave them as `--arg data_dir=X`, so say it that way. `argv` is the trainer's command line that
    the --arg values became: a flag followed by the value given for it becomes KEY=VALUE."""
    given = {tok: argv[i + 1] for i, tok in enumerate(argv[:-1]) if tok.startswith("--")}

    def as_arg(m: re.Match[str]) -> str:
        key, rest = m.group(1).replace("-", "_"), m.group(2) or ""
        if key == "arg":  # already said as launch's own flag
            return m.group(0)
        value = given.get(f"--{m.group(1)}")
        if rest.startswith(" <"):  # a placeholder: --init-from <dir>
            return f"--arg {key}={rest[1:]}"
        if value and rest[1:].startswith(value) and rest[1 + len(value):] in ("", ":", ",", ";", ".", ")"):
            return f"--arg {key}={value}{rest[1 + len(value):]}"
        return f"--arg {key}{rest}"

    return _FLAG_AND_NEXT.sub(as_arg, text)


def check_input_paths(spec: JobSpec, parsed: object | None, embedded: bool) -> None:
    """The files a job reads at its start (the entrypoint's optional `input_paths(parsed)`: flag,
    path, check), before anything is queued: a path that exists here is checked (a data dir's
    manifests); one that does not is refused on the embedded cluster (its nodes are this machine)
    and named in a warning elsewhere (it may exist only on the nodes)."""
    try:
        paths = entry_inputs(spec.entrypoint) if parsed is not None else None
    except ImportError:
        paths = None
    for flag, path, check in paths(parsed) if paths is not None else []:
        if os.path.exists(path):
            try:
                if check is not None:
                    check(path)
            except (ValueError, RuntimeError, OSError) as exc:
                said = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
                said = in_arg_terms(said.removeprefix(f"{flag} {path}: "), [])
                raise LaunchError(f"{spec.name}: {in_arg_terms(f'{flag} {path}', [flag, path])}: {said}; "
                                  "nothing submitted") from None
        elif embedded:
            raise LaunchError(f"{spec.name}: {in_arg_terms(f'{flag} {path}', [flag, path])} does not exist, and the "
                              "embedded cluster's jobs run on this machine; nothing submitted")
        else:
            print(f"launch submit: warning: {in_arg_terms(f'{flag} {path}', [flag, path])} does not exist on this "
                  "machine; the job reads it on its node(s) and stops at its start if it is not there", file=sys.stderr)


def stand_in_refusal(spec: JobSpec, job: ResolvedJob, parsed: object | None, real_gpus: bool) -> str | None:
    """GPU work (the entrypoint's `gpu_work`) on a machine without the NVIDIA driver, whose embedded
    cluster's GPUs are stand-ins: refused with that reason, whatever the cluster's size (a bigger
    `launch cluster up --gpus N` would only make more stand-ins)."""
    if real_gpus or job.resources.gpus_per_node == 0 or parsed is None:
        return None
    try:
        work = entry_gpu_work(spec.entrypoint)
    except ImportError:
        return None
    what = work(parsed) if work is not None else None
    if what is None:
        return None
    preset = f"--preset {job.preset}" if job.preset else spec.name
    return (f"{preset} needs real GPUs ({what}), and this machine has no NVIDIA driver: the embedded cluster's "
            "GPUs are stand-in devices that model Slurm's allocation only; here, use a CPU preset "
            f"(`launch submit {spec.name} --list-presets`: tiny), or submit to a GPU cluster")


def too_big_advice(spec: JobSpec, job: ResolvedJob, cluster: feasibility.Cluster, env_extra: dict[str, str]) -> str:
    """What to do about a request no node can run. A job whose arguments fix its task count
    (DFlash online k-1: check_tasks) cannot ask for fewer GPUs; the embedded cluster can be
    restarted bigger (its GPUs on CPU are only a task count)."""
    try:
        # A check_tasks may only vet the arguments (stage-1's image tasks); the task count is fixed
        # only where the entrypoint says so (DFlash's k-1 topology).
        fixed = bool(getattr(entry_task_check(spec.entrypoint), "fixes_task_count", False))
    except ImportError:
        fixed = False
    hint = feasibility.embedded_up_hint(job.resources, cluster) if is_embedded(env_extra) else None
    if fixed:
        advice = (f"its arguments fix the task count at {job.resources.total_tasks}, so fewer GPUs will not do; "
                  f"pick a smaller preset (`launch submit {spec.name} --list-presets`)")
    else:
        advice = feasibility.ASK_LESS
    return f"{advice}, or give the embedded cluster that much: `{hint}`" if hint else advice


def printable(text: str) -> str:
    """A spec's text for a terminal: control characters (escape sequences that move the cursor,
    retitle the window or clear the screen) shown escaped, as repr does, never sent."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def list_presets(spec: JobSpec, as_json: bool) -> int:
    rows = []
    for name in spec.presets:
        r = spec.resolve(name).resources
        rows.append({"preset": name, "default": name == spec.default_preset, "description": spec.presets[name].description,
                     "nodes": r.nodes, "gpus_per_node": r.gpus_per_node, "cpus_per_task": r.cpus_per_task,
                     "time": str(r.time)})
    if as_json:
        print(json.dumps({"job": spec.name, "presets": rows}, indent=2))
        return 0
    print(f"presets of {spec.name} ({printable(str(spec.source))}):")
    for row in rows:
        mark = "*" if row["default"] else " "
        print(f" {mark}{printable(row['preset']):<14} {row['nodes']}x{row['gpus_per_node']} GPU, "
              f"{row['cpus_per_task']} CPU/task, {row['time']:<9} {printable(row['description'] or '')}")
    print("(* the default)")
    return 0


def run(args: argparse.Namespace) -> int:
    _check_option_combinations(args)
    spec = find_spec(args.job)
    if args.list_presets:
        return list_presets(spec, args.json)
    job = spec.resolve(args.preset)
    _apply_overrides(job, args)
    argv = job.argv(args.extra)
    return submit_job(args, spec, job, argv)


def submit_job(args: argparse.Namespace, spec: JobSpec, job: ResolvedJob, argv: list[str],
               run_dir: Path | None = None, resumes: str | None = None) -> int:
    """Check, queue, record and report one job (`launch submit`, and `launch resume` with the
    run folder it continues)."""
    parsed = check_entrypoint_args(spec, argv, job.resources.total_tasks)
    folder = job_folder(args, spec)
    check_run_folder_owner(run_dir or out_of(argv))
    check_run_folder_kind(run_dir or out_of(argv), spec)
    scratch = args.scratch or spec.scratch
    options = SlurmOptions(name=args.name, account=args.account, qos=args.qos, constraint=args.constraint,
                           exclude=args.exclude, dependency=args.dependency, env=dict(args.env))
    executor = make_executor(job, folder, scratch, options)
    what = f"{spec.name} (preset {job.preset})" if job.preset else spec.name
    if args.dry_run:
        embedded = is_embedded(slurm_env())
    else:
        env_extra = require_cluster()
        embedded = is_embedded(env_extra)
    check_input_paths(spec, parsed, embedded)
    refusal = stand_in_refusal(spec, job, parsed, real_gpus=bool(real_gpu_nodes())) if embedded else None
    if refusal:
        raise LaunchError(refusal)
    if args.dry_run:
        return dry_run(executor, spec, job, argv, what)
    run_dir = run_dir or out_of(argv)
    if run_dir is not None:
        check_run_folder_free(run_dir, env_extra)
    if args.dependency:
        check_dependency_jobs(args.dependency, env_extra)
    cluster = feasibility.query_cluster(env_extra)
    problem = feasibility.check(job.resources, cluster, what, too_big_advice(spec, job, cluster, env_extra))
    if problem:
        raise LaunchError(problem)
    os.environ.update(env_extra)  # submitit calls sbatch with our environment
    # The in-job preflight finds the spec (its lock) by name when it is a known job, else by path.
    spec_ref = spec.name if known_jobs().get(spec.name) == spec.source else str(spec.source.resolve())
    meta = {"job": spec.name, "preset": job.preset, "spec": str(spec.source.resolve()),
            "resources": dataclasses.asdict(job.resources)}
    runner = EntrypointRun(spec.entrypoint, argv, spec_ref, preflight=not args.no_preflight, main_task=job.main_task,
                           meta=meta)
    registry.check_writable()  # a job queued but not recorded could not be followed from here
    with private_files():
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise LaunchError(f"cannot create the job folder {folder} ({exc.strerror}); choose another --runs-dir") from None
        try:
            submitted = executor.submit(runner)
        except Exception as exc:  # submitit wraps sbatch failures in several exception types
            raise LaunchError(f"sbatch refused the job: {sbatch_failure(exc)}") from None
    job_id = str(submitted.job_id)
    rec = registry.JobRecord(job_id=job_id, name=spec.name, preset=job.preset, folder=str(folder / job_id),
                             submitted_at=registry.now(), slurm_conf=env_extra.get("SLURM_CONF"), argv=argv,
                             tasks=job.resources.total_tasks, main_task=job.main_task,
                             run_dir=str(run_dir) if run_dir else None, resumes=resumes,
                             spec=str(spec.source.resolve()))
    registry.record(rec)
    if args.parsable:
        print(job_id)
        return 0
    if args.json:
        print(json.dumps({"job_id": job_id, "name": spec.name, "preset": job.preset, "folder": rec.folder,
                          "log": str(rec.stdout), "tasks": rec.tasks, "main_task": rec.main_task,
                          "slurm_conf": rec.slurm_conf, "argv": argv, "run_dir": str(rec.run_folder),
                          "resumes": resumes}))
        return 0
    print(f"submitted {what} as job {job_id}" + (f", continuing job {resumes}'s run" if resumes else ""))
    if run_dir:
        print(f"  run:  {run_dir}")
    print(f"  logs: {rec.stdout}")
    if args.follow:
        try:
            return follow(rec, sys.stdout, from_start=True, verbose=args.verbose)
        except KeyboardInterrupt:
            print(f"launch {getattr(args, 'verb', 'submit')}: stopped following; job {job_id} keeps running (`launch logs -f {job_id}`, "
                  f"`launch cancel {job_id}`)", file=sys.stderr)
            return 130
    print(f"next: {next_line(rec, completed=None)}")
    return 0


def out_of(argv: list[str]) -> Path | None:
    """The run folder a command line names with `--out` (the last one wins, as in argparse),
    made absolute here: the job starts in this directory."""
    out = None
    for i, item in enumerate(argv):
        if item == "--out" and i + 1 < len(argv):
            out = argv[i + 1]
        elif item.startswith("--out="):
            out = item.partition("=")[2]
    return Path(os.path.abspath(out)) if out else None


def check_run_folder_owner(run_dir: Path | None) -> None:
    """A run folder (--arg out=) another local user could swap: the trainer would resume from
    that user's checkpoint (and `launch resume` after it), so it is refused as --runs-dir is."""
    foreign = foreign_ancestor(run_dir) if run_dir is not None else None
    if foreign:
        raise LaunchError(f"run folder {run_dir}: {foreign}, who could swap its checkpoints before the job reads "
                          "them; choose an --arg out= only you can write; nothing submitted")


def check_run_folder_kind(run_dir: Path | None, spec: JobSpec) -> None:
    """A run folder belongs to one trainer: another's job there would replace its config,
    summary and outcome and mix its metrics (toolkit.outcome.run_kind)."""
    kind = outcome.run_kind(run_dir) if run_dir is not None else None
    mine = outcome.kind_of_entrypoint(spec.entrypoint)
    if kind is not None and kind != mine:
        raise LaunchError(f"run folder {run_dir} holds a {kind} run; {spec.name} ({spec.entrypoint}) would replace its "
                          "config, summary and outcome: give another --arg out=; nothing submitted")


def check_dependency_jobs(dependency: str, env_extra: dict[str, str]) -> None:
    """Every job a --dependency names exists: Slurm treats an unknown job id as satisfied, and the
    job would start at once instead of after it."""
    ids = sorted({j for part in re.split(r"[,?]", dependency) for j in part.split(":")[1:] if j})
    unknown = [j for j, st in job_states([j.split("+")[0] for j in ids], env_extra).items()
               if st.get("state") == "UNKNOWN" and not st.get("unreachable")]
    if unknown:
        raise LaunchError(f"--dependency {dependency}: Slurm knows no job {', '.join(unknown)} (a dependency on it "
                          "would be satisfied at once, and the job start now); nothing submitted")


def check_run_folder_free(run_dir: Path, env_extra: dict[str, str]) -> None:
    """One trainer per run folder: refused while a trainer holds its lock (toolkit.runlock), or
    while a job recorded here for the same folder is still queued or running (its trainer may be
    on another node, or not started yet)."""
    who = runlock.holder(run_dir)
    if who:
        raise LaunchError(f"run folder {run_dir} is in use by {who}: one trainer writes a run folder at a time; "
                          "wait for it to end or cancel it; nothing submitted")
    target = run_dir.resolve()
    same = [r for r in registry.all_jobs() if r.kind == "job" and
            (r.run_folder.resolve() == target or (out_of(r.argv) or Path("/nonexistent")).resolve() == target)]
    if not same:
        return
    states = job_states([r.job_id for r in same], {**env_extra, **same[-1].slurm_env()})
    for rec in same:
        state = states.get(rec.job_id, {}).get("state", "UNKNOWN")
        if state not in TERMINAL_STATES and state != "UNKNOWN":
            raise LaunchError(f"run folder {run_dir} is in use by job {rec.job_id} ({state}): one trainer writes a "
                              f"run folder at a time; wait for it to end or `launch cancel {rec.job_id}`; "
                              "nothing submitted")


def dry_run(executor, spec: JobSpec, job: ResolvedJob, argv: list[str], what: str) -> int:  # noqa: ANN001
    print("# --- sbatch script (dry run: nothing submitted) ---")
    print(sbatch_script(executor).replace("%j", "<jobid>"))
    print("# --- job ---")
    print(f"# entrypoint: python -m {spec.entrypoint} {shlex.join(argv)}")
    print(f"# preset:     {job.preset}")
    print(f"# tasks:      {job.resources.total_tasks} (logs show task {job.main_task} by default)")
    try:
        env_extra = slurm_env()
        cluster = feasibility.query_cluster(require_cluster(env_extra))
    except LaunchError as exc:
        print(f"# slurm:      feasibility not checked: {exc}")
        return 0
    print(f"# slurm:      {describe_slurm(env_extra)}")
    problem = feasibility.check(job.resources, cluster, what, too_big_advice(spec, job, cluster, env_extra))
    if problem:
        raise LaunchError(problem)
    print("# feasible:   yes, some nodes can run it")
    return 0
