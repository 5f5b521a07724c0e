"""Checks for the values that reach Slurm and the sbatch script: times, sizes, names, option
values, environment keys and the scratch path.

A job spec or a command-line value becomes text in a shell script (the export lines) or in an
`#SBATCH` line. Everything is quoted on the way out, and on the way in a value is held to what
it can mean: a Slurm time in Slurm's own grammar, a job name that is a plain identifier, an
environment key that is a shell name, a scratch path that expands only the variables this
module documents. Each check raises `ValueError` with a message that names the value; callers
add where it came from (the spec file and key, or the option).
"""

from __future__ import annotations

import argparse
import re
import shlex
from collections.abc import Callable

# Upper bounds that no real request reaches; they turn `--nodes 10**20`-style typos into
# errors before Slurm or submitit see them.
MAX_NODES = 10_000
MAX_GPUS_PER_NODE = 256
MAX_CPUS_PER_TASK = 100_000
MIN_MEM_GB = 0.125  # 128 MB: the interpreter alone needs more than that
MAX_MEM_GB = 100_000
MAX_TIME_MIN = 365 * 24 * 60

NAME_RE = re.compile(r"[A-Za-z][A-Za-z0-9_-]{0,63}")
SHELL_NAME_RE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Partition, account, QOS, constraint and node-list values: Slurm's own punctuation, never
# whitespace, quotes or shell metacharacters (a newline would start a new #SBATCH line).
SLURM_VALUE_RE = re.compile(r"[A-Za-z0-9_.,:@+=%\-\[\]&|*()!]{1,256}")
_DEP_TYPES = "after|afterany|afterok|afternotok|aftercorr|afterburstbuffer"
_DEP_ONE = rf"(?:singleton|(?:{_DEP_TYPES})(?::\d+(?:\+\d+)?)+)"
DEPENDENCY_RE = re.compile(rf"{_DEP_ONE}(?:[,?]{_DEP_ONE})*", re.ASCII)
# Variables the sbatch script sets from the launcher's own options, and those Slurm sets for the
# job and each task (srun, submitit and the trainers' guard read them to find their allocation
# and rank). A spec's env or --env may set neither; Slurm's input variables (SLURM_CPU_BIND ...)
# stay allowed.
LAUNCHER_VARS = {
    "LAUNCH_JOB_DIR": "where the job writes: use --runs-dir",
    "LAUNCH_JOB_NAME": "the spec's name: use --name for Slurm's",
    "LAUNCH_SCRATCH": "use --scratch or the spec's scratch",
    "LAUNCH_NODE_SCRATCH": "the node's own setting, read before the job's env applies: use --scratch",
    "LAUNCH_SRUN_CONF": "the embedded cluster's own setting for srun",
    "LAUNCH_RENDEZVOUS_TOKEN": "the job's own secret for its rendezvous, made in the job",
}
SLURM_JOB_VARS = frozenset({
    "SLURM_CONF", "SLURM_JOB_ID", "SLURM_JOBID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "SLURM_STEP_ID",
    "SLURM_STEPID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS", "SLURM_NPROCS",
    "SLURM_NNODES", "SLURM_JOB_NUM_NODES", "SLURM_NODELIST", "SLURM_JOB_NODELIST", "SLURM_STEP_NODELIST",
    "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_JOB_GPUS", "SLURM_STEP_GPUS", "SLURM_GPUS_ON_NODE",
    "SLURM_SUBMIT_DIR", "SLURM_JOB_NAME",
})
# Variables that choose which code runs: the dynamic loader's (LD_PRELOAD, LD_AUDIT, ...), the
# shell's start-up and parsing hooks, and the search paths of the programs the batch script
# starts (srun, the interpreter). Exported before them, any of these runs code of the setter's
# choosing as the job's user, so a spec may not set them, and --env only with
# --allow-loader-env. (srun and python are also called by absolute path.)
HIJACK_VARS = frozenset({
    "BASH_ENV", "ENV", "SHELLOPTS", "BASHOPTS", "IFS", "PS4", "PROMPT_COMMAND", "CDPATH", "GLOBIGNORE",
    "PATH", "PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "PYTHONUSERBASE", "PYTHONEXECUTABLE",
    "PYTHONPLATLIBDIR", "PYTHONINSPECT", "PYTHONBREAKPOINT", "GCONV_PATH", "GLIBC_TUNABLES", "LOCPATH",
    "NLSPATH", "HOSTALIASES", "RESOLV_HOST_CONF", "MALLOC_CHECK_", "TMPDIR_HOOK", "PERL5LIB", "PERL5OPT",
    "NODE_OPTIONS", "RUBYOPT", "RUBYLIB",
    # srun runs these as the job's user around every task or step
    "SLURM_TASK_PROLOG", "SLURM_TASK_EPILOG", "SLURM_PROLOG", "SLURM_EPILOG",
    # a shared object OpenSSL loads (any TLS client in the job), a module Python's warnings import
    "OPENSSL_CONF", "OPENSSL_ENGINES", "OPENSSL_MODULES", "PYTHONWARNINGS",
    # the compiler Triton, torch's extensions and pip builds run
    "CC", "CXX", "CPP", "LDSHARED",
})
HIJACK_PREFIXES = ("LD_", "DYLD_", "BASH_FUNC_")


def is_hijack_var(key: str) -> bool:
    return key in HIJACK_VARS or key.startswith(HIJACK_PREFIXES)


def check_env_not_hijack(key: str, how: str) -> str:
    """Refuse a variable that would choose the code the job runs (HIJACK_VARS); `how` says
    how it could still be set, when it can."""
    if is_hijack_var(key):
        raise ValueError(f"environment key {key} chooses which code the job runs (loader, shell start-up or "
                         f"search path): {how}")
    return key


# The variables a scratch path may expand on the node, and what a ${VAR:-default} may hold.
SCRATCH_VARS = ("SLURM_JOB_ID", "LAUNCH_NODE_SCRATCH", "USER")
_SAFE_DEFAULT_RE = re.compile(r"[A-Za-z0-9_./+,@%=-]*")
_SCRATCH_VAR_RE = re.compile(r"\$(?:\{(?P<braced>[^}]*)\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")


def parse_slurm_time(value: str | int) -> int:
    """Slurm's time grammar to whole minutes (rounded up), as sbatch --time reads it:
    MINUTES, MINUTES:SECONDS, HOURS:MINUTES:SECONDS, DAYS-HOURS, DAYS-HOURS:MINUTES,
    DAYS-HOURS:MINUTES:SECONDS. Fields after the first are bounded (seconds and minutes < 60,
    hours < 24 after days), the total is between 1 second and 365 days."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"time {value!r} is not a Slurm time")
    text = str(value).strip()
    grammar = "MINUTES, MM:SS, HH:MM:SS, D-HH, D-HH:MM or D-HH:MM:SS"
    m = re.fullmatch(r"(?:(?P<days>\d{1,3})-(?P<rest_d>\d{1,2}(?::\d{1,2}){0,2})|(?P<rest>\d{1,7}(?::\d{1,2}){0,2}))", text,
                     re.ASCII)
    if not m:
        raise ValueError(f"time '{text}' is not a Slurm time ({grammar})")
    if m["days"] is not None:
        fields = [int(x) for x in m["rest_d"].split(":")]
        hours, minutes, seconds = (fields + [0, 0])[:3]
        if hours > 23 or minutes > 59 or seconds > 59:
            raise ValueError(f"time '{text}': after D- the fields are HH < 24, MM < 60, SS < 60")
        total = int(m["days"]) * 86400 + hours * 3600 + minutes * 60 + seconds
    else:
        fields = [int(x) for x in m["rest"].split(":")]
        if len(fields) == 1:
            total = fields[0] * 60
        elif len(fields) == 2:  # Slurm reads A:B as minutes:seconds
            if fields[1] > 59:
                raise ValueError(f"time '{text}': MM:SS needs SS < 60 (Slurm reads A:B as minutes:seconds)")
            total = fields[0] * 60 + fields[1]
        else:
            if fields[1] > 59 or fields[2] > 59:
                raise ValueError(f"time '{text}': HH:MM:SS needs MM < 60 and SS < 60")
            total = fields[0] * 3600 + fields[1] * 60 + fields[2]
    if total <= 0:
        raise ValueError(f"time '{text}' must be positive")
    minutes_total = -(-total // 60)
    if minutes_total > MAX_TIME_MIN:
        raise ValueError(f"time '{text}' is over {MAX_TIME_MIN // 1440} days")
    return minutes_total


def check_bounded_int(value: object, low: int, high: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{what} must be an integer, got {value!r}")
    if not low <= value <= high:
        raise ValueError(f"{what} must be between {low} and {high}, got {value}")
    return value


def check_mem_gb(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise ValueError(f"mem_gb must be a number, got {value!r}")
    if not 0 < value <= MAX_MEM_GB:
        raise ValueError(f"mem_gb must be > 0 and <= {MAX_MEM_GB}, got {value}")
    if value < MIN_MEM_GB:
        raise ValueError(f"mem_gb {value:g} is below {MIN_MEM_GB} ({round(MIN_MEM_GB * 1024)} MB): no job starts in "
                         "less (sbatch would be asked for --mem=1M); leave it out for the node's default")
    return float(value)


def check_name(value: str, what: str = "name") -> str:
    if not isinstance(value, str) or not NAME_RE.fullmatch(value):
        raise ValueError(f"{what} {value!r} is not a plain identifier (a letter, then letters, digits, '_' "
                         "or '-'; at most 64)")
    return value


def check_env_key(key: str) -> str:
    if not isinstance(key, str) or not SHELL_NAME_RE.fullmatch(key):
        raise ValueError(f"environment key {key!r} is not a shell variable name ([A-Za-z_][A-Za-z0-9_]*)")
    if key in LAUNCHER_VARS:
        raise ValueError(f"environment key {key} is the launcher's own ({LAUNCHER_VARS[key]})")
    if key in SLURM_JOB_VARS:
        raise ValueError(f"environment key {key} is set by Slurm for each job and task; setting it would point srun, "
                         "submitit or the trainers at another allocation or rank")
    return key


def check_env_value(key: str, value: str) -> str:
    if "\0" in value:
        raise ValueError(f"environment value of {key} contains a NUL byte")
    return value


def check_slurm_value(value: str, what: str) -> str:
    if not isinstance(value, str) or not SLURM_VALUE_RE.fullmatch(value):
        raise ValueError(f"{what} {value!r} has characters Slurm does not use there (whitespace, quotes, "
                         "'$', ';' ...) or is empty")
    return value


def check_dependency(value: str) -> str:
    if not DEPENDENCY_RE.fullmatch(value or ""):
        raise ValueError(f"dependency {value!r} is not TYPE:JOBID[:JOBID...] (TYPE: {_DEP_TYPES.replace('|', ', ')}) "
                         "or singleton")
    return value


def scratch_shell(value: str) -> str:
    """The scratch path as one shell word: literal text quoted, and only $SLURM_JOB_ID,
    $LAUNCH_NODE_SCRATCH and $USER expanded (as $V, ${V} or ${V:-literal default})."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError("scratch must be a non-empty path")
    if any(ord(c) < 32 or c in "`\\" for c in value):
        raise ValueError(f"scratch {value!r} contains a control character, '`' or '\\'")
    if value.startswith("~"):
        raise ValueError(f"scratch {value!r}: '~' is not expanded; use an absolute path or $USER")
    allowed = ", ".join("$" + v for v in SCRATCH_VARS)
    words: list[str] = []
    pos = 0
    for m in _SCRATCH_VAR_RE.finditer(value):
        literal = value[pos:m.start()]
        if "$" in literal:
            raise ValueError(f"scratch {value!r}: only {allowed} may be expanded, found {literal[literal.index('$'):]!r}")
        if literal:
            words.append(shlex.quote(literal))
        if m["bare"] is not None:
            var, default = m["bare"], None
        else:
            var, sep, default = m["braced"].partition(":-")
            default = default if sep else None
        if var not in SCRATCH_VARS or (default is not None and not _SAFE_DEFAULT_RE.fullmatch(default)):
            raise ValueError(f"scratch {value!r}: only {allowed} may be expanded (as $V, ${{V}} or "
                             f"${{V:-/literal/default}}), found {m.group(0)!r}")
        words.append(f'"${{{var}}}"' if default is None else f'"${{{var}:-{default}}}"')
        pos = m.end()
    rest = value[pos:]
    if "$" in rest:
        raise ValueError(f"scratch {value!r}: only {allowed} may be expanded, found {rest[rest.index('$'):]!r}")
    if rest:
        words.append(shlex.quote(rest))
    if not value.startswith(("/", "$LAUNCH_NODE_SCRATCH", "${LAUNCH_NODE_SCRATCH")):
        raise ValueError(f"scratch {value!r} is a relative path: each task would make it in whatever directory it "
                         "starts in; give an absolute path (or one under $LAUNCH_NODE_SCRATCH)")
    return "".join(words)


# ---------------------------------------------------------------- argparse types
def _arg_type(check: Callable[[str], object], name: str) -> Callable[[str], object]:
    def convert(text: str) -> object:
        try:
            return check(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name
    return convert


def int_range(low: int, high: int) -> Callable[[str], object]:
    """An argparse type: a decimal integer in [low, high]."""
    def check(text: str) -> int:
        if not re.fullmatch(r"[+-]?[0-9]{1,12}", text.strip()):
            raise ValueError(f"expected an integer, got {text!r}")
        value = int(text)
        if not low <= value <= high:
            raise ValueError(f"must be between {low} and {high}, got {value}")
        return value
    return _arg_type(check, "integer")


positive_int = int_range(1, 10**9)
nonneg_int = int_range(0, 10**9)
def _cli_time(text: str) -> str:
    if text != text.strip():
        raise ValueError(f"time {text!r} has spaces around it; give {text.strip()!r}")
    parse_slurm_time(text)
    return text


slurm_time = _arg_type(_cli_time, "time")
job_name = _arg_type(lambda t: check_name(t, "--name"), "name")
dependency = _arg_type(check_dependency, "dependency")


def slurm_value(what: str) -> Callable[[str], object]:
    return _arg_type(lambda t: check_slurm_value(t, what), what)


def scratch_value(text: str) -> str:
    try:
        scratch_shell(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def env_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r}: expected KEY=VALUE")
    try:
        return check_env_key(key), check_env_value(key, value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
