"""One real GPU held: a share of its memory plus a small matmul every `--period` seconds.

Started by `CudaHolder` with CUDA_VISIBLE_DEVICES set to one GPU. Prints `ready <bytes>` once
the memory is taken; exits on SIGTERM, which is how the holder releases the GPU (process exit
frees the memory and the CUDA context).
"""

from __future__ import annotations

import argparse
import signal
import sys
import threading

# Leave room so a job starting right after a release never races our allocator's slack.
_HEADROOM_BYTES = 256 << 20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launch.keepalive.cuda_worker")
    parser.add_argument("--mem-fraction", type=float, required=True)
    parser.add_argument("--period", type=float, default=1.0)
    args = parser.parse_args(argv)

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())

    import torch

    torch.cuda.set_device(0)
    free, total = torch.cuda.mem_get_info()
    take = max(0, min(int(total * args.mem_fraction), free - _HEADROOM_BYTES))
    block = torch.empty(take, dtype=torch.uint8, device="cuda")  # noqa: F841 (held, not used)
    a = torch.randn(256, 256, device="cuda")
    torch.cuda.synchronize()
    print(f"ready {take}", flush=True)
    while not stop.wait(args.period):
        (a @ a).sum().item()  # a light kernel so the GPU never idles into a low clock state
    return 0


if __name__ == "__main__":
    sys.exit(main())
