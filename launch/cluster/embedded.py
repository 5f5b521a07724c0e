"""An embedded Slurm cluster of one or more nodes, built from Debian's real daemons.

`up` starts, in order: MariaDB (accounting store, data in the state dir), munged, slurmdbd,
slurmctld and one slurmd per node, every one in the foreground under our own pid file, with
configs rendered from the same jinja2 templates as the `slurm` Ansible role. Nothing is
installed system-wide, and every daemon listens on a loopback address only, so no other host
reaches them: MariaDB binds 127.0.0.1; Slurm's daemons bind the address their host name
resolves to (`CommunicationParameters=NoCtldInAddrAny,NoInAddrAny`; Slurm's default is every
address), so each starts in a UTS namespace of its own whose host name is its loopback
address: `localhost` for slurmctld and slurmdbd, the NodeAddr (127.0.0.1, 127.0.0.2, ...) for
each slurmd. Jobs inherit their slurmd's host name. Several clusters (one per state dir) can run side
by side: each picks its own free ports and its own range of job ids.

Several nodes on one machine (`up(nodes=N)`): Debian's slurmd runs once per node name
(`slurmd -N node1`), each node with its own `Port=`, its own NodeAddr on the loopback range
(127.0.0.2, 127.0.0.3, ...) and its own spool, pid and log file (`%n` in slurm.conf). Slurm
needs no --enable-multiple-slurmd build for that: that option only lets several nodes share
one NodeHostname, and these nodes have distinct ones. So no network namespace is needed;
slurmctld, srun and slurmstepd talk to each node at its own address, as on a real cluster.

`up` on a cluster that is partly running restarts only the daemons that died, from the state
and configs recorded at the first `up` (ports, nodes, prolog/epilog, stand-in GPUs), so the
running daemons and their jobs are left alone. Other resources than the recorded ones are an
error that says how to change them.

`down` stops exactly the processes `up` recorded. A pid is signalled only if the process
still carries this cluster's marker variable in its environment, so a recycled pid is never
hit, and nothing is ever stopped by name.

Stand-in GPUs: on a machine without the NVIDIA driver, `--gpus N` makes N character devices
per node with the NVIDIA major (195) under the state dir and lists them as `gres.conf File=`.
slurmd then allocates them and sets CUDA_VISIBLE_DEVICES / SLURM_JOB_GPUS as on a GPU node.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import grp
import json
import os
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import jinja2

from launch.errors import LaunchError
from launch.fsutil import launch_home
from toolkit.fsutil import atomic_write_bytes, atomic_write_text

NVIDIA_MAJOR = 195
MARKER_VAR = "LAUNCH_CLUSTER_STATE"
NODE_VAR = "LAUNCH_CLUSTER_NODE"  # which node's slurmd started a process (inherited by slurmstepd)
MAX_NODES = 64  # loopback addresses 127.0.0.2 ... are plenty; a typo like 10**20 is not a cluster
TEMPLATES = Path(__file__).with_name("templates")
# Order matters: each daemon needs the ones before it. "slurmd" stands for one slurmd per node.
DAEMONS = ("mariadb", "munged", "slurmdbd", "slurmctld", "slurmd")
REQUIRED_BINARIES = {
    "munged": "munge",
    "slurmctld": "slurm-wlm",
    "slurmd": "slurm-wlm",
    "slurmdbd": "slurmdbd",
    "sbatch": "slurm-client",
    "mariadbd": "mariadb-server",
    "mariadb-install-db": "mariadb-server",
    "mariadb": "mariadb-client",
}

Progress = Callable[[str], None]


def default_state_dir() -> Path:
    return launch_home() / "cluster"


def render_template(name: str, **context: object) -> str:
    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(TEMPLATES),
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
        keep_trailing_newline=True,
    )
    return env.get_template(name).render(**context)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _port_open(port: int, addr: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((addr, port)) == 0


def _proc_environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return b""


CLONE_NEWUTS = 0x04000000
# The host name slurmctld and slurmdbd run under (SlurmctldHost, DbdHost): it resolves to
# 127.0.0.1 on every system, so they listen there and nowhere else.
LOOPBACK_HOST = "localhost"


def _own_hostname(name: str) -> Callable[[], None]:
    """A preexec_fn: the child gets a UTS namespace of its own named `name` (root only, as is
    slurmd). Slurm binds its listening sockets to what gethostname() resolves to."""
    def enter() -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.unshare(CLONE_NEWUTS) != 0:
            raise OSError(ctypes.get_errno(), "unshare(CLONE_NEWUTS)")
        socket.sethostname(name)
    return enter


def real_gpu_nodes() -> list[str]:
    """This machine's NVIDIA GPU device nodes (none without the driver: the cluster then makes stand-ins)."""
    if not Path("/proc/driver/nvidia").exists():
        return []
    nodes = [p for p in Path("/dev").glob("nvidia[0-9]*") if p.name[6:].isdigit()]
    return [str(p) for p in sorted(nodes, key=lambda p: int(p.name[6:]))]


@dataclass
class DaemonSpec:
    name: str
    argv: list[str]
    ready: Callable[[], bool]
    log: Path
    env: dict[str, str] = field(default_factory=dict)
    # Host name in a UTS namespace of its own: what a Slurm daemon binds with NoInAddrAny.
    hostname: str | None = None


@dataclass(frozen=True)
class ClusterConfig:
    """What the first `up` was asked for; later `up`s restart daemons with exactly this."""

    nodes: int = 1
    gpus: int = 0  # per node
    cpus: int = 1  # per node
    prolog: str | None = None
    epilog: str | None = None
    partition: str = "debug"
    slurmd_timeout: int | None = None
    # Seconds a requeued job waits before it may start again (Slurm's cred_expire, also the
    # lifetime of a step's credential). None: slurmd_timeout when given, else Slurm's 120 s.
    requeue_delay: int | None = None

    def describe(self) -> str:
        def n(count: int, what: str) -> str:
            return f"{count} {what}{'s' if count != 1 else ''}"

        hooks = "".join(f", {k} {v}" for k, v in (("prolog", self.prolog), ("epilog", self.epilog)) if v)
        return f"{n(self.nodes, 'node')} x ({n(self.gpus, 'GPU')}, {n(self.cpus, 'CPU')}){hooks}"


def node_daemon(node: str) -> str:
    """The name under which a node's slurmd is recorded (one per node)."""
    return f"slurmd:{node}"


class EmbeddedCluster:
    """A real Slurm (with accounting) of one or more nodes, living entirely in `state_dir`."""

    def __init__(self, state_dir: str | os.PathLike[str] | None = None) -> None:
        self.state_dir = Path(state_dir or default_state_dir()).resolve()
        self.etc = self.state_dir / "etc"
        self.run_dir = self.state_dir / "run"
        self.mariadb_tmp = self.state_dir / "mysql-tmp"  # MariaDB's tmpdir: its own, never /tmp
        self.log_dir = self.state_dir / "log"
        self.dev_dir = self.state_dir / "dev"
        self.state_file = self.state_dir / "cluster.json"
        self.slurm_conf = self.etc / "slurm.conf"
        self.munge_socket = self.run_dir / "munge.socket"

    # ------------------------------------------------------------------ queries
    def read_state(self) -> dict | None:
        """What `up` recorded, or None when no cluster was started here. A state that cannot be
        read is an error naming the file; it is never rewritten here (`down` moves it aside)."""
        try:
            raw = self.state_file.read_bytes()
        except FileNotFoundError:
            return None
        except NotADirectoryError:
            raise LaunchError(f"{self.state_dir} is not a directory: the embedded cluster keeps its state there; "
                              "give another --state-dir or LAUNCH_HOME") from None
        except OSError as exc:
            raise LaunchError(f"{self.state_file}: cannot read the cluster state ({exc.strerror}); {UNREADABLE_HINT}") from None
        try:
            state = json.loads(raw.decode("utf-8"))
            problem = _state_problem(state)
        except UnicodeDecodeError as exc:
            problem = f"byte 0x{raw[exc.start]:02x} at offset {exc.start} is not UTF-8"
        except json.JSONDecodeError as exc:
            problem = f"not JSON: {exc}"
        if problem:
            raise LaunchError(f"{self.state_file}: unreadable cluster state ({problem}); {UNREADABLE_HINT}")
        return state

    def _marker(self) -> bytes:
        return f"{MARKER_VAR}={self.state_dir}".encode()

    def _is_ours(self, pid: int) -> bool:
        return self._marker() in _proc_environ(pid).split(b"\0")

    def running_daemons(self) -> dict[str, int]:
        state = self.read_state() or {}
        return {name: pid for name, pid in state.get("pids", {}).items() if self._is_ours(pid)}

    @staticmethod
    def daemon_names(state: dict) -> list[str]:
        """Every daemon of the cluster `state` describes, in start order."""
        return [*DAEMONS[:-1], *(node_daemon(n["name"]) for n in state.get("nodes", []))]

    def nodes(self) -> list[dict]:
        """The nodes as recorded at `up`: name, addr, port, cpus, gpus, gpu_files."""
        return list((self.read_state() or {}).get("nodes", []))

    def is_up(self) -> bool:
        state = self.read_state()
        if not state:
            return False
        # a state from before multi-node clusters has no "nodes": its recorded pids are the daemons
        names = self.daemon_names(state) if "nodes" in state else list(state.get("pids") or DAEMONS)
        return set(self.running_daemons()) >= set(names)

    def env(self) -> dict[str, str]:
        """Variables that point Slurm's client commands (and submitit) at this cluster.

        LAUNCH_SRUN_CONF: srun's own config (the job script runs srun with it). The daemons bind
        their host name's loopback address (NoInAddrAny), and a job inherits its slurmd's host
        name; srun binding it too (127.0.0.2 on node1) would not be where the steps call back,
        since a loopback connection's source address is 127.0.0.1. So srun listens on any address
        for its step's lifetime, as Slurm's default, while every daemon stays on loopback."""
        srun_conf = self.etc / "srun.conf"
        return {"SLURM_CONF": str(self.slurm_conf), **({"LAUNCH_SRUN_CONF": str(srun_conf)} if srun_conf.is_file() else {})}

    def _client_env(self) -> dict[str, str]:
        return {**os.environ, **self.env()}

    def slurm(self, *argv: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a Slurm client command against this cluster."""
        proc = subprocess.run(list(argv), env=self._client_env(), capture_output=True, text=True,
                              timeout=timeout)
        if check and proc.returncode != 0:
            raise LaunchError(f"{' '.join(argv)} failed: {proc.stderr.strip() or proc.stdout.strip()}")
        return proc

    # ------------------------------------------------------------------ up
    def up(self, gpus: int | None = None, cpus: int | None = None, prolog: str | None = None,
           epilog: str | None = None, partition: str | None = None, nodes: int | None = None,
           slurmd_timeout: int | None = None, requeue_delay: int | None = None, progress: Progress | None = None,
           timeout: float = 60) -> bool:
        """Start the cluster; True if anything was started.

        On a cluster that is already (partly) up, only the daemons that died are restarted,
        with the configuration recorded at the first `up`, so running jobs keep running. Asking
        such a cluster for other resources is an error that says how to change them.
        """
        say = progress or (lambda _msg: None)
        asked = _asked(nodes=nodes, gpus=gpus, cpus=cpus, prolog=prolog, epilog=epilog, partition=partition,
                       slurmd_timeout=slurmd_timeout, requeue_delay=requeue_delay)
        state = self.read_state()
        if state is not None and self._restartable(state):
            self._refuse_other_resources(state, asked)
            running = self.running_daemons()
            dead = [name for name in self.daemon_names(state) if name not in running]
            with contextlib.suppress(OSError):  # a cluster first started before its directories were private
                self._make_private()
            if not dead:
                return False
            self._restart(state, dead, say, timeout)
            return True
        if state is not None:
            say("found leftovers of an earlier `up` without a usable configuration; stopping them first")
            self.down(progress=progress)
        self._start_fresh(asked, say, timeout)
        return True

    def _make_private(self) -> None:
        """The cluster is the user's own: munged's socket (run/) and what the daemons keep (logs,
        spools, the database) only for the user and root. Without the socket another uid gets no
        munge credential, so it can neither submit, query accounting nor cancel."""
        for d in (self.run_dir, self.log_dir, self.state_dir / "spool", self.state_dir / "munge",
                  self.state_dir / "mysql"):
            if d.is_dir():
                os.chmod(d, 0o700)

    def _start_fresh(self, asked: dict, say: Progress, timeout: float) -> None:
        n = asked.get("nodes", 1)
        names = [socket.gethostname().split(".")[0]] if n == 1 else [f"node{i}" for i in range(1, n + 1)]
        # One node keeps 127.0.0.1; several get their own loopback addresses, so each slurmd
        # is reached at an address of its own, as on a real cluster, and nothing leaves the host.
        addrs = ["127.0.0.1"] if n == 1 else [f"127.0.0.{i + 1}" for i in range(1, n + 1)]
        spools = [self.state_dir / "spool" / "d"] if n == 1 else [self.state_dir / "spool" / "d" / m for m in names]
        try:
            for d in (self.etc, self.run_dir, self.log_dir, self.dev_dir, self.state_dir / "spool" / "ctld",
                      *spools, self.state_dir / "munge", self.state_dir / "mysql"):
                d.mkdir(parents=True, exist_ok=True)
            os.chmod(self.state_dir, 0o755)
            self._make_private()
        except OSError as exc:
            raise LaunchError(f"cannot create the cluster's state in {self.state_dir} ({exc.strerror}: {exc.filename}); "
                              "give a writable --state-dir or LAUNCH_HOME") from None
        self._check_prerequisites()

        gpu_files, stand_in = self._gpu_files(names, asked.get("gpus"))
        config = ClusterConfig(nodes=n, gpus=len(gpu_files[0]), cpus=asked.get("cpus") or os.cpu_count() or 1,
                               prolog=asked.get("prolog"), epilog=asked.get("epilog"),
                               partition=asked.get("partition", "debug"),
                               slurmd_timeout=asked.get("slurmd_timeout"), requeue_delay=asked.get("requeue_delay"))
        ports = {k: _free_port() for k in ("slurmctld", "slurmdbd", "mariadb")}
        mem_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.9 / n)
        node_list = [dict(name=name, addr=addr, port=_free_port(), cpus=config.cpus, memory_mb=mem_mb,
                          gpus=len(files), gpu_files=files)
                     for name, addr, files in zip(names, addrs, gpu_files, strict=True)]
        db_password = secrets.token_hex(16)
        self._render_configs(node_list, ports, db_password, config)
        self._write_munge_key()
        state = {"pids": {}, "ports": ports, "nodes": node_list, "config": asdict(config),
                 # flat copies of the first node, for readers of the single-node layout
                 "node": names[0], "cpus": config.cpus, "gpus": config.gpus, "gpu_files": gpu_files[0],
                 "stand_in_gpus": stand_in, "partition": config.partition,
                 "prolog": config.prolog, "epilog": config.epilog, "started_at": time.time()}
        self._save_state(state)

        self._init_mariadb(say)
        try:
            for spec in self._daemon_specs(state):
                self._start_daemon(spec, state, say, timeout)
                if spec.name == "mariadb":
                    self._create_accounting_user(db_password)
            self._wait_nodes_up(state, timeout, say)
        except BaseException:
            self.down()
            raise

    def _start_daemon(self, spec: DaemonSpec, state: dict, say: Progress, timeout: float) -> None:
        t0 = time.monotonic()
        say(f"starting {spec.name} ...")
        pid = self._spawn(spec)
        state["pids"][spec.name] = pid
        self._save_state(state)
        self._wait(spec, pid, timeout)
        say(f"  {spec.name} up (pid {pid}, {time.monotonic() - t0:.1f} s)")

    def _restartable(self, state: dict) -> bool:
        """A state with a recorded configuration whose files are all still there."""
        return ("config" in state and "nodes" in state and self.slurm_conf.exists()
                and (self.etc / "slurmdbd.conf").exists() and (self.etc / "munge.key").exists()
                and (self.state_dir / "mysql" / "mysql").exists())

    def _refuse_other_resources(self, state: dict, asked: dict) -> None:
        known = set(ClusterConfig.__dataclass_fields__)  # a newer launcher's state may record more
        config = ClusterConfig(**{k: v for k, v in state["config"].items() if k in known})
        recorded = asdict(config)
        differ = {k: v for k, v in asked.items() if recorded.get(k) != v}
        if not differ:
            return
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in differ.items())
        keep = {k: v for k, v in recorded.items() if v and k != "partition"}
        wanted = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in {**keep, **differ}.items())
        raise LaunchError(
            f"the embedded cluster in {self.state_dir} is up with {config.describe()}, not {flags}; "
            f"to change it: `launch cluster down` (cancels its jobs), then `launch cluster up {wanted}`")

    def _restart(self, state: dict, dead: list[str], say: Progress, timeout: float) -> None:
        say(f"restarting {', '.join(dead)} with the configuration of the first `up`; "
            "the running daemons and their jobs are left alone")
        self.mariadb_tmp.mkdir(parents=True, exist_ok=True)  # a cluster an older launcher made has none
        for spec in self._daemon_specs(state):
            if spec.name in dead:
                self._start_daemon(spec, state, say, timeout)
        self._wait_nodes_up(state, timeout, say)

    def _check_prerequisites(self) -> None:
        missing = sorted({pkg for binary, pkg in REQUIRED_BINARIES.items() if not shutil.which(binary)
                          and not Path("/usr/sbin", binary).exists()})
        if missing:
            raise LaunchError("missing Debian packages for the embedded cluster: " + " ".join(missing)
                              + f"; install with: apt-get install -y {' '.join(missing)} (or run `make deps`)")
        if os.geteuid() != 0:
            raise LaunchError("the embedded cluster runs slurmd, which must run as root "
                              "(it starts jobs for other users); run `launch cluster up` as root")

    def _gpu_files(self, names: list[str], gpus: int | None) -> tuple[list[list[str]], bool]:
        """Each node's GPU device files: real ones split between the nodes, else stand-ins."""
        real = real_gpu_nodes()
        n = len(names)
        if real:
            count = len(real) // n if gpus is None else gpus
            if count * n > len(real):
                raise LaunchError(f"--gpus {count} per node on {n} node(s) asked for, "
                                  f"but this machine has {len(real)} NVIDIA GPUs")
            return [real[i * count:(i + 1) * count] for i in range(n)], False
        count = gpus or 0
        files: list[list[str]] = []
        for name in names:
            # One node keeps dev/nvidiaK; several get dev/<node>/nvidiaK, minors 0.. on each.
            directory = self.dev_dir if n == 1 else self.dev_dir / name
            directory.mkdir(parents=True, exist_ok=True)
            node_files = []
            for i in range(count):
                node = directory / f"nvidia{i}"
                if node.exists() and not stat.S_ISCHR(node.stat().st_mode):
                    node.unlink()
                if not node.exists():
                    try:
                        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, i))
                    except PermissionError as exc:
                        raise LaunchError(f"cannot create stand-in GPU node {node} ({exc}); "
                                          "mknod needs root with CAP_MKNOD") from exc
                node_files.append(str(node))
            files.append(node_files)
        return files, True

    def _render_configs(self, nodes: list[dict], ports: dict[str, int], db_password: str,
                        config: ClusterConfig) -> None:
        controller = LOOPBACK_HOST
        context = dict(
            managed="Generated by `launch cluster up`; edits are overwritten on the next up.",
            cluster_name="embedded",
            # Job ids of its own, as clusters have: jobs of two embedded clusters on one host then
            # never share an id, nor the rendezvous port derived from it (train.common.distributed).
            first_job_id=secrets.randbelow(900_000) + 100_000,
            controller_host=controller, controller_addr="127.0.0.1",
            slurmctld_port=ports["slurmctld"], slurmd_port=nodes[0]["port"],
            slurmdbd_host="127.0.0.1", slurmdbd_port=ports["slurmdbd"], dbd_host=controller,
            slurm_user="root", munge_socket=str(self.munge_socket),
            # The user's own cluster: only the user's group may run jobs in its partition (root
            # always may), and no one else sees its jobs, accounting, usage or users.
            allow_groups=grp.getgrgid(os.getgid()).gr_name, private_data="jobs,accounting,usage,users",
            state_save_dir=str(self.state_dir / "spool" / "ctld"),
            slurmd_spool_dir=str(self.state_dir / "spool" / "d"),
            # Several slurmds on one host: each its own spool, pid and log file (%n = node name).
            per_node_files=len(nodes) > 1,
            run_dir=str(self.run_dir), log_dir=str(self.log_dir),
            # Declared CPUs/memory may exceed the hardware (stand-in nodes on a small CI box).
            slurmd_parameters="config_overrides",
            # Listen only on the address of the daemon's host name (see _daemon_specs), not on all.
            communication_parameters="NoCtldInAddrAny,NoInAddrAny",
            # No cgroup hierarchy is delegated to us inside a container: track by process tree.
            proctrack_type="proctrack/linuxproc", task_plugin="task/none",
            # Start a submitted batch job at once (Slurm's default waits up to 3 s to batch them).
            scheduler_parameters="batch_sched_delay=0,sched_min_interval=0",
            slurmd_timeout=config.slurmd_timeout,
            # A requeued job waits cred_expire (default 120 s) before it may start again; with a
            # short node timeout (fast fail-over, as in tests) the wait is as short, unless asked.
            cred_expire=config.requeue_delay or config.slurmd_timeout,
            prolog=config.prolog or "", epilog=config.epilog or "",
            nodes=[{**node, "gpu_files": ",".join(node["gpu_files"])} for node in nodes],
            partition=config.partition,
            storage_host="127.0.0.1", storage_port=ports["mariadb"], storage_user="slurm",
            storage_pass=db_password, storage_db="slurm_acct_db",
        )
        atomic_write_text(self.slurm_conf, render_template("slurm.conf.j2", **context))
        # srun's own (see env()): the same cluster, only slurmctld's and the daemons' binding differs.
        atomic_write_text(self.etc / "srun.conf", render_template(
            "slurm.conf.j2", **{**context, "communication_parameters": "NoCtldInAddrAny"}))
        atomic_write_text(self.etc / "gres.conf", render_template("gres.conf.j2", **context))
        atomic_write_text(self.etc / "slurmdbd.conf", render_template("slurmdbd.conf.j2", **context),
                          mode=0o600)

    def _write_munge_key(self) -> None:
        key = self.etc / "munge.key"
        if not key.exists():
            atomic_write_bytes(key, secrets.token_bytes(1024), mode=0o400)

    def _save_state(self, state: dict) -> None:
        atomic_write_text(self.state_file, json.dumps(state, indent=2))

    def _init_mariadb(self, say: Progress) -> None:
        datadir = self.state_dir / "mysql"
        if (datadir / "mysql").exists():
            return
        say("initialising the accounting database (MariaDB) ...")
        # Its own tmpdir: bootstraps that share /tmp collide on their temporary tables' file names
        # ("Unknown table 'mysql.tmp_user_socket'", then "Aborting": 3 of 6 failed, started at once
        # on this 2-core test machine). Built aside and renamed, so a failed one leaves no half
        # datadir that the next `up` would take for a finished one.
        building = datadir.with_name("mysql.init")
        shutil.rmtree(building, ignore_errors=True)
        self.mariadb_tmp.mkdir(parents=True, exist_ok=True)
        proc = subprocess.run(
            ["mariadb-install-db", "--no-defaults", f"--datadir={building}", f"--tmpdir={self.mariadb_tmp}",
             "--user=root", "--auth-root-authentication-method=socket", "--skip-test-db"],
            capture_output=True, text=True)
        if proc.returncode != 0:
            lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if "ERROR" in ln] or proc.stderr.splitlines()[-1:]
            raise LaunchError(f"mariadb-install-db failed: {lines[0].strip() if lines else f'exit {proc.returncode}'}"
                              f" (the whole output: run it by hand with --datadir={building})")
        shutil.rmtree(datadir, ignore_errors=True)  # an older launcher's half-built one
        building.rename(datadir)

    def _create_accounting_user(self, password: str) -> None:
        # Runs on every up: the password is fresh each time and lives only in slurmdbd.conf (0600).
        sql = ("CREATE DATABASE IF NOT EXISTS slurm_acct_db; "
               f"CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}'; "
               f"ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '{password}'; "
               "GRANT ALL ON slurm_acct_db.* TO 'slurm'@'127.0.0.1'; FLUSH PRIVILEGES;")
        proc = subprocess.run(["mariadb", "--no-defaults", f"--socket={self.run_dir / 'mysqld.sock'}",
                               "-u", "root"], input=sql, capture_output=True, text=True)
        if proc.returncode != 0:
            raise LaunchError(f"could not create the accounting user: {proc.stderr.strip()}")

    def _daemon_specs(self, state: dict) -> list[DaemonSpec]:
        """Every daemon of the recorded cluster, in start order (from `state` alone, so a
        restart gets exactly the ports and nodes of the first `up`)."""
        conf = str(self.slurm_conf)
        log = self.log_dir
        ports = state["ports"]
        # A cluster first started by an older launcher (all addresses, SlurmctldHost = this
        # host) restarts as it was configured.
        bound = "CommunicationParameters=" in self.slurm_conf.read_text()
        ctl_host = LOOPBACK_HOST if bound else None
        specs = [
            DaemonSpec("mariadb", [
                "mariadbd", "--no-defaults", f"--datadir={self.state_dir / 'mysql'}", "--user=root",
                f"--port={ports['mariadb']}", "--bind-address=127.0.0.1",
                f"--socket={self.run_dir / 'mysqld.sock'}", f"--pid-file={self.run_dir / 'mysqld.pid'}",
                f"--log-error={log / 'mariadb.log'}", "--innodb-buffer-pool-size=32M",
                f"--tmpdir={self.mariadb_tmp}", "--skip-name-resolve"],
                lambda: _port_open(ports["mariadb"]), log / "mariadb.out"),
            DaemonSpec("munged", [
                "munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                f"--key-file={self.etc / 'munge.key'}", f"--pid-file={self.run_dir / 'munged.pid'}",
                f"--log-file={log / 'munged.log'}", f"--seed-file={self.state_dir / 'munge' / 'seed'}"],
                lambda: self.munge_socket.exists(), log / "munged.out"),
            DaemonSpec("slurmdbd", ["slurmdbd", "-D"],
                       lambda: _port_open(ports["slurmdbd"]), log / "slurmdbd.out", hostname=ctl_host),
            DaemonSpec("slurmctld", ["slurmctld", "-D", "-f", conf],
                       lambda: _port_open(ports["slurmctld"]), log / "slurmctld.out", hostname=ctl_host),
        ]
        several = len(state["nodes"]) > 1
        for node in state["nodes"]:
            # -N: this slurmd is that node (its Port=, NodeAddr and %n paths come from slurm.conf).
            # NODE_VAR marks its processes (slurmstepd inherits it) as this node's.
            out = log / (f"slurmd-{node['name']}.out" if several else "slurmd.out")
            specs.append(DaemonSpec(node_daemon(node["name"]), ["slurmd", "-D", "-f", conf, "-N", node["name"]],
                                    functools.partial(_port_open, node["port"], node["addr"]), out,
                                    env={NODE_VAR: node["name"]}, hostname=node["addr"] if bound else None))
        return specs

    def _spawn(self, spec: DaemonSpec) -> int:
        env = {**os.environ, **self.env(), MARKER_VAR: str(self.state_dir), **spec.env}
        # slurmdbd finds its config beside slurm.conf.
        env.pop("SLURM_JOB_ID", None)
        with open(spec.log, "ab") as out:
            try:
                proc = subprocess.Popen(spec.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                        env=env, cwd=self.state_dir, start_new_session=True,
                                        preexec_fn=_own_hostname(spec.hostname) if spec.hostname else None)
            except subprocess.SubprocessError as exc:  # the preexec_fn: no CAP_SYS_ADMIN for a UTS namespace
                raise LaunchError(f"cannot start {spec.name} under its own host name {spec.hostname} ({exc}): the "
                                  "embedded cluster keeps its daemons on loopback that way, which needs root with "
                                  "CAP_SYS_ADMIN (unshare)") from None
        atomic_write_text(self._pid_file(spec.name), f"{proc.pid}\n")
        return proc.pid

    def _wait(self, spec: DaemonSpec, pid: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if spec.ready():
                return
            try:
                waited, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                waited = pid
            if waited == pid:
                raise LaunchError(f"{spec.name} exited during start-up; {self._log_hint(spec.name)}")
            time.sleep(0.1)
        raise LaunchError(f"{spec.name} did not become ready in {timeout:.0f} s; {self._log_hint(spec.name)}")

    def _pid_file(self, name: str) -> Path:
        return self.run_dir / f"launch-{name.replace(':', '-')}.pid"

    def _log_hint(self, name: str) -> str:
        # slurmd:NODE logs to slurmd-NODE.log on a multi-node cluster, slurmd.log on one node
        bases = dict.fromkeys([name.replace(":", "-"), name.split(":")[0]])
        logs = [self.log_dir / f"{base}{ext}" for base in bases for ext in (".log", ".out")]
        for log in logs:
            if log.exists() and log.stat().st_size:
                lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
                last = lines[-1] if lines else ""
                return f"last log line ({log}): {last[-300:]}"
        return f"see {self.log_dir}"

    def node_states(self) -> dict[str, str]:
        """Slurm's state of each node (sinfo %T: idle, allocated, down*, ...); {} if unreachable."""
        proc = self.slurm("sinfo", "-h", "-N", "-o", "%N %T", check=False)
        if proc.returncode != 0:
            return {}
        return dict(line.split(None, 1) for line in proc.stdout.splitlines() if len(line.split()) == 2)

    def _wait_nodes_up(self, state: dict, timeout: float, say: Progress) -> None:
        names = [n["name"] for n in state["nodes"]]
        deadline = time.monotonic() + timeout
        states: dict[str, str] = {}
        while time.monotonic() < deadline:
            states = self.node_states()
            if all(_answers(states.get(name, "")) for name in names):
                for name in names:
                    say(f"node {name} is {states[name]}")
                return
            time.sleep(0.3)
        bad = next(name for name in names if not _answers(states.get(name, "")))
        raise LaunchError(f"node {bad} did not come up (state {states.get(bad, 'unknown')!r}); "
                          f"{self._log_hint(node_daemon(bad))}")

    # ------------------------------------------------------------------ down
    def down(self, progress: Progress | None = None, timeout: float = 20) -> list[str]:
        """Stop what `up` started. Returns the names of the daemons that were stopped."""
        say = progress or (lambda _msg: None)
        try:
            state = self.read_state()
        except LaunchError:
            if not self.state_file.exists():
                raise
            return self._down_unreadable(say, timeout)
        if state is None:
            return []
        running = self.running_daemons()
        names = self.daemon_names(state)
        names += [name for name in state.get("pids", {}) if name not in names]  # an older layout's
        if "slurmctld" in running and any(name.startswith("slurmd") for name in running):
            # Jobs first, so their steps end cleanly before the slurmds go.
            self.slurm("scancel", "--full", "--user", str(os.geteuid()), check=False)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                q = self.slurm("squeue", "-h", "-o", "%i", check=False)
                if q.returncode != 0 or not q.stdout.strip():
                    break
                time.sleep(0.3)
        stopped = []
        for name in reversed(names):
            pid = running.get(name)
            if pid is None:
                continue
            self._terminate(pid, timeout)
            stopped.append(name)
            say(f"stopped {name} (pid {pid})")
        # Job step daemons (slurmstepd) inherit our marker from slurmd; stray ones go too.
        for pid in self._marked_processes():
            self._terminate(pid, 5)
            say(f"stopped leftover process {pid}")
        for name in names:
            self._pid_file(name).unlink(missing_ok=True)
        self.state_file.unlink(missing_ok=True)
        return stopped

    def _down_unreadable(self, say: Progress, timeout: float) -> list[str]:
        """`down` without a readable state: every process started from this state dir carries
        its marker, so they are found without it; the state file is kept, moved aside."""
        stopped = []
        for pid in self._marked_processes():
            self._terminate(pid, timeout)
            stopped.append(f"pid {pid}")
            say(f"stopped process {pid} of this cluster")
        aside = self.state_file.with_name(f"{self.state_file.name}.unreadable-{time.strftime('%Y%m%d-%H%M%S')}")
        try:
            self.state_file.rename(aside)
        except OSError as exc:
            raise LaunchError(f"{self.state_file}: cannot move the unreadable state aside ({exc.strerror})") from None
        say(f"moved the unreadable state to {aside}")
        return stopped or [f"state moved to {aside}"]

    def _marked_processes(self) -> list[int]:
        pids = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid() and self._is_ours(int(entry.name)):
                pids.append(int(entry.name))
        return pids

    def _terminate(self, pid: int, timeout: float) -> None:
        if not self._is_ours(pid):
            return
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._reap(pid)
            if not self._is_ours(pid):
                return
            time.sleep(0.1)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            return
        for _ in range(50):
            self._reap(pid)
            if not self._is_ours(pid):
                return
            time.sleep(0.1)

    @staticmethod
    def _reap(pid: int) -> None:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass

    # ------------------------------------------------------------------ status
    def status_dict(self) -> dict:
        """What `status_text` shows, for `launch cluster status --json`: daemons, nodes (with
        Slurm's own state for each), GPUs. `up` is False when no cluster was ever started here."""
        state = self.read_state()
        if state is None:
            return {"state_dir": str(self.state_dir), "up": False, "daemons": [], "nodes": []}
        running = self.running_daemons()
        slurm_nodes: dict[str, dict] = {}
        if "slurmctld" in running:
            sinfo = self.slurm("sinfo", "-N", "-h", "-o", "%N|%P|%T|%c|%m|%G", check=False)
            for line in sinfo.stdout.splitlines():
                name, partition, node_state, cpus, mem, gres = (line.split("|") + [""] * 6)[:6]
                slurm_nodes.setdefault(name, {"partitions": [], "state": node_state, "cpus": cpus,
                                              "memory_mb": mem, "gres": gres})["partitions"].append(partition)
        recorded = state.get("nodes", [])
        return {
            "state_dir": str(self.state_dir), "slurm_conf": str(self.slurm_conf), "up": self.is_up(),
            "daemons": [{"name": n, "pid": state.get("pids", {}).get(n), "running": n in running}
                        for n in self.daemon_names(state)],
            "nodes": [{"name": n["name"], "addr": n.get("addr"), "port": n.get("port"),
                       **slurm_nodes.get(n["name"], {"state": "unknown"})} for n in recorded],
            "gpus_per_node": state.get("gpus"), "stand_in_gpus": bool(state.get("stand_in_gpus")),
        }

    def status_text(self) -> str:
        state = self.read_state()
        if state is None:
            return f"no embedded cluster in {self.state_dir} (start one with `launch cluster up`)"
        running = self.running_daemons()
        names = self.daemon_names(state)
        width = max(len(name) for name in names) + 2
        lines = [f"embedded cluster in {self.state_dir}",
                 f"SLURM_CONF={self.slurm_conf}", "", f"{'daemon':<{width}}pid      state"]
        for name in names:
            pid = state.get("pids", {}).get(name)
            lines.append(f"{name:<{width}}{pid or '-':<8} {'running' if name in running else 'STOPPED'}")
        if "slurmctld" in running:
            sinfo = self.slurm("sinfo", "-N", "-o", "%N %P %T %C %m %G", check=False)
            lines += ["", "node/partition (CPUs alloc/idle/other/total, memory MB, GRES):",
                      sinfo.stdout.rstrip() or sinfo.stderr.strip()]
        if len(state.get("nodes", [])) > 1:
            lines += ["", "node addresses (loopback, each slurmd on its own port):"]
            lines += [f"  {n['name']:<10} {n['addr']}:{n['port']}" for n in state["nodes"]]
        if state.get("stand_in_gpus") and state.get("gpus"):
            lines.append(f"GPUs: {state['gpus']} stand-in devices per node (major {NVIDIA_MAJOR}) in {self.dev_dir}")
        dead = [name for name in names if name not in running]
        if dead and len(dead) < len(names):
            lines.append(f"\n{', '.join(dead)} not running: `launch cluster up` restarts only those, "
                         "with the first `up`'s configuration")
        return "\n".join(lines)


UNREADABLE_HINT = "`launch cluster down` stops the processes started from it and moves the file aside"


def _state_problem(state: object) -> str | None:
    """What is wrong with a parsed cluster.json, or None: the fields readers index into."""
    if not isinstance(state, dict):
        return f"expected a JSON object, got {type(state).__name__}"
    pids = state.get("pids", {})
    if not isinstance(pids, dict) or not all(isinstance(k, str) and type(v) is int and v > 0 for k, v in pids.items()):
        return "'pids' is not a mapping of daemon names to process ids"
    nodes = state.get("nodes", [])
    if not isinstance(nodes, list) or not all(isinstance(n, dict) and isinstance(n.get("name"), str) for n in nodes):
        return "'nodes' is not a list of nodes with names"
    if not isinstance(state.get("config", {}), dict):
        return "'config' is not a mapping"
    return None


def _answers(node_state: str) -> bool:
    """A node whose slurmd answers slurmctld: not down, unknown or not responding (`*`).
    (Drained counts: that is an administrator's choice, not a dead daemon.)"""
    return bool(node_state) and not node_state.endswith("*") and not node_state.startswith(("down", "unk", "fail"))


def _asked(**values: object) -> dict:
    """The resources a caller gave explicitly (None: not given), validated."""
    asked = {k: v for k, v in values.items() if v is not None}
    # cred_expire is also a step credential's lifetime: below 5 s a loaded node may miss it.
    for key, low in (("nodes", 1), ("cpus", 1), ("gpus", 0), ("slurmd_timeout", 1), ("requeue_delay", 5)):
        if key in asked and (not isinstance(asked[key], int) or asked[key] < low):
            raise LaunchError(f"--{key.replace('_', '-')} must be a whole number >= {low}, got {asked[key]}")
    if asked.get("nodes", 1) > MAX_NODES:
        raise LaunchError(f"--nodes {asked['nodes']}: the embedded cluster has at most {MAX_NODES} nodes")
    for key in ("prolog", "epilog"):
        if key in asked:
            path = Path(str(asked[key])).resolve()
            if not (path.is_file() and os.access(path, os.X_OK)):
                raise LaunchError(f"--{key} {asked[key]}: not an executable file")
            asked[key] = str(path)
    return asked
