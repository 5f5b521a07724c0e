"""Token datasets for extraction and DFlash: jsonl, one sample per line.

Format: `{"id": <any>, "input_ids": [int, ...]}` per line; the sample index is the line's
position among the valid records (0-based). A malformed line stops the run with one line naming
`file:line` (extraction must not silently drop a sample: the shards would no longer cover the
dataset).

`generate_synthetic` writes a learnable stand-in (no download): each sample is an arithmetic
progression of tokens modulo a small alphabet with a little noise, lengths long-tailed, so a
drafter conditioned on the target's hidden states can learn to continue it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from toolkit.fsutil import atomic_write_text


class DatasetError(RuntimeError):
    """Data that cannot be used; one line saying what and where."""


def generate_synthetic(path: str | Path, n: int, seed: int = 0, vocab: int = 4096, min_len: int = 24,
                       max_len: int = 256, median: float = 64.0, alphabet: int = 64) -> Path:
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(np.log(median), 0.6, size=n)), min_len, max_len).astype(int)
    lines = []
    for i, n_tok in enumerate(lengths):
        start, step = int(rng.integers(alphabet)), 1  # step 1: learnable from the anchor alone
        toks = (start + step * np.arange(n_tok)) % alphabet
        noise = rng.random(n_tok) < 0.05
        toks[noise] = rng.integers(alphabet, size=int(noise.sum()))
        toks = toks + 32  # clear of token 0 and the low ids
        assert toks.max() < vocab
        lines.append(json.dumps({"id": f"syn-{i}", "input_ids": toks.tolist()}))
    path = Path(path)
    atomic_write_text(path, "\n".join(lines) + "\n")
    return path


def load_dataset(path: str | Path, vocab: int, max_len: int | None = None) -> list[np.ndarray]:
    """Samples as int64 arrays, in file order; DatasetError naming file:line on a bad record."""
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such dataset file")
    samples: list[np.ndarray] = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{n}"
            try:
                rec = json.loads(line)
                ids = np.asarray(rec["input_ids"], dtype=np.int64)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise DatasetError(f"{where}: malformed record ({type(exc).__name__}: {exc}); "
                                   'expected {"id": ..., "input_ids": [int, ...]}') from None
            if ids.ndim != 1 or ids.size < 2:
                raise DatasetError(f"{where}: input_ids must be a list of at least 2 token ids")
            if ids.min() < 0 or ids.max() >= vocab:
                raise DatasetError(f"{where}: token id out of range [0, {vocab})")
            if max_len is not None and ids.size > max_len:
                ids = ids[:max_len]
            samples.append(ids)
    if not samples:
        raise DatasetError(f"{path}: no samples")
    return samples
