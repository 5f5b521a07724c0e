"""An embedded single-node Slurm cluster built from Debian's real daemons.

`up` starts, in order: MariaDB (accounting store, data in the state dir), munged, slurmdbd,
slurmctld and slurmd, every one in the foreground under our own pid file, with configs
rendered from the same jinja2 templates as the `slurm` Ansible role. Nothing is installed
system-wide and nothing listens beyond 127.0.0.1, so several clusters (one per state dir)
can run side by side: each picks its own free ports.

`down` stops exactly the processes `up` recorded. A pid is signalled only if the process
still carries this cluster's marker variable in its environment, so a recycled pid is never
hit, and nothing is ever stopped by name.

Stand-in GPUs: on a machine without the NVIDIA driver, `--gpus N` makes N character devices
with the NVIDIA major (195) under the state dir and lists them as `gres.conf File=`. slurmd
then allocates them and sets CUDA_VISIBLE_DEVICES / SLURM_JOB_GPUS as on a GPU node.
"""

from __future__ import annotations

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
from dataclasses import dataclass
from pathlib import Path

import jinja2

from launch.errors import LaunchError
from launch.fsutil import launch_home
from toolkit.fsutil import atomic_write_bytes, atomic_write_text

NVIDIA_MAJOR = 195
MARKER_VAR = "LAUNCH_CLUSTER_STATE"
TEMPLATES = Path(__file__).with_name("templates")
# Order matters: each daemon needs the ones before it.
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


def _port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _proc_environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return b""


def _real_gpu_nodes() -> list[str]:
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


class EmbeddedCluster:
    """A real single-node Slurm (with accounting) living entirely in `state_dir`."""

    def __init__(self, state_dir: str | os.PathLike[str] | None = None) -> None:
        self.state_dir = Path(state_dir or default_state_dir()).resolve()
        self.etc = self.state_dir / "etc"
        self.run_dir = self.state_dir / "run"
        self.log_dir = self.state_dir / "log"
        self.dev_dir = self.state_dir / "dev"
        self.state_file = self.state_dir / "cluster.json"
        self.slurm_conf = self.etc / "slurm.conf"
        self.munge_socket = self.run_dir / "munge.socket"

    # ------------------------------------------------------------------ queries
    def read_state(self) -> dict | None:
        try:
            return json.loads(self.state_file.read_text())
        except FileNotFoundError:
            return None
        except json.JSONDecodeError as exc:
            raise LaunchError(f"{self.state_file}: unreadable cluster state ({exc}); "
                              "run `launch cluster down` to clean up") from exc

    def _marker(self) -> bytes:
        return f"{MARKER_VAR}={self.state_dir}".encode()

    def _is_ours(self, pid: int) -> bool:
        return self._marker() in _proc_environ(pid).split(b"\0")

    def running_daemons(self) -> dict[str, int]:
        state = self.read_state() or {}
        return {name: pid for name, pid in state.get("pids", {}).items() if self._is_ours(pid)}

    def is_up(self) -> bool:
        state = self.read_state()
        return bool(state) and set(self.running_daemons()) == set(DAEMONS)

    def env(self) -> dict[str, str]:
        """Variables that point Slurm's client commands (and submitit) at this cluster."""
        return {"SLURM_CONF": str(self.slurm_conf)}

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
           epilog: str | None = None, partition: str = "debug",
           progress: Progress | None = None, timeout: float = 60) -> bool:
        """Start the cluster. Returns False (and changes nothing) when it is already up."""
        say = progress or (lambda _msg: None)
        if self.is_up():
            return False
        if self.read_state():
            say("found a partly running cluster from an earlier `up`; stopping its leftovers first")
            self.down(progress=progress)
        self._check_prerequisites()
        for d in (self.etc, self.run_dir, self.log_dir, self.dev_dir, self.state_dir / "spool" / "ctld",
                  self.state_dir / "spool" / "d", self.state_dir / "munge", self.state_dir / "mysql"):
            d.mkdir(parents=True, exist_ok=True)
        os.chmod(self.state_dir, 0o755)

        gpu_files, stand_in = self._gpu_files(gpus)
        ports = {k: _free_port() for k in ("slurmctld", "slurmd", "slurmdbd", "mariadb")}
        db_password = secrets.token_hex(16)
        node_name = socket.gethostname().split(".")[0]
        cpus = cpus or os.cpu_count() or 1
        self._render_configs(node_name, cpus, gpu_files, ports, db_password, prolog, epilog, partition)
        self._write_munge_key()
        state = {"pids": {}, "ports": ports, "node": node_name, "cpus": cpus, "gpus": len(gpu_files),
                 "stand_in_gpus": stand_in, "gpu_files": gpu_files, "partition": partition,
                 "prolog": prolog, "epilog": epilog, "started_at": time.time()}
        self._save_state(state)

        self._init_mariadb(say)
        try:
            for spec in self._daemon_specs(node_name, ports):
                t0 = time.monotonic()
                say(f"starting {spec.name} ...")
                pid = self._spawn(spec)
                state["pids"][spec.name] = pid
                self._save_state(state)
                self._wait(spec, pid, timeout)
                if spec.name == "mariadb":
                    self._create_accounting_user(db_password)
                say(f"  {spec.name} up (pid {pid}, {time.monotonic() - t0:.1f} s)")
            self._wait_node_idle(node_name, timeout, say)
        except BaseException:
            self.down()
            raise
        return True

    def _check_prerequisites(self) -> None:
        missing = sorted({pkg for binary, pkg in REQUIRED_BINARIES.items() if not shutil.which(binary)
                          and not Path("/usr/sbin", binary).exists()})
        if missing:
            raise LaunchError("missing Debian packages for the embedded cluster: " + " ".join(missing)
                              + f"; install with: apt-get install -y {' '.join(missing)} (or run `make deps`)")
        if os.geteuid() != 0:
            raise LaunchError("the embedded cluster runs slurmd, which must run as root "
                              "(it starts jobs for other users); run `launch cluster up` as root")

    def _gpu_files(self, gpus: int | None) -> tuple[list[str], bool]:
        real = _real_gpu_nodes()
        if real:
            count = len(real) if gpus is None else gpus
            if count > len(real):
                raise LaunchError(f"--gpus {count} asked for, but this machine has {len(real)} NVIDIA GPUs")
            return real[:count], False
        count = gpus or 0
        files = []
        for i in range(count):
            node = self.dev_dir / f"nvidia{i}"
            if node.exists() and not stat.S_ISCHR(node.stat().st_mode):
                node.unlink()
            if not node.exists():
                try:
                    os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(NVIDIA_MAJOR, i))
                except PermissionError as exc:
                    raise LaunchError(f"cannot create stand-in GPU node {node} ({exc}); "
                                      "mknod needs root with CAP_MKNOD") from exc
            files.append(str(node))
        return files, True

    def _render_configs(self, node_name: str, cpus: int, gpu_files: list[str], ports: dict[str, int],
                        db_password: str, prolog: str | None, epilog: str | None, partition: str) -> None:
        mem_mb = int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**20 * 0.9)
        gpu_expr = ",".join(gpu_files)
        context = dict(
            managed="Generated by `launch cluster up`; edits are overwritten on the next up.",
            cluster_name="embedded",
            controller_host=node_name, controller_addr="127.0.0.1",
            slurmctld_port=ports["slurmctld"], slurmd_port=ports["slurmd"],
            slurmdbd_host="127.0.0.1", slurmdbd_port=ports["slurmdbd"], dbd_host=node_name,
            slurm_user="root", munge_socket=str(self.munge_socket),
            state_save_dir=str(self.state_dir / "spool" / "ctld"),
            slurmd_spool_dir=str(self.state_dir / "spool" / "d"),
            run_dir=str(self.run_dir), log_dir=str(self.log_dir),
            # Declared CPUs/memory may exceed the hardware (stand-in nodes on a small CI box).
            slurmd_parameters="config_overrides",
            # No cgroup hierarchy is delegated to us inside a container: track by process tree.
            proctrack_type="proctrack/linuxproc", task_plugin="task/none",
            # Start a submitted batch job at once (Slurm's default waits up to 3 s to batch them).
            scheduler_parameters="batch_sched_delay=0,sched_min_interval=0",
            prolog=prolog or "", epilog=epilog or "",
            nodes=[dict(name=node_name, addr="127.0.0.1", cpus=cpus, memory_mb=mem_mb,
                        gpus=len(gpu_files), gpu_files=gpu_expr)],
            partition=partition,
            storage_host="127.0.0.1", storage_port=ports["mariadb"], storage_user="slurm",
            storage_pass=db_password, storage_db="slurm_acct_db",
        )
        atomic_write_text(self.slurm_conf, render_template("slurm.conf.j2", **context))
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
        proc = subprocess.run(
            ["mariadb-install-db", "--no-defaults", f"--datadir={datadir}", "--user=root",
             "--auth-root-authentication-method=socket", "--skip-test-db"],
            capture_output=True, text=True)
        if proc.returncode != 0:
            raise LaunchError(f"mariadb-install-db failed: {proc.stderr.strip().splitlines()[-1:]}")

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

    def _daemon_specs(self, node_name: str, ports: dict[str, int]) -> list[DaemonSpec]:
        conf = str(self.slurm_conf)
        log = self.log_dir
        return [
            DaemonSpec("mariadb", [
                "mariadbd", "--no-defaults", f"--datadir={self.state_dir / 'mysql'}", "--user=root",
                f"--port={ports['mariadb']}", "--bind-address=127.0.0.1",
                f"--socket={self.run_dir / 'mysqld.sock'}", f"--pid-file={self.run_dir / 'mysqld.pid'}",
                f"--log-error={log / 'mariadb.log'}", "--innodb-buffer-pool-size=32M",
                "--skip-name-resolve"],
                lambda: _port_open(ports["mariadb"]), log / "mariadb.out"),
            DaemonSpec("munged", [
                "munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                f"--key-file={self.etc / 'munge.key'}", f"--pid-file={self.run_dir / 'munged.pid'}",
                f"--log-file={log / 'munged.log'}", f"--seed-file={self.state_dir / 'munge' / 'seed'}"],
                lambda: self.munge_socket.exists(), log / "munged.out"),
            DaemonSpec("slurmdbd", ["slurmdbd", "-D"],
                       lambda: _port_open(ports["slurmdbd"]), log / "slurmdbd.out"),
            DaemonSpec("slurmctld", ["slurmctld", "-D", "-f", conf],
                       lambda: _port_open(ports["slurmctld"]), log / "slurmctld.out"),
            DaemonSpec("slurmd", ["slurmd", "-D", "-f", conf, "-N", node_name],
                       lambda: _port_open(ports["slurmd"]), log / "slurmd.out"),
        ]

    def _spawn(self, spec: DaemonSpec) -> int:
        env = {**os.environ, **self.env(), MARKER_VAR: str(self.state_dir)}
        # slurmdbd finds its config beside slurm.conf.
        env.pop("SLURM_JOB_ID", None)
        with open(spec.log, "ab") as out:
            proc = subprocess.Popen(spec.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                    env=env, cwd=self.state_dir, start_new_session=True)
        atomic_write_text(self.run_dir / f"launch-{spec.name}.pid", f"{proc.pid}\n")
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

    def _log_hint(self, name: str) -> str:
        logs = [self.log_dir / f"{name}.log", self.log_dir / f"{name}.out"]
        for log in logs:
            if log.exists() and log.stat().st_size:
                lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
                last = lines[-1] if lines else ""
                return f"last log line ({log}): {last[-300:]}"
        return f"see {self.log_dir}"

    def _wait_node_idle(self, node: str, timeout: float, say: Progress) -> None:
        deadline = time.monotonic() + timeout
        state = ""
        while time.monotonic() < deadline:
            proc = self.slurm("sinfo", "-h", "-N", "-n", node, "-o", "%T", check=False)
            state = proc.stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                say(f"node {node} is {state}")
                return
            time.sleep(0.3)
        raise LaunchError(f"node {node} did not become idle (state {state!r}); {self._log_hint('slurmd')}")

    # ------------------------------------------------------------------ down
    def down(self, progress: Progress | None = None, timeout: float = 20) -> list[str]:
        """Stop what `up` started. Returns the names of the daemons that were stopped."""
        say = progress or (lambda _msg: None)
        state = self.read_state()
        if state is None:
            return []
        running = self.running_daemons()
        if {"slurmctld", "slurmd"} <= set(running):
            # Jobs first, so their steps end cleanly before slurmd goes.
            self.slurm("scancel", "--full", "--user", str(os.geteuid()), check=False)
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                q = self.slurm("squeue", "-h", "-o", "%i", check=False)
                if q.returncode != 0 or not q.stdout.strip():
                    break
                time.sleep(0.3)
        stopped = []
        for name in reversed(DAEMONS):
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
        for name in DAEMONS:
            (self.run_dir / f"launch-{name}.pid").unlink(missing_ok=True)
        self.state_file.unlink(missing_ok=True)
        return stopped

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
    def status_text(self) -> str:
        state = self.read_state()
        if state is None:
            return f"no embedded cluster in {self.state_dir} (start one with `launch cluster up`)"
        running = self.running_daemons()
        lines = [f"embedded cluster in {self.state_dir}",
                 f"SLURM_CONF={self.slurm_conf}", "", "daemon      pid      state"]
        for name in DAEMONS:
            pid = state.get("pids", {}).get(name)
            lines.append(f"{name:<11} {pid or '-':<8} {'running' if name in running else 'STOPPED'}")
        if {"slurmctld", "slurmd"} <= set(running):
            sinfo = self.slurm("sinfo", "-N", "-o", "%N %P %T %C %m %G", check=False)
            lines += ["", "node/partition (CPUs alloc/idle/other/total, memory MB, GRES):",
                      sinfo.stdout.rstrip() or sinfo.stderr.strip()]
            if state.get("stand_in_gpus") and state.get("gpus"):
                lines.append(f"GPUs: {state['gpus']} stand-in devices (major {NVIDIA_MAJOR}) in {self.dev_dir}")
        return "\n".join(lines)
