"""DFlash batches: from extraction shards (offline), padded and bucketed.

A batch is a dict of tensors:
    input_ids [B, T] long, lengths [B] long, hidden [B, T, n_layers*H] (target context),
    final [B, T, H] (target final hidden states; offline only, gathered at anchors before use).
Rows are right-padded with zeros; `lengths` says where each row ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from train.common.bucketing import BucketedSampler
from train.extract.shards import HEAD, ShardError, read_index, read_meta, shard_keys


class ShardDataset:
    """Random access to the samples of an extraction directory (train/extract/shards.py)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        if not self.root.is_dir():
            raise ShardError(f"{self.root}: no such extraction directory (run `launch submit extract` first)")
        self.meta: dict[str, Any] = read_meta(self.root)
        index = read_index(self.root)
        n = int(self.meta["samples"])
        self.lengths = np.zeros(n, dtype=np.int64)
        self.shard_of: dict[int, Path] = {}
        for name, entry in sorted(index.items()):
            path = self.root / name
            if entry.location != "local":
                raise ShardError(f"{path}: shard was synced to another store and deleted here; "
                                 "point --data at a directory holding all shards")
            if not path.is_file() or path.stat().st_size != entry.bytes:
                size = path.stat().st_size if path.is_file() else "missing"
                raise ShardError(f"{path}: corrupt shard ({size} bytes, index says {entry.bytes}); "
                                 "delete it and re-run extraction to rewrite it")
            shard_keys(path)  # header parses and matches the file size
            for idx, length in zip(entry.samples, entry.lengths, strict=True):
                self.shard_of[idx] = path
                self.lengths[idx] = length
        missing = n - len(self.shard_of)
        if missing:
            raise ShardError(f"{self.root}: {missing} of {n} samples have no shard; the extraction is incomplete "
                             "(re-run it with the same arguments to finish)")
        self.layers: list[int] = list(self.meta["layers"])
        self.hidden_size = int(self.meta["hidden_size"])

    def __len__(self) -> int:
        return len(self.lengths)

    def head_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        from safetensors.torch import load_file

        path = self.root / HEAD
        try:
            head = load_file(str(path))
        except Exception as exc:
            raise ShardError(f"{path}: unreadable target head ({str(exc).splitlines()[0]})") from None
        return head["embed_tokens"], head["lm_head"]

    def batch(self, sample_ids: np.ndarray | list[int]) -> dict[str, torch.Tensor]:
        from safetensors import safe_open

        ids = [int(i) for i in sample_ids]
        by_shard: dict[Path, list[int]] = {}
        for i in ids:
            by_shard.setdefault(self.shard_of[i], []).append(i)
        loaded: dict[int, dict[str, torch.Tensor]] = {}
        for path, members in by_shard.items():
            try:
                with safe_open(str(path), framework="pt") as f:
                    for i in members:
                        loaded[i] = {k: f.get_tensor(f"{i}.{k}") for k in ("input_ids", "hidden", "final")}
            except Exception as exc:  # safetensors' own error types for a damaged file
                raise ShardError(f"{path}: corrupt shard ({str(exc).splitlines()[0]}); "
                                 "delete it and re-run extraction to rewrite it") from None
        return pad_samples([loaded[i] for i in ids])


def pad_samples(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    t = int(lengths.max())
    out = {"lengths": lengths, "input_ids": torch.zeros(len(samples), t, dtype=torch.long)}
    for key in ("hidden", "final"):
        if key in samples[0]:
            out[key] = torch.zeros(len(samples), t, samples[0][key].shape[-1], dtype=torch.float32)
    for r, s in enumerate(samples):
        n = len(s["input_ids"])
        out["input_ids"][r, :n] = s["input_ids"].long()
        for key in ("hidden", "final"):
            if key in s:
                out[key][r, :n] = s[key].float()
    return out


def batch_stream(sampler: BucketedSampler, start_step: int = 0) -> Iterator[tuple[int, int, np.ndarray]]:
    """(global step, epoch, sample ids) forever: epoch after epoch of the bucketed shuffle.

    Step s is a pure function of (seed, s), so a resumed run continues with the same next batch.
    """
    step, epoch = 0, 0
    while True:
        batches = sampler.batches(epoch)
        if step + len(batches) <= start_step:
            step += len(batches)
            epoch += 1
            continue
        for b in batches:
            if step >= start_step:
                yield step, epoch, b
            step += 1
        epoch += 1
