"""Length-bucketed shuffle: bucket edges optimised for the measured lengths, new batches every epoch.

Why: batches sorted by length pad least but have the same composition every epoch (a
convergence risk); a full random shuffle pads a lot (the reference run fell from 25 to 12
Ktok/s). Bucketing keeps most of sorted's efficiency while the batches change every epoch.

Edges (`optimal_edges`): a bucket (lo, hi] pads every sample to `hi`, so its padding is
`count * hi - sum(lengths)`. The edges that minimise the total padding for `n_buckets` buckets are
found exactly by dynamic programming over the sorted distinct lengths (lengths are first rounded
up to `granularity` so the DP stays small: O(n_buckets * U^2) with U distinct rounded lengths).
`auto_edges` adds buckets until the estimate is within `max_loss` of sorted batching.

Batches (`BucketedSampler.batches(epoch)`): per epoch, with an RNG seeded by (seed, epoch), shuffle
every bucket, cut it into batches under a token budget (`batch_size * max_len <= token_budget`,
padding to the longest sample of the batch), then shuffle the order of all batches. Every sample
appears exactly once per epoch.

`python -m train.common.bucketing --lengths FILE [--buckets N] [--token-budget T]` prints the
edges, the estimated efficiency and the sorted / random baselines (one length per line, or a
.npy array).
"""

from __future__ import annotations

import argparse
import io
import math
import os
import stat
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# The reference run's edges, chosen analytically from its length distribution (902k samples).
REFERENCE_EDGES: tuple[int, ...] = (0, 770, 1216, 1728, 2432, 3296, 8192)


def _as_lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    arr = np.asarray(lengths, dtype=np.int64)
    if arr.ndim != 1 or arr.size == 0:
        raise ValueError("lengths must be a non-empty 1-D sequence")
    if (arr <= 0).any():
        raise ValueError("lengths must be positive")
    return arr


def optimal_edges(lengths: Sequence[int] | np.ndarray, n_buckets: int, granularity: int = 1,
                  max_distinct: int = 1024) -> list[int]:
    """Edges [0, e1, ..., max] (n_buckets buckets at most) minimising sum of (edge - length).

    Exact DP over distinct lengths rounded up to `granularity` (raised automatically so that at
    most `max_distinct` distinct values remain).
    """
    return optimal_edges_all(lengths, n_buckets, granularity, max_distinct)[-1]


def optimal_edges_all(lengths: Sequence[int] | np.ndarray, max_buckets: int, granularity: int = 1,
                      max_distinct: int = 1024) -> list[list[int]]:
    """The optimal edges for 1, 2, ..., max_buckets buckets, from one DP table."""
    arr = _as_lengths(lengths)
    if max_buckets < 1:
        raise ValueError("n_buckets must be >= 1")
    span = int(arr.max())
    granularity = max(granularity, -(-span // max_distinct))
    rounded = -(-arr // granularity) * granularity
    values, counts = np.unique(rounded, return_counts=True)
    u = len(values)
    k_max = min(max_buckets, u)
    # Padding is count*edge - sum(len); sum(len) is constant, so minimise sum(count_in_bucket*edge)
    # over rounded values (the rounding itself is the same for every choice of edges).
    cum = np.concatenate([[0], np.cumsum(counts)]).astype(np.float64)  # cum[j] = count of values[:j]
    vals = values.astype(np.float64)
    # best[k][j]: min cost covering values[:j] with k buckets; the last bucket ends at values[j-1].
    best = np.full((k_max + 1, u + 1), np.inf)
    arg = np.zeros((k_max + 1, u + 1), dtype=np.int64)
    best[0, 0] = 0.0
    for k in range(1, k_max + 1):
        for j in range(k, u + 1):
            # the last bucket covers values[i:j], i in [k-1, j): cost (cum[j]-cum[i]) * vals[j-1]
            cand = best[k - 1, k - 1:j] + (cum[j] - cum[k - 1:j]) * vals[j - 1]
            i = int(np.argmin(cand))
            best[k, j], arg[k, j] = cand[i], i + k - 1
    result = []
    for n in range(1, max_buckets + 1):
        k = min(n, k_max)
        edges: list[int] = [0]
        j = u
        while k > 0:
            edges.append(int(values[j - 1]))
            j = int(arg[k, j])
            k -= 1
        edges = sorted(set(edges))
        edges[-1] = max(edges[-1], span)
        result.append(edges)
    return result


def bucket_of(lengths: np.ndarray, edges: Sequence[int]) -> np.ndarray:
    """Bucket index per sample: bucket b holds edges[b] < length <= edges[b+1]."""
    edges_arr = np.asarray(edges)
    if lengths.max() > edges_arr[-1]:
        raise ValueError(f"a sample of length {int(lengths.max())} is longer than the last edge {edges_arr[-1]}")
    return np.clip(np.searchsorted(edges_arr, lengths, side="left") - 1, 0, len(edges_arr) - 2)


def edge_efficiency(lengths: Sequence[int] | np.ndarray, edges: Sequence[int]) -> float:
    """Analytic estimate: real tokens / tokens when every sample is padded to its bucket's edge."""
    arr = _as_lengths(lengths)
    padded = np.asarray(edges)[bucket_of(arr, edges) + 1]
    return float(arr.sum() / padded.sum())


def batch_by_budget(order: np.ndarray, lengths: np.ndarray, token_budget: int) -> list[np.ndarray]:
    """Cut `order` (sample indices) into consecutive batches with batch_size * max_len <= budget."""
    batches: list[np.ndarray] = []
    start, longest = 0, 0
    for pos, idx in enumerate(order):
        n = int(lengths[idx])
        new_longest = max(longest, n)
        if pos > start and new_longest * (pos - start + 1) > token_budget:
            batches.append(order[start:pos])
            start, new_longest = pos, n
        longest = new_longest
    if start < len(order):
        batches.append(order[start:])
    return batches


@dataclass(frozen=True)
class BatchStats:
    batches: int
    efficiency: float  # real tokens / padded tokens (padding to the longest sample of each batch)
    real_tokens_per_batch: float
    padded_tokens_per_batch: float


def batch_stats(batches: Sequence[np.ndarray], lengths: np.ndarray) -> BatchStats:
    real = sum(int(lengths[b].sum()) for b in batches)
    padded = sum(int(lengths[b].max()) * len(b) for b in batches)
    n = len(batches)
    return BatchStats(n, real / padded, real / n, padded / n)


def sorted_batches(lengths: np.ndarray, token_budget: int) -> list[np.ndarray]:
    """Baseline: all samples sorted by length (same batches every epoch)."""
    return batch_by_budget(np.argsort(lengths, kind="stable"), lengths, token_budget)


def random_batches(lengths: np.ndarray, token_budget: int, seed: int = 0) -> list[np.ndarray]:
    """Baseline: one full random shuffle."""
    return batch_by_budget(np.random.default_rng(seed).permutation(len(lengths)), lengths, token_budget)


class BucketedSampler:
    """Batches of sample indices, bucketed by length, different compositions every epoch."""

    def __init__(self, lengths: Sequence[int] | np.ndarray, token_budget: int, edges: Sequence[int] | None = None,
                 n_buckets: int | None = None, seed: int = 0, max_loss: float = 0.03) -> None:
        self.lengths = _as_lengths(lengths)
        if token_budget < int(self.lengths.max()):
            raise ValueError(f"token budget {token_budget} is below the longest sample ({int(self.lengths.max())})")
        self.token_budget = token_budget
        self.seed = seed
        if edges is None:
            edges = (optimal_edges(self.lengths, n_buckets) if n_buckets
                     else auto_edges(self.lengths, token_budget, max_loss=max_loss))
        self.edges = [int(e) for e in edges]
        self.bucket = bucket_of(self.lengths, self.edges)

    def batches(self, epoch: int) -> list[np.ndarray]:
        rng = np.random.default_rng([self.seed, epoch])
        out: list[np.ndarray] = []
        for b in range(len(self.edges) - 1):
            members = np.flatnonzero(self.bucket == b)
            if members.size:
                out += batch_by_budget(rng.permutation(members), self.lengths, self.token_budget)
        order = rng.permutation(len(out))
        return [out[i] for i in order]

    def stats(self, epoch: int = 0) -> BatchStats:
        return batch_stats(self.batches(epoch), self.lengths)


def composition_overlap(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    """Fraction of the batches of `b` that are also batches (same sample set) of `a`: 1.0 = unchanged."""
    seen = {frozenset(int(i) for i in batch) for batch in a}
    return sum(frozenset(int(i) for i in batch) in seen for batch in b) / max(1, len(b))


def auto_edges(lengths: np.ndarray, token_budget: int, max_loss: float = 0.03, max_buckets: int = 64) -> list[int]:
    """The fewest optimal buckets whose measured efficiency is within `max_loss` of sorted batching."""
    target = batch_stats(sorted_batches(lengths, token_budget), lengths).efficiency - max_loss
    table = optimal_edges_all(lengths, max_buckets)

    def good(n: int) -> bool:
        return BucketedSampler(lengths, token_budget, edges=table[n - 1]).stats(0).efficiency >= target

    lo, hi = 1, max_buckets  # efficiency grows (up to batching noise) with the number of buckets
    if not good(hi):
        return table[hi - 1]
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if good(mid) else (mid + 1, hi)
    return table[lo - 1]


def long_tail_lengths(n: int, seed: int = 0, lo: int = 467, hi: int = 8192, median: float = 1100.0,
                      sigma: float = 0.6) -> np.ndarray:
    """Synthetic lengths shaped like the reference run: lognormal, bulk under 3k, clipped to [lo, hi]."""
    rng = np.random.default_rng(seed)
    x = rng.lognormal(np.log(median), sigma, size=n)
    return np.clip(np.rint(x), lo, hi).astype(np.int64)


# ---------------------------------------------------------------------------------------------


def compare(lengths: np.ndarray, token_budget: int, n_buckets: int | None, seed: int = 0,
            edges: Sequence[int] | None = None) -> list[tuple[str, BatchStats, float, str]]:
    """Rows (name, stats, composition overlap between epoch 0 and 1, edges) for the table."""
    rows: list[tuple[str, BatchStats, float, str]] = []
    srt = sorted_batches(lengths, token_budget)
    rows.append(("sorted", batch_stats(srt, lengths), 1.0, "-"))
    r0, r1 = random_batches(lengths, token_budget, seed), random_batches(lengths, token_budget, seed + 1)
    rows.append(("random", batch_stats(r0, lengths), composition_overlap(r0, r1), "-"))
    opt = BucketedSampler(lengths, token_budget, n_buckets=n_buckets, seed=seed)
    rows.append((f"bucketed (optimised, {len(opt.edges) - 1} buckets)", opt.stats(0),
                 composition_overlap(opt.batches(0), opt.batches(1)), str(opt.edges)))
    for name, given in (("bucketed (given edges)", edges),):
        if given is not None and max(given) >= lengths.max():
            s = BucketedSampler(lengths, token_budget, edges=given, seed=seed)
            rows.append((name, s.stats(0), composition_overlap(s.batches(0), s.batches(1)), str(list(given))))
    return rows


def format_table(rows: list[tuple[str, BatchStats, float, str]]) -> str:
    head = f"{'batching':<36} {'efficiency':>10} {'batches':>8} {'real tok/batch':>14} {'padded tok/batch':>16} " \
           f"{'same batches next epoch':>23}  edges"
    lines = [head, "-" * len(head)]
    for name, st, overlap, edges in rows:
        lines.append(f"{name:<36} {100 * st.efficiency:>9.1f}% {st.batches:>8} {st.real_tokens_per_batch:>14.0f} "
                     f"{st.padded_tokens_per_batch:>16.0f} {100 * overlap:>22.1f}%  {edges}")
    return "\n".join(lines)


MAX_LENGTHS_BYTES = 256 << 20


INT64_MAX = 2**63 - 1


def _check_npy_lengths(path: Path, raw: bytes) -> None:
    """ValueError unless the .npy header describes integers that the file holds: numpy would cast
    floats to ints without a word, and allocate whatever count the header claims before reading
    (10^11 entries: 745 GiB)."""
    buf = io.BytesIO(raw)
    version = np.lib.format.read_magic(buf)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(buf)
    if dtype.kind not in "iu":
        raise ValueError(f"it holds {dtype} values, not integers")
    count = math.prod(shape)
    if count * dtype.itemsize > len(raw) - buf.tell():
        raise ValueError(f"its header claims {count} entries ({count * dtype.itemsize} bytes), the file holds "
                         f"{len(raw) - buf.tell()} bytes of data")


def read_lengths(path: str | Path) -> np.ndarray:
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such file")
    if path.is_dir():
        raise ValueError(f"{path}: a directory, not a lengths file")
    # A FIFO would block and /dev/zero never end: a regular file only, and bounded.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise ValueError(f"{path}: cannot be read ({exc.strerror})") from None
    with open(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise ValueError(f"{path}: not a regular file (a FIFO, device or socket); give a lengths file")
        if info.st_size > MAX_LENGTHS_BYTES:
            raise ValueError(f"{path}: {info.st_size >> 20} MiB, over the {MAX_LENGTHS_BYTES >> 20} MiB a lengths file "
                             "may have; sample the lengths (a few million are plenty)")
        raw = f.read(MAX_LENGTHS_BYTES + 1)
    if path.suffix == ".npy":
        try:
            _check_npy_lengths(path, raw)
            return _as_lengths(np.load(io.BytesIO(raw)))  # allow_pickle stays False: a length file never needs objects
        except (ValueError, OSError) as exc:
            raise ValueError(f"{path}: not a .npy array of lengths ({str(exc).split('. ')[0]})") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not UTF-8 text (one length per line) and not a .npy array") from None
    values = []
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                values.append(int(line))
            except ValueError:
                raise ValueError(f"{path}:{n}: not an integer length: {line.strip()[:40]!r}") from None
            if abs(values[-1]) > INT64_MAX:
                raise ValueError(f"{path}:{n}: a length of {len(line.strip())} digits, past the largest a length may "
                                 f"be ({INT64_MAX})")
    if not values:  # /dev/null, an empty file, blank lines only
        raise ValueError(f"{path}: empty: no lengths in it (one positive integer per line)")
    return _as_lengths(values)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, prog="python -m train.common.bucketing", description=__doc__.splitlines()[0])
    p.add_argument("--lengths", required=True, help="one length per line, or a .npy array")
    p.add_argument("--buckets", type=int, default=None, help="number of buckets (default: fewest within 3 points "
                   "of sorted)")
    p.add_argument("--token-budget", type=int, default=None, help="tokens per batch (default: 8 x longest)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    try:
        lengths = read_lengths(a.lengths)
        budget = a.token_budget or 8 * int(lengths.max())
        rows = compare(lengths, budget, a.buckets, a.seed, edges=REFERENCE_EDGES)
    except ValueError as exc:
        print(f"buckets: error: {exc}", file=sys.stderr)
        return 2
    print(f"# {len(lengths)} samples, lengths {int(lengths.min())}..{int(lengths.max())}, token budget {budget}")
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
