"""torch.distributed from the Slurm environment.

Rank, world size and local rank come from `submitit`'s Slurm job environment (SLURM_PROCID,
SLURM_NTASKS, SLURM_LOCALID); the rendezvous is the first host of SLURM_JOB_NODELIST on a port
derived from the job id, so every rank of one job agrees without talking first. Outside Slurm
(tests of the trainer internals) it is world size 1 and, by default, no process group at all.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int
    backend: str
    initialized_here: bool

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _port_for_job(job_id: str) -> int:
    # A fixed range well away from Slurm's (6817-6819) and ephemeral ports; per job so two
    # jobs on one node do not collide.
    digits = "".join(ch for ch in job_id if ch.isdigit()) or "0"
    return 20000 + int(digits) % 20000


def slurm_layout() -> tuple[int, int, int, str, int]:
    """(rank, world_size, local_rank, master_addr, master_port) from the Slurm environment."""
    if not os.environ.get("SLURM_JOB_ID"):
        return 0, 1, 0, "127.0.0.1", int(os.environ.get("MASTER_PORT", 29500))
    from submitit.slurm.slurm import SlurmJobEnvironment

    env = SlurmJobEnvironment()
    hosts = env.hostnames
    master_addr = os.environ.get("MASTER_ADDR") or (hosts[0] if hosts else "127.0.0.1")
    if env.num_nodes == 1 and not os.environ.get("MASTER_ADDR"):
        master_addr = "127.0.0.1"  # one node: no need to resolve its name
    master_port = int(os.environ.get("MASTER_PORT") or _port_for_job(env.job_id))
    return env.global_rank, env.num_tasks, env.local_rank, master_addr, master_port


def init_distributed(device: torch.device, force_group: bool = False) -> DistInfo:
    """Initialise torch.distributed (gloo on CPU, nccl on CUDA) if world size > 1 or forced.

    `force_group` makes a 1-rank group, which DeepSpeed needs even for one process.
    """
    rank, world, local_rank, addr, port = slurm_layout()
    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_available() and dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, addr, port, backend, False)
    if world == 1 and not force_group:
        return DistInfo(0, 1, 0, addr, port, backend, False)
    os.environ.update(
        MASTER_ADDR=addr, MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
        LOCAL_RANK=str(local_rank),
    )
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group(backend=backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world)
    return DistInfo(rank, world, local_rank, addr, port, backend, True)


def shutdown_distributed(info: DistInfo) -> None:
    if info.initialized_here and dist.is_initialized():
        dist.destroy_process_group()
