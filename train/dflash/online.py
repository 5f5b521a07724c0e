"""Online DFlash: k target ranks feed m drafter ranks over torch.distributed ("k-m" topology).

Ranks 0..k-1 run the frozen target (base model only, hooks on the captured layers); ranks k..k+m-1
train the drafter, data-parallel (train.dflash.train: gradients all-reduced over their group).
Batch i of the stream is produced by target rank i % k and consumed by drafter rank k + i % m at
its step i // m, in order; with one drafter the stream is the same as offline training's for the
same seed. Each message is a
header (shapes) followed by the tensors, point-to-point (gloo on CPU, NCCL on GPU).

Back-pressure: a target keeps at most `queue_depth` messages in flight (isend); when the queue is
full it waits for the oldest to be received, so a slow drafter stalls the targets instead of
letting queued hidden states grow without bound. On NCCL that wait orders the target's compute
stream after the send (the host itself runs on), so the stall shows up on the target's GPU, and
`waits` counts full queues, not host blocks: on the H200s it read 36 of 40 whichever side was the
bottleneck (bench/RESULTS.md). The reference run used 6-1 on 8 GPUs (7-1 was
no faster and drew 1 kW more).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from train.dflash.args import parse_topology  # noqa: F401 - re-exported

FIELDS = ("input_ids", "lengths", "hidden", "anchors", "final_blocks", "loss_mask")


class BoundedSender:
    def __init__(self, dst: int, queue_depth: int, device: torch.device) -> None:
        self.dst = dst
        self.device = device  # NCCL sends CUDA tensors, gloo CPU ones
        self.depth = max(1, queue_depth)
        self.inflight: deque[list] = deque()  # per message: its works and tensors (kept alive until sent)
        self.waits = 0  # times the queue was full: the drafter was the bottleneck

    def send(self, batch: dict[str, torch.Tensor]) -> None:
        if len(self.inflight) >= self.depth:
            self.waits += 1
            self._wait_oldest()
        tensors = [batch[k].to(self.device, DTYPES[k]).contiguous() for k in FIELDS]
        header = torch.tensor([d for t in tensors for d in _padded_shape(t)], dtype=torch.long, device=self.device)
        works = [dist.isend(header, self.dst)] + [dist.isend(t, self.dst) for t in tensors]
        self.inflight.append([works, header, tensors])

    def _wait_oldest(self) -> None:
        works, *_ = self.inflight.popleft()
        for w in works:
            w.wait()

    def close(self) -> None:
        while self.inflight:
            self._wait_oldest()


DTYPES = {"input_ids": torch.long, "lengths": torch.long, "hidden": torch.float32, "anchors": torch.long,
          "final_blocks": torch.float32, "loss_mask": torch.long}
MAX_DIMS = 4


def _padded_shape(t: torch.Tensor) -> list[int]:
    return list(t.shape) + [-1] * (MAX_DIMS - t.dim())


def recv_batch(src: int, device: torch.device) -> dict[str, torch.Tensor]:
    header = torch.empty(MAX_DIMS * len(FIELDS), dtype=torch.long, device=device)
    dist.recv(header, src)
    out = {}
    for i, key in enumerate(FIELDS):
        shape = [d for d in header[i * MAX_DIMS:(i + 1) * MAX_DIMS].tolist() if d >= 0]
        t = torch.empty(shape, dtype=DTYPES[key], device=device)
        dist.recv(t, src)
        out[key] = t
    return out
