"""DFlash batches: from extraction shards (offline), padded and bucketed.

A batch is a dict of tensors:
    input_ids [B, T] long, lengths [B] long, loss_mask [B, T] bool (1 = response token; all on for
    shards written before loss masks), hidden [B, T, n_layers*H] (target context),
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
from train.dflash.model import TargetShape
from train.extract.shards import (
    HEAD,
    ShardEntry,
    ShardError,
    extraction_id,
    nonfinite,
    read_index,
    read_meta,
    shard_keys,
    verify_shard,
)


class ShardDataset:
    """Random access to the samples of an extraction directory (train/extract/shards.py).

    Each shard is verified when it is first opened: its sha256 against the index (a same-size bit
    flip changes nothing else) and every hidden state finite. A shard that fails is reported once
    (`shard: reason`) and its samples are skipped, as long as the bad shards stay within
    `max_bad_fraction` of all shards; beyond that the run stops with a ShardError.
    """

    def __init__(self, root: str | Path, max_bad_fraction: float = 0.01, report=print) -> None:
        self.root = Path(root)
        if self.root.is_file():
            raise ShardError(f"{self.root}: a file, not an extraction directory (--data takes the directory "
                             "`launch submit extract` wrote)")
        if not self.root.is_dir():
            raise ShardError(f"{self.root}: no such extraction directory (run `launch submit extract` first)")
        self.meta: dict[str, Any] = read_meta(self.root)
        if not any(self.root.glob("index.*.json")):
            raise ShardError(f"{self.root}: no index.*.json beside meta.json; the extraction never finished a "
                             "shard or its index was deleted (re-run it with the same arguments to re-index)")
        index = read_index(self.root)
        n = int(self.meta["samples"])
        self.lengths = np.zeros(n, dtype=np.int64)
        self.shard_of: dict[int, Path] = {}
        self.entries: dict[Path, ShardEntry] = {}
        for name, entry in sorted(index.items()):
            path = self.root / name
            if entry.location != "local":
                raise ShardError(f"{path}: shard was synced to another store and deleted here; "
                                 "point --data at a directory holding all shards")
            if not path.is_file():
                raise ShardError(f"{path}: shard listed in the index is missing; re-run extraction to rewrite it")
            if path.stat().st_size != entry.bytes:
                raise ShardError(f"{path}: corrupt shard ({path.stat().st_size} bytes, index says {entry.bytes}); "
                                 "delete it and re-run extraction to rewrite it")
            shard_keys(path)  # header parses and matches the file size
            self.entries[path] = entry
            for idx, length in zip(entry.samples, entry.lengths, strict=True):
                if idx >= n:
                    raise ShardError(f"{self.root}: index lists sample {idx} in {name}; meta.json says the "
                                     f"extraction has {n} samples (an index of another extraction?)")
                if idx in self.shard_of:
                    raise ShardError(f"{self.root}: index lists sample {idx} in both {self.shard_of[idx].name} "
                                     f"and {name}; restore the index or re-run extraction into a new directory")
                self.shard_of[idx] = path
                self.lengths[idx] = length
        missing = n - len(self.shard_of)
        if missing:
            raise ShardError(f"{self.root}: {missing} of {n} samples have no shard; the extraction is incomplete "
                             "(re-run it with the same arguments to finish)")
        stray = sorted(p.name for p in self.root.glob("shard_*.safetensors") if p not in self.entries)
        if stray:
            report(f"# ignoring {', '.join(stray[:3])}{' ...' if len(stray) > 3 else ''}: not in the index "
                   f"({len(stray)} file(s); a shard enters the index only once written whole)")
        self.layers: list[int] = list(self.meta["layers"])
        self.hidden_size = int(self.meta["hidden_size"])
        self.identity = extraction_id(self.meta)
        self.max_bad_fraction = max_bad_fraction
        self.report = report
        self.verified: set[Path] = set()
        self.bad: dict[Path, str] = {}
        self.vocab: int | None = None  # the target's, once head_weights() has read it: ids past it are a bad shard

    def __len__(self) -> int:
        return len(self.lengths)

    def target_shape(self, head_vocab: int) -> TargetShape:
        """The target's config as extraction recorded it (older directories: from the stage-1 preset)."""
        if "target_config" in self.meta:
            try:
                return TargetShape(**self.meta["target_config"])
            except TypeError as exc:
                raise ShardError(f"{self.root / 'meta.json'}: unreadable target_config ({exc})") from None
        from train.common.shapes import get_shape
        from train.stage1.model import text_config

        cfg = text_config(get_shape(self.meta["preset"]), vocab_size=head_vocab)
        return TargetShape.from_config(cfg)

    def head_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's embedding and lm_head, as wide as meta.json's hidden size."""
        from safetensors.torch import load_file

        path = self.root / HEAD
        try:
            head = load_file(str(path))
            embed, lm_head = head["embed_tokens"], head["lm_head"]
        except Exception as exc:
            raise ShardError(f"{path}: unreadable target head ({(str(exc).splitlines() or [repr(exc)])[0]})") from None
        widths = {embed.shape[-1], lm_head.shape[-1]}
        if widths != {self.hidden_size}:
            raise ShardError(f"{path}: the target head is {max(widths)} wide, meta.json says hidden_size "
                             f"{self.hidden_size}; the directory mixes two extractions")
        self.vocab = int(embed.shape[0])
        return embed, lm_head

    def check_target(self, target: TargetShape) -> None:
        """meta.json's layers and hidden size are the target's own (ShardError otherwise)."""
        bad = [i for i in self.layers if not 0 <= int(i) < target.num_hidden_layers]
        if not self.layers or bad:
            raise ShardError(f"{self.root / 'meta.json'}: layers {self.layers} do not lie in the target's "
                             f"{target.num_hidden_layers} layers [0, {target.num_hidden_layers - 1}]")
        if target.hidden_size != self.hidden_size:
            raise ShardError(f"{self.root / 'meta.json'}: hidden_size {self.hidden_size}, the target's config "
                             f"says {target.hidden_size}")

    def _problem(self, got: dict[int, dict[str, torch.Tensor]], metadata: dict[str, str]) -> str | None:
        """Why these samples of a shard do not belong to this extraction (another one wrote the
        shard; shapes other than meta.json's layers x hidden size and the index's lengths), or None."""
        width = len(self.layers) * self.hidden_size
        for i, t in got.items():
            lacking = [k for k in REQUIRED_KEYS if k not in t]
            if lacking:
                return f"sample {i} has no {', '.join(lacking)}"
            n = int(self.lengths[i])
            shapes = {"hidden": (n, width), "final": (n, self.hidden_size), "input_ids": (n,), "loss_mask": (n,)}
            for key, want in shapes.items():
                if key in t and tuple(t[key].shape) != want:
                    return (f"{i}.{key} has shape {list(t[key].shape)}, expected {list(want)} "
                            f"({len(self.layers)} layers x hidden {self.hidden_size}, {n} tokens per meta.json "
                            "and the index)")
            ids = t["input_ids"]
            if self.vocab is not None and ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < self.vocab:
                return (f"{i}.input_ids holds token ids in [{int(ids.min())}, {int(ids.max())}], outside the "
                        f"target's vocabulary [0, {self.vocab})")
        theirs = metadata.get("extraction")  # shards written before extraction ids carry none
        if theirs is not None and theirs != self.identity:
            return f"written by another extraction (id {theirs}; meta.json's is {self.identity})"
        return None

    def _reject(self, path: Path, reason: str) -> None:
        self.bad[path] = reason
        frac = len(self.bad) / max(1, len(self.entries))
        if frac > self.max_bad_fraction:
            raise ShardError(f"{path}: {reason}; {len(self.bad)} of {len(self.entries)} shards bad "
                             f"({100 * frac:.1f}% > --max-bad-fraction {100 * self.max_bad_fraction:.1f}%); "
                             "delete it and re-run extraction to rewrite it")
        self.report(f"# skipping {path}: {reason} ({len(self.bad)} of {len(self.entries)} shards skipped, "
                    f"within --max-bad-fraction {100 * self.max_bad_fraction:.1f}%)")

    def batch(self, sample_ids: np.ndarray | list[int]) -> dict[str, torch.Tensor] | None:
        """The padded batch of these samples, less those in bad shards; None if none is left."""
        from safetensors import safe_open

        ids = [int(i) for i in sample_ids]
        by_shard: dict[Path, list[int]] = {}
        for i in ids:
            by_shard.setdefault(self.shard_of[i], []).append(i)
        loaded: dict[int, dict[str, torch.Tensor]] = {}
        for path, members in by_shard.items():
            if path in self.bad:
                continue
            if path not in self.verified:
                reason = verify_shard(path, self.entries[path])
                if reason is not None:
                    self._reject(path, f"corrupt shard ({reason})")
                    continue
            try:
                with safe_open(str(path), framework="pt") as f:
                    metadata = f.metadata() or {}
                    keys = set(f.keys())
                    got = {i: {k: f.get_tensor(f"{i}.{k}") for k in SAMPLE_KEYS if f"{i}.{k}" in keys}
                           for i in members}
            except Exception as exc:  # safetensors' own error types for a damaged file
                raise ShardError(f"{path}: corrupt shard ({str(exc).splitlines()[0]}); "
                                 "delete it and re-run extraction to rewrite it") from None
            problem = self._problem(got, metadata)
            if problem is not None:
                self._reject(path, problem)
                continue
            bad = [f"{i}.{k}" for i, t in got.items() for k in nonfinite(t)]
            if bad:
                self._reject(path, f"non-finite hidden states ({', '.join(bad[:3])})")
                continue
            self.verified.add(path)
            loaded.update(got)
        kept = [loaded[i] for i in ids if i in loaded]
        return pad_samples(kept) if kept else None


SAMPLE_KEYS = ("input_ids", "loss_mask", "hidden", "final")
REQUIRED_KEYS = ("input_ids", "hidden", "final")  # shards written before loss masks have none


def pad_samples(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    lengths = torch.tensor([len(s["input_ids"]) for s in samples])
    t = int(lengths.max())
    out = {"lengths": lengths, "input_ids": torch.zeros(len(samples), t, dtype=torch.long),
           "loss_mask": torch.zeros(len(samples), t, dtype=torch.bool)}
    for key in ("hidden", "final"):
        if key in samples[0]:
            out[key] = torch.zeros(len(samples), t, samples[0][key].shape[-1], dtype=torch.float32)
    for r, s in enumerate(samples):
        n = len(s["input_ids"])
        out["input_ids"][r, :n] = s["input_ids"].long()
        out["loss_mask"][r, :n] = s["loss_mask"].bool() if "loss_mask" in s else True
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
