"""Bucketed shuffle vs sorted vs random, and batched vs per-sample shard writes (CPU).

    python bench/bucketing.py [--samples 902000] [--token-budget 65536] [--buckets N] [--write-samples 512]

Part 1: padding efficiency, batches and tokens per batch, and how many batches repeat in the next
epoch, on a synthetic length distribution shaped like the reference run (902k samples between
467 and 8192 tokens, bulk under 3k): sorted, full random, bucketed with optimised edges (the
fewest buckets within 3 points of sorted, or --buckets), bucketed with the optimised edges for
6 buckets, and bucketed with the reference run's edges.

Part 2: the extraction write rate, one safetensors file per sample against one per batch, both
atomic (tmp + fsync + rename) as train.extract writes them, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from train.common.bucketing import (
    REFERENCE_EDGES,
    BucketedSampler,
    batch_stats,
    composition_overlap,
    format_table,
    long_tail_lengths,
    optimal_edges,
    random_batches,
    sorted_batches,
)
from train.extract.shards import write_shard


def padding_table(n: int, budget: int, buckets: int | None, seed: int) -> str:
    lengths = long_tail_lengths(n, seed=seed)
    rows = []
    srt = sorted_batches(lengths, budget)
    rows.append(("sorted", batch_stats(srt, lengths), 1.0, "-"))
    r0, r1 = random_batches(lengths, budget, seed), random_batches(lengths, budget, seed + 1)
    rows.append(("random", batch_stats(r0, lengths), composition_overlap(r0, r1), "-"))
    for name, sampler in (
        ("bucketed, optimised (auto)", BucketedSampler(lengths, budget, n_buckets=buckets, seed=seed)),
        ("bucketed, optimised (6)", BucketedSampler(lengths, budget, edges=optimal_edges(lengths, 6), seed=seed)),
        ("bucketed, reference edges (6)", BucketedSampler(lengths, budget, edges=REFERENCE_EDGES, seed=seed)),
    ):
        e0, e1 = sampler.batches(0), sampler.batches(1)
        edges = sampler.edges if len(sampler.edges) <= 8 else f"{len(sampler.edges) - 1} buckets"
        rows.append((name, batch_stats(e0, lengths), composition_overlap(e0, e1), str(edges)))
    pct = np.percentile(lengths, [50, 90, 99])
    head = (f"# {n} samples, lengths {lengths.min()}..{lengths.max()} (p50 {pct[0]:.0f}, p90 {pct[1]:.0f}, "
            f"p99 {pct[2]:.0f}), token budget {budget} padded tokens per batch")
    return head + "\n" + format_table(rows)


def write_rate(n_samples: int, batch: int, hidden: int, n_layers: int, seed: int) -> str:
    rng = np.random.default_rng(seed)
    lengths = long_tail_lengths(n_samples, seed=seed, lo=64, hi=1024, median=200)
    samples = {i: {"input_ids": torch.zeros(int(n), dtype=torch.int32),
                   "hidden": torch.from_numpy(rng.standard_normal((int(n), n_layers * hidden), dtype=np.float32))
                   .to(torch.bfloat16)} for i, n in enumerate(lengths)}
    results = {}
    with tempfile.TemporaryDirectory(dir=".") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        for i, s in samples.items():
            write_shard(root / "per_sample" / f"sample_{i:07d}.safetensors", {i: s})
        results["one file per sample"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        ids = list(samples)
        for k in range(0, len(ids), batch):
            write_shard(root / "batched" / f"shard_{k // batch:05d}.safetensors", {i: samples[i] for i in ids[k:k + batch]})
        results[f"one file per batch ({batch})"] = time.perf_counter() - t0
    mb = sum(s["hidden"].numel() * 2 for s in samples.values()) / 2**20
    base = results["one file per sample"]
    lines = [f"# {n_samples} samples, {mb:.0f} MiB of bf16 hidden states ({n_layers} x {hidden}), atomic writes",
             f"{'writes':<28} {'seconds':>8} {'samples/s':>10} {'vs per-sample':>14}", "-" * 63]
    for name, sec in results.items():
        lines.append(f"{name:<28} {sec:>8.2f} {n_samples / sec:>10.0f} {base / sec:>13.1f}x")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--samples", type=int, default=902_000)
    p.add_argument("--token-budget", type=int, default=65536)
    p.add_argument("--buckets", type=int, default=None)
    p.add_argument("--write-samples", type=int, default=512)
    p.add_argument("--write-batch", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    t0 = time.perf_counter()
    print(padding_table(a.samples, a.token_budget, a.buckets, a.seed))
    print(f"# ({time.perf_counter() - t0:.1f}s)\n")
    print(write_rate(a.write_samples, a.write_batch, hidden=256, n_layers=5, seed=a.seed))


if __name__ == "__main__":
    main()
