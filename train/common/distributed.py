"""torch.distributed from the Slurm environment, on one node or across several.

Layout: the global rank is SLURM_PROCID, the world SLURM_NTASKS, the local rank (which GPU)
SLURM_LOCALID and the node rank SLURM_NODEID, as `submitit`'s Slurm job environment reads
them. Without SLURM_PROCID (a batch script that did not go through srun) the rank follows
from SLURM_NODEID, SLURM_LOCALID and SLURM_TASKS_PER_NODE, Slurm's block distribution.

Rendezvous, one per job start: a file store (torch's FileStore) in the job's own folder
($LAUNCH_JOB_DIR, 0700, which every node of a job already shares: submitit reads its pickles
there), named by the secret the job's script makes at each start ($LAUNCH_RENDEZVOUS_TOKEN). Only
the job's user can open it, so no other local user can read the ranks' addresses or set a key,
and there is no port to learn in advance or to take first. A folder whose file system has no
file locks cannot hold it: a multi-rank job there stops in one line. An explicit MASTER_PORT
(a harness outside `launch`) keeps torch's TCP store on the job's first node (the first host of
SLURM_JOB_NODELIST, at the NodeAddr Slurm reaches it at, else its host name; 127.0.0.1 on one
node; MASTER_ADDR overrides it), which any local user can connect to. The collective backend
opens its own ports (gloo on CPU, NCCL on GPUs), which a real cluster's firewall must let the
nodes of a job reach.

Outside Slurm (tests of the trainer internals) it is world size 1 and, by default, no
process group at all.
"""

from __future__ import annotations

import datetime
import fcntl
import functools
import ipaddress
import os
import re
import shutil
import socket
import stat
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

# Rendezvous ports: 20000-31999, below Linux's ephemeral range (32768-60999), so no outgoing
# connection of the node can hold the port, and well away from Slurm's (6817-6819).
PORT_BASE = 20000
PORT_SPAN = 12000


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    backend: str
    initialized_here: bool
    node_rank: int = 0
    num_nodes: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _port_for_job(job_id: str) -> int:
    # Per job, so two jobs on one node do not collide (ids are unique within a cluster).
    digits = "".join(ch for ch in job_id if ch.isdigit()) or "0"
    return PORT_BASE + int(digits) % PORT_SPAN


def _tasks_per_node(value: str) -> list[int]:
    """SLURM_TASKS_PER_NODE ('2(x3),1') -> [2, 2, 2, 1]."""
    counts: list[int] = []
    for part in filter(None, value.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if not m:
            raise ValueError(f"SLURM_TASKS_PER_NODE={value!r} is not Slurm's 'N(xK),M' form")
        counts += [int(m[1])] * int(m[2] or 1)
    return counts


def _global_rank(env_rank: int) -> int:
    """SLURM_PROCID when srun set it; else block distribution from node id and local id."""
    if os.environ.get("SLURM_PROCID") is not None:
        return env_rank
    node = int(os.environ.get("SLURM_NODEID", 0))
    local = int(os.environ.get("SLURM_LOCALID", 0))
    per_node = _tasks_per_node(os.environ.get("SLURM_TASKS_PER_NODE", "1"))
    return sum(per_node[:node]) + local


@functools.lru_cache(maxsize=8)
def node_address(host: str, timeout: float = 20.0) -> str:
    """The address Slurm reaches node `host` at (its NodeAddr), else the host name itself.

    NodeAddr is what slurmctld and srun use, so it is reachable from the job's other nodes
    whenever Slurm works; a node without NodeAddr reports its NodeName, which then resolves
    through DNS as usual. No scontrol (a container image without Slurm's clients): the name.
    """
    if shutil.which("scontrol") is None:
        return host
    try:
        proc = subprocess.run(["scontrol", "-o", "show", "node", host], capture_output=True, text=True,
                              timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return host
    m = re.search(r"\bNodeAddr=(\S+)", proc.stdout) if proc.returncode == 0 else None
    return m[1] if m else host


def slurm_layout() -> tuple[int, int, int, str, int]:
    """(rank, world_size, local_rank, master_addr, master_port) from the Slurm environment."""
    if not os.environ.get("SLURM_JOB_ID"):
        return 0, 1, 0, "127.0.0.1", int(os.environ.get("MASTER_PORT", 29500))
    from submitit.slurm.slurm import SlurmJobEnvironment

    env = SlurmJobEnvironment()
    master_addr = os.environ.get("MASTER_ADDR")
    if not master_addr:
        hosts = env.hostnames
        # one node: no need to resolve its name
        master_addr = node_address(hosts[0]) if env.num_nodes > 1 and hosts else "127.0.0.1"
    master_port = int(os.environ.get("MASTER_PORT") or _port_for_job(env.job_id))
    return _global_rank(env.global_rank), env.num_tasks, env.local_rank, master_addr, master_port


def node_layout() -> tuple[int, int]:
    """(node_rank, num_nodes) of this task: SLURM_NODEID of SLURM_JOB_NUM_NODES; (0, 1) outside Slurm."""
    if not os.environ.get("SLURM_JOB_ID"):
        return 0, 1
    return int(os.environ.get("SLURM_NODEID", 0)), int(os.environ.get("SLURM_JOB_NUM_NODES")
                                                         or os.environ.get("SLURM_NNODES") or 1)


def _bind_address(addr: str, nodes: int) -> str:
    """Where rank 0 listens: `addr` itself, except when the job spans nodes and `addr` (a host
    name, no NodeAddr) resolves to a loopback address here (Debian's 127.0.1.1 for the own
    host name): then every address, as torch's own store does, or the other nodes could not connect."""
    if nodes <= 1:
        return addr
    try:
        ipaddress.ip_address(addr)
        return addr  # a NodeAddr given as an address: the other nodes reach it there (127.0.0.x on one host too)
    except ValueError:
        pass
    try:
        resolved = ipaddress.ip_address(socket.getaddrinfo(addr, None)[0][4][0])
    except (OSError, ValueError, IndexError):
        return ""
    return "" if resolved.is_loopback else addr


def rendezvous_store(addr: str, port: int, rank: int, world: int, nodes: int = 1,
                     timeout_s: float = 600) -> dist.Store:
    """The job's rendezvous: rank 0's TCPStore listening on `addr` alone (the master node's
    address, 127.0.0.1 on one node), not on every address as torch's own would, and every key
    under the job's secret prefix (LAUNCH_RENDEZVOUS_TOKEN, made in the job): a local user who
    connects to the port can neither read nor set the job's keys."""
    fd = None
    if rank == 0:
        family = socket.AF_INET6 if ":" in addr else socket.AF_INET
        server = socket.socket(family, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((_bind_address(addr, nodes), port))
        server.listen(max(world, 16))
        fd = server.detach()  # the store owns the listening socket from here
    store = dist.TCPStore(addr, port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=timeout_s),
                          master_listen_fd=fd, wait_for_workers=False)
    token = os.environ.get("LAUNCH_RENDEZVOUS_TOKEN") or os.environ.get("SLURM_JOB_ID") or "local"
    return dist.PrefixStore(f"job-{token}", store)  # keys: job-<token>/<key>


class RendezvousError(RuntimeError):
    """The job's rendezvous cannot be had as it must be (one line)."""


def file_rendezvous(rank: int, world: int, timeout_s: float = 600) -> dist.Store | None:
    """The job's authenticated rendezvous: a FileStore at $LAUNCH_JOB_DIR/.rendezvous-<token>,
    created 0600 in the job's 0700 folder; None outside a `launch` job (no folder or token)."""
    job_dir, token = os.environ.get("LAUNCH_JOB_DIR"), os.environ.get("LAUNCH_RENDEZVOUS_TOKEN")
    if not job_dir or not token:
        return None
    if not re.fullmatch(r"[0-9a-f]{16,64}", token):
        raise RendezvousError("LAUNCH_RENDEZVOUS_TOKEN is not the job's hex secret; the rendezvous is not made")
    folder = Path(job_dir)
    try:
        st = folder.stat()
    except OSError as exc:
        raise RendezvousError(f"the job folder {folder} cannot hold the rendezvous ({exc.strerror})") from None
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise RendezvousError(f"the job folder {folder} is not private (mode {stat.S_IMODE(st.st_mode):o}, uid "
                              f"{st.st_uid}); the rendezvous would be open to other users")
    path = folder / f".rendezvous-{token}"
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        with open(path, "rb") as f:  # the store's own lock: a file system without flock cannot hold it
            fcntl.flock(f.fileno(), fcntl.LOCK_SH | fcntl.LOCK_NB)
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)
    except BlockingIOError:
        pass  # another rank holds it this instant: locks work
    except OSError as exc:
        raise RendezvousError(f"the job folder {folder} cannot hold the rendezvous file ({exc.strerror}; a file "
                              "system without file locks): a multi-rank job needs one; set --runs-dir elsewhere") from None
    store = dist.FileStore(str(path), world)
    store.set_timeout(datetime.timedelta(seconds=timeout_s))
    return store


def init_distributed(device: torch.device, force_group: bool = False) -> DistInfo:
    """Initialise torch.distributed (gloo on CPU, nccl on CUDA) if world size > 1 or forced.

    `force_group` makes a 1-rank group, which DeepSpeed needs even for one process.
    """
    explicit_port = bool(os.environ.get("MASTER_PORT"))
    rank, world, local_rank, addr, port = slurm_layout()
    node_rank, num_nodes = node_layout()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, addr, port, backend, False,
                        node_rank, num_nodes)
    if world == 1 and not force_group:
        return DistInfo(0, 1, 0, addr, port, backend, False, node_rank, num_nodes)
    os.environ.update(
        MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(local_rank), NODE_RANK=str(node_rank),
    )
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    if world == 1:  # DeepSpeed's group of one process: nothing to meet, no file, no port
        store = dist.HashStore()
    else:
        store = None if explicit_port else file_rendezvous(rank, world)
    if store is None and not explicit_port:
        raise RendezvousError(f"a {world}-rank job outside `launch` has no private folder for its rendezvous "
                              "(LAUNCH_JOB_DIR, LAUNCH_RENDEZVOUS_TOKEN); submit it with `launch submit`, or set "
                              "MASTER_PORT for torch's TCP store (any local user can reach it)")
    if store is None:
        store = rendezvous_store(addr, port, rank, world, num_nodes)
    dist.init_process_group(backend=backend, store=store, rank=rank, world_size=world)
    return DistInfo(rank, world, local_rank, addr, port, backend, True, node_rank, num_nodes)


def shutdown_distributed(info: DistInfo) -> None:
    if info.initialized_here and dist.is_initialized():
        # gloo's worker threads free a finished collective's tensors after its waiter returns, and
        # need the GIL for it; the group's destructor (run when DDP's reducer lets go of it) joins
        # them while holding the GIL. A rank that got there first hung after its last step (seen
        # with the per-rank timing all_gather). So: every rank past its last collective, then a
        # moment without the GIL for the workers to finish, then the teardown.
        dist.barrier()
        time.sleep(0.2)
        dist.destroy_process_group()
