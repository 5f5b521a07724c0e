"""One real GPU held: a share of its memory plus a short burst of matmuls every `--period` s.

Started by `CudaHolder` with CUDA_VISIBLE_DEVICES set to one GPU. Prints `ready <bytes>` once
the memory is taken; exits on SIGTERM, which is how the holder releases the GPU (process exit
frees the memory and the CUDA context).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time

# Leave room so a job starting right after a release never races our allocator's slack.
_HEADROOM_BYTES = 256 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, prog="launch.keepalive.cuda_worker")
    parser.add_argument("--mem-fraction", type=float, required=True)
    parser.add_argument("--period", type=float, default=1.0, help="seconds between bursts")
    parser.add_argument("--busy-ms", type=float, default=20.0,
                        help="length of each burst: the GPU shows ~busy/period utilization")
    args = parser.parse_args(argv)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    import torch

    torch.cuda.set_device(0)
    free, total = torch.cuda.mem_get_info()
    take = max(0, min(int(total * args.mem_fraction), free - _HEADROOM_BYTES))
    block = torch.empty(take, dtype=torch.uint8, device="cuda")  # noqa: F841 (held, not used)
    a = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    print(f"ready {take}", flush=True)
    while not stop.wait(args.period):
        # a light load, so the GPU is visibly in use and never idles into its lowest clocks
        burst_end = time.monotonic() + args.busy_ms / 1e3
        while time.monotonic() < burst_end and not stop.is_set():
            a @ a
            torch.cuda.synchronize()
    # Skip interpreter teardown: the driver frees memory and context at process exit anyway,
    # and the holder's release (and so the job's start) waits for exactly this exit.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
