"""Token datasets for extraction and DFlash: jsonl, one sample per line.

Each line is one of
  - `{"id": <any>, "input_ids": [int, ...], "loss_mask": [0|1, ...]}` (loss_mask optional: all on);
  - `{"id": <any>, "conversations": [{"role": "system"|"user"|"assistant", "content": str}, ...]}`
    (or `"messages"`): rendered with the target's own tokenizer and chat template (local files,
    `--tokenizer DIR`); the loss mask is on over the assistant turns' tokens only, after each
    turn's header, so DFlash anchors and labels fall on responses, never on prompts.
The sample index is the line's position among the valid records (0-based). A malformed line stops
the run with one line naming `file:line` (extraction must not silently drop a sample: the shards
would no longer cover the dataset). Samples longer than `max_len` are cut, and counted
(`TokenData.truncated`), never silently.

`generate_synthetic` writes a learnable stand-in (no download): each sample is an arithmetic
progression of tokens modulo a small alphabet with a little noise, lengths long-tailed, so a
drafter conditioned on the target's hidden states can learn to continue it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

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


@dataclass
class TokenData:
    ids: list[np.ndarray]
    loss_masks: list[np.ndarray]  # uint8, 1 = a response token (anchors and labels go there)
    truncated: int = 0  # samples cut to max_len
    tokens_dropped: int = 0
    truncated_where: list[str] = field(default_factory=list)  # file:line of the first few

    def report(self, max_len: int | None) -> str:
        """One line for the run log; empty when nothing was cut."""
        if not self.truncated:
            return ""
        where = ", ".join(self.truncated_where)
        return (f"# truncated {self.truncated} of {len(self.ids)} samples to --max-len {max_len} "
                f"({self.tokens_dropped} tokens dropped; first: {where})")


def load_tokenizer(path: str | Path, flag: str = "--tokenizer"):
    """The target's tokenizer (with its chat template) from a local directory, through the same
    loader as stage-1 (train.common.hf_local); DatasetError (one line, naming `flag`: the option
    the directory came from) if it is absent."""
    from train.common.hf_local import HFLocalError
    from train.common.hf_local import load_tokenizer as load_local

    try:
        tok = load_local(path)
    except HFLocalError as exc:
        raise DatasetError(f"{flag}: {exc}") from None
    if not getattr(tok, "chat_template", None):
        raise DatasetError(f"{flag} {path}: the tokenizer has no chat template; conversations need one")
    return tok


def _template_ids(tok: Any, messages: list[dict[str, str]], generation_prompt: bool) -> list[int]:
    out = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    if isinstance(out, dict) or hasattr(out, "keys"):  # a BatchEncoding in newer transformers
        out = out["input_ids"]
    return list(out)


def tokenize_conversation(tok: Any, messages: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
    """(input_ids, loss_mask) of a conversation in the tokenizer's chat template.

    Turn i's tokens are those the template adds for messages[:i+1] beyond messages[:i] plus the
    assistant header (add_generation_prompt): so the mask covers what the assistant wrote, its
    end-of-turn token included, and never its header. ValueError if the template is not
    prefix-stable (a later turn re-renders an earlier one).
    """
    for m in messages:
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant") \
                or not isinstance(m.get("content"), str):
            raise ValueError('each turn must be {"role": "system"|"user"|"assistant", "content": str}')
    if not any(m["role"] == "assistant" for m in messages):
        raise ValueError("a conversation needs at least one assistant turn")
    ids = _template_ids(tok, messages, generation_prompt=False)
    mask = np.zeros(len(ids), dtype=np.uint8)
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = _template_ids(tok, messages[:i], generation_prompt=True) if i else []
        upto = _template_ids(tok, messages[: i + 1], generation_prompt=False)
        if ids[: len(upto)] != upto or upto[: len(head)] != head:
            raise ValueError("the chat template is not prefix-stable, so assistant tokens cannot be located")
        mask[len(head): len(upto)] = 1
    return np.asarray(ids, dtype=np.int64), mask


def numbered_lines(path: Path) -> Iterator[tuple[int, str]]:
    """(line number, text) of a UTF-8 text file; DatasetError naming file:line for bytes that are not UTF-8."""
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            try:
                yield n, raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{path}:{n}: not UTF-8 text ({exc.reason} at byte {exc.start}); "
                                   "a dataset is JSON lines") from None


def _int_array(values: Any, key: str, dtype: type) -> np.ndarray:
    """A JSON list of integers as `dtype`; ValueError naming the first value that is not one or does
    not fit (numpy would truncate 1.5 and true to 1, and raise a bare OverflowError past the dtype)."""
    if not isinstance(values, list):
        raise ValueError(f"{key} must be a list of integers, got {type(values).__name__}")
    info = np.iinfo(dtype)
    for i, v in enumerate(values):
        if type(v) is not int or not info.min <= v <= info.max:
            what = "an integer" if type(v) is not int else f"in [{info.min}, {info.max}]"
            raise ValueError(f"{key}[{i}] is {json.dumps(v)[:40]}, not {what}")
    return np.asarray(values, dtype=dtype)


def load_records(path: str | Path, vocab: int, max_len: int | None = None, tokenizer: Any = None) -> TokenData:
    """Samples and their loss masks, in file order; DatasetError naming file:line on a bad record.

    `tokenizer`: the target's (load_tokenizer), needed only by conversation records.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{path}: no such dataset file")
    data = TokenData([], [])
    for n, line in numbered_lines(path):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            rec = json.loads(line)
            turns = rec.get("conversations", rec.get("messages")) if isinstance(rec, dict) else None
            if turns is not None:
                if tokenizer is None:
                    raise DatasetError(f"{where}: a conversation record needs the target's tokenizer "
                                       "(--tokenizer DIR, the target checkpoint's directory)")
                ids, mask = tokenize_conversation(tokenizer, turns)
            else:
                ids = _int_array(rec["input_ids"], "input_ids", np.int64)
                mask = (_int_array(rec["loss_mask"], "loss_mask", np.uint8) if "loss_mask" in rec
                        else np.ones(ids.shape, dtype=np.uint8))
        except DatasetError:
            raise
        except RecursionError:
            raise DatasetError(f"{where}: malformed record (JSON nested too deeply)") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise DatasetError(f"{where}: malformed record ({type(exc).__name__}: {exc}); expected "
                               '{"id", "input_ids": [int, ...]} or {"id", "conversations": [...]}') from None
        if ids.ndim != 1 or ids.size < 2:
            raise DatasetError(f"{where}: input_ids must be a list of at least 2 token ids")
        if mask.shape != ids.shape or (mask.size and mask.max() > 1):
            raise DatasetError(f"{where}: loss_mask must be 0/1, one per input id")
        if ids.min() < 0 or ids.max() >= vocab:
            raise DatasetError(f"{where}: token id out of range [0, {vocab})")
        if max_len is not None and ids.size > max_len:
            data.truncated += 1
            data.tokens_dropped += int(ids.size - max_len)
            if len(data.truncated_where) < 3:
                data.truncated_where.append(where)
            ids, mask = ids[:max_len], mask[:max_len]
        data.ids.append(ids)
        data.loss_masks.append(mask)
    if not data.ids:
        raise DatasetError(f"{path}: no samples")
    return data


def load_dataset(path: str | Path, vocab: int, max_len: int | None = None) -> list[np.ndarray]:
    """Token ids only (load_records without the masks)."""
    return load_records(path, vocab, max_len).ids
