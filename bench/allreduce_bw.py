"""All-reduce bus bandwidth between the GPUs of one host, through torch.distributed + NCCL.

What ZeRO-2's gradient reduce-scatter and parameter all-gather ride on. One process per GPU;
bus bandwidth = size * 2 (n - 1) / n / time (NCCL-tests' convention). NVLink multicast stays off.

    python bench/allreduce_bw.py            # every visible GPU
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

os.environ.update(NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1")
SIZES_MB = (8, 64, 256, 1024)


def worker(rank: int, world: int, port: int) -> None:
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    for mb in SIZES_MB:
        x = torch.ones(mb * 2**20 // 2, dtype=torch.bfloat16, device="cuda")
        for _ in range(3):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        iters = 20
        start.record()
        for _ in range(iters):
            dist.all_reduce(x)
        end.record()
        torch.cuda.synchronize()
        sec = start.elapsed_time(end) / 1000 / iters
        busbw = x.numel() * 2 * 2 * (world - 1) / world / sec / 1e9
        if rank == 0:
            print(f"| {world} | {mb} MiB | {sec * 1e3:.3f} ms | {busbw:.1f} GB/s |", flush=True)
    dist.destroy_process_group()


def main() -> int:
    world = torch.cuda.device_count()
    if world < 2:
        print(f"allreduce_bw: needs 2 or more GPUs, this machine has {world}")
        return 1
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    print("| GPUs | size | time | bus bandwidth |\n|---:|---:|---:|---:|")
    mp.spawn(worker, args=(world, port), nprocs=world)
    return 0


if __name__ == "__main__":
    sys.exit(main())
