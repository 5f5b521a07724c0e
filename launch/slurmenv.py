"""Which Slurm the launcher talks to, and small wrappers around its client commands.

Order: an explicit SLURM_CONF in the environment; else the embedded cluster under
$LAUNCH_HOME when one was started there (a partly-down one is an error, never a silent fall
back to another Slurm); else the system's default configuration (a real cluster's login node).
Before anything is submitted or followed, `require_cluster` asks the controller (`scontrol
ping`); a Slurm that does not answer is one line saying which Slurm was tried, what is down and
how to bring it up.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from launch.cluster.embedded import DAEMONS, EmbeddedCluster
from launch.errors import LaunchError

SYSTEM_CONFS = (Path("/etc/slurm/slurm.conf"), Path("/etc/slurm-llnl/slurm.conf"))
UP_HINT = "start the embedded cluster with `launch cluster up`, or set SLURM_CONF to your cluster's slurm.conf"


def slurm_env() -> dict[str, str]:
    """Variables to add to the environment so Slurm's clients reach the right controller."""
    if os.environ.get("SLURM_CONF"):
        return {"SLURM_CONF": os.environ["SLURM_CONF"]}
    embedded = EmbeddedCluster()
    state = embedded.read_state()
    if state is not None:
        if not embedded.is_up():
            running = set(embedded.running_daemons())
            expected = list(state.get("pids") or {}) or list(DAEMONS)  # what `up` started
            down = ", ".join(d for d in expected if d not in running) or "some daemons"
            raise LaunchError(f"the embedded cluster in {embedded.state_dir} is partly down (not running: {down}); "
                              "bring it back with `launch cluster up` (or `launch cluster down` to use the system Slurm)")
        return embedded.env()
    return {}


def is_embedded(env_extra: dict[str, str]) -> bool:
    """Is this the embedded cluster under $LAUNCH_HOME (the one `launch cluster up` starts)?"""
    conf = env_extra.get("SLURM_CONF")
    return bool(conf) and Path(conf) == EmbeddedCluster().slurm_conf


def describe_slurm(env_extra: dict[str, str]) -> str:
    conf = env_extra.get("SLURM_CONF")
    if conf:
        embedded = EmbeddedCluster()
        if Path(conf) == embedded.slurm_conf:
            return f"the embedded cluster ({conf})"
        return f"SLURM_CONF={conf}"
    found = next((c for c in SYSTEM_CONFS if c.is_file()), None)
    return f"the system Slurm ({found})" if found else "the system Slurm (no slurm.conf in /etc/slurm)"


def require_slurm_clients() -> None:
    for tool in ("sbatch", "srun", "squeue", "sacct", "scancel", "scontrol", "sinfo"):
        if shutil.which(tool) is None:
            raise LaunchError(f"'{tool}' not found: no Slurm client on this machine; install slurm-client, "
                              "or start the embedded cluster with `make deps && launch cluster up`")


def require_cluster(env_extra: dict[str, str] | None = None, timeout: float = 20) -> dict[str, str]:
    """The Slurm environment, after checking its clients exist and its controller answers."""
    env_extra = slurm_env() if env_extra is None else env_extra
    require_slurm_clients()
    tried = describe_slurm(env_extra)
    conf = env_extra.get("SLURM_CONF")
    if conf and not Path(conf).is_file():
        raise LaunchError(f"no Slurm reachable: tried {tried}, and that file does not exist; {UP_HINT}")
    if not conf and not any(c.is_file() for c in SYSTEM_CONFS):
        raise LaunchError(f"no Slurm reachable: no SLURM_CONF, no embedded cluster under {EmbeddedCluster().state_dir}, "
                          f"no /etc/slurm/slurm.conf; {UP_HINT}")
    try:
        ping = run_slurm(["scontrol", "ping"], env_extra, timeout=timeout)
    except LaunchError:
        ping = None
    if ping is None or ping.returncode != 0 or "DOWN" in ping.stdout:
        detail = "no answer" if ping is None else _first_meaningful(ping.stdout + "\n" + ping.stderr)
        raise LaunchError(f"no Slurm reachable: tried {tried}; slurmctld does not answer ({detail}); {UP_HINT}")
    return env_extra


def _first_meaningful(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and "dns_srv" not in ln.lower()]
    return (lines[0] if lines else "no output")[:160]


def run_slurm(argv: list[str], env_extra: dict[str, str] | None = None,
              timeout: float = 30) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, **(env_extra if env_extra is not None else slurm_env())}
    conf = env.get("SLURM_CONF")
    if conf and not Path(conf).is_file():
        # Slurm's clients would wait for DNS SRV records of a controller, then give up in 30 s.
        raise LaunchError(f"no Slurm reachable: tried SLURM_CONF={conf}, and that file does not exist; {UP_HINT}")
    try:
        return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as exc:
        raise LaunchError(f"'{argv[0]}' not found: is Slurm installed here?") from exc
    except subprocess.TimeoutExpired as exc:
        raise LaunchError(f"'{' '.join(argv)}' did not answer in {timeout:.0f} s: is slurmctld up?") from exc


TERMINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL",
                   "PREEMPTED", "BOOT_FAIL", "DEADLINE"}

# Slurm's pending reasons (squeue %r), in words a user can act on.
PENDING_REASONS = {
    "Resources": "waiting for resources: the GPUs/CPUs it asked for are in use by other jobs",
    "Priority": "waiting behind higher-priority jobs",
    "Dependency": "waiting for the jobs it depends on",
    "DependencyNeverSatisfied": "its dependency can never be satisfied (cancel it)",
    "JobHeldUser": "held by its user (`scontrol release JOBID`)",
    "JobHeldAdmin": "held by an administrator or root (`scontrol release JOBID`)",
    "BeginTime": "waiting for its start time",
    "PartitionConfig": "the request exceeds what the partition allows (GPUs, CPUs, nodes or time)",
    "PartitionTimeLimit": "the time limit is over the partition's limit",
    "PartitionNodeLimit": "more nodes than the partition allows",
    "PartitionDown": "the partition is down",
    "PartitionInactive": "the partition is inactive",
    "ReqNodeNotAvail": "a required node is down, drained or reserved",
    "NodeDown": "a node it needs is down",
    "BadConstraints": "no node satisfies its constraints",
    "QOSMaxJobsPerUserLimit": "the QOS's per-user job limit is reached",
    "AssocGrpGRES": "the account's GPU limit is reached",
    "Reservation": "waiting for its reservation",
    "Licenses": "waiting for licenses",
    "InvalidAccount": "the account is invalid",
    "InvalidQOS": "the QOS is invalid",
    "None": "just submitted; the scheduler has not looked at it yet",
}


def pending_words(reason: str, job_id: str = "") -> str:
    key = reason.strip().strip("()")
    words = PENDING_REASONS.get(key)
    if words is None:
        return key or "no reason given yet"
    words = words.replace("JOBID", job_id or "JOBID")
    return words if key == "None" else f"{words} [{key}]"  # Slurm's "None" names no reason


def _blank(state: str, reason: str = "") -> dict[str, str]:
    return {"state": state, "elapsed": "", "nodes": "", "reason": reason, "exit_code": ""}


def controller_down(env_extra: dict[str, str] | None = None) -> str | None:
    """`scontrol ping`'s line when every slurmctld it names is DOWN (it answers at once where squeue
    retries for many seconds); None when one is up, or when ping itself cannot tell."""
    try:
        ping = run_slurm(["scontrol", "ping"], env_extra, timeout=10)
    except LaunchError:
        return None
    said = [ln.strip() for ln in ping.stdout.splitlines() if " is " in ln]
    if ping.returncode != 0 and said and all(ln.endswith(" is DOWN") for ln in said):
        return said[0]
    return None


def job_states(job_ids: list[str], env_extra: dict[str, str] | None = None) -> dict[str, dict[str, str]]:
    """States of many jobs with one squeue and one sacct call: squeue while the controller
    knows a job, sacct afterwards. Jobs neither knows read UNKNOWN."""
    if not job_ids:
        return {}
    ids = ",".join(job_ids)
    out: dict[str, dict[str, str]] = {}
    down = controller_down(env_extra)
    if down:
        # squeue would retry for MessageTimeout and more (18 s by default) to say the same
        q = subprocess.CompletedProcess(["squeue"], 1, "", f"squeue: error: Unable to contact slurm controller ({down})")
    else:
        q = run_slurm(["squeue", "-h", "-j", ids, "-o", "%i|%T|%M|%N|%r"], env_extra)
    if q.returncode != 0 and "fatal:" in q.stderr:
        # The client could not start at all (an unreadable slurm.conf): no job's state is known,
        # and UNKNOWN rows would hide why. ("Invalid job id" is an error:, not a fatal:.)
        lines = [ln.strip() for ln in q.stderr.splitlines() if ln.strip()]
        fatal = next(ln for ln in lines if "fatal:" in ln)
        cause = next((ln for ln in lines if "error:" in ln and "dns_srv" not in ln.lower()), None)
        conf = (env_extra or {}).get("SLURM_CONF") or os.environ.get("SLURM_CONF") or "the system's slurm.conf"
        raise LaunchError(f"Slurm's clients cannot run with {conf}: {fatal}" + (f" ({cause})" if cause else ""))
    if q.returncode == 0:
        for line in q.stdout.splitlines():
            jid, state, elapsed, nodes, reason = (line.split("|") + [""] * 5)[:5]
            out.setdefault(jid.strip(), {"state": state, "elapsed": elapsed, "nodes": nodes, "reason": reason,
                                         "exit_code": ""})
    missing = [j for j in job_ids if j not in out]
    err = q.stderr.strip()
    a = subprocess.CompletedProcess([], 1, "", "")
    if missing:
        a = run_slurm(["sacct", "-j", ",".join(missing), "-X", "-n", "-P", "-o",
                       "JobID,State,Elapsed,NodeList,ExitCode"], env_extra)
        if a.returncode == 0:
            for line in a.stdout.splitlines():
                jid, state, elapsed, nodes, exit_code = (line.split("|") + [""] * 5)[:5]
                # "CANCELLED by 0" -> "CANCELLED"; a requeued job has several records, the last wins
                out[jid.strip()] = {"state": (state.split() or ["UNKNOWN"])[0], "elapsed": elapsed, "nodes": nodes,
                                    "reason": "", "exit_code": exit_code}
        err = err or a.stderr.strip()
        if a.returncode != 0 and q.returncode == 0:
            # Accounting (slurmdbd, MariaDB) down: slurmctld still knows jobs that ended within
            # MinJobAge, which plain squeue does not list (its default is pending/running).
            ended = run_slurm(["squeue", "-h", "-t", "all", "-j", ",".join(missing), "-o", "%i|%T|%M|%N|%r"],
                              env_extra)
            for line in ended.stdout.splitlines() if ended.returncode == 0 else []:
                jid, state, elapsed, nodes, reason = (line.split("|") + [""] * 5)[:5]
                out.setdefault(jid.strip(), {"state": state, "elapsed": elapsed, "nodes": nodes, "reason": reason,
                                             "exit_code": ""})
    unreachable = _contact_failure(q) if q.returncode != 0 and missing else None
    if unreachable and a.returncode == 0:
        unreachable = None  # slurmdbd answered for them: they are jobs it does not know, not a dead Slurm
    states = {j: out.get(j) or _blank("UNKNOWN", _first_meaningful(err) if err else "") for j in job_ids}
    for j in missing:
        if unreachable and j not in out:
            states[j]["unreachable"] = unreachable
    return states


# What Slurm's clients print when slurmctld does not answer (as opposed to "Invalid job id").
_CONTACT_FAILURES = ("Unable to contact slurm controller", "Connection refused", "connect failure",
                     "Socket timed out", "Zero Bytes were transmitted")


def _contact_failure(proc: subprocess.CompletedProcess[str]) -> str | None:
    """Why the controller could not be asked (its client's one line), or None."""
    for line in proc.stderr.splitlines():
        if any(f.lower() in line.lower() for f in _CONTACT_FAILURES):
            return line.strip().removeprefix("squeue: ").removeprefix("error: ")
    return None


def job_state(job_id: str, env_extra: dict[str, str] | None = None) -> dict[str, str]:
    """State of one job (see job_states)."""
    return job_states([job_id], env_extra)[job_id]
