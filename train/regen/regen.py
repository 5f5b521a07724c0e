"""Regenerate the assistant turns of a conversation dataset with the target itself.

The DFlash method trains the drafter on the target's own responses, so that the drafter learns
what the target will say, not what the dataset's authors wrote. For each conversation, every
assistant turn is replaced, in order, by the target's generation given the turns before it
(earlier turns already regenerated), through transformers' batched `generate` with the sampling
settings of the job spec (`--temperature`, `--top-p`, `--top-k`, `--max-new-tokens`).

`python -m train.regen --init-from TARGET_DIR --data chat.jsonl` runs behind the Slurm guard;
`main(argv, guard=False)` only for tests. The target (weights, tokenizer and chat template) is
loaded from its local directory with transformers' Auto classes.

Output under --out (default $LAUNCH_JOB_DIR):
    part_00007.jsonl   one file per batch of --batch-size conversations (atomic: tmp, fsync,
                       rename): `{"id", "conversations": [...], "regenerated": n_turns}` lines
    data.jsonl         all parts in dataset order, written once every part exists: the input of
                       `launch submit extract --arg data=...` and of online DFlash training
    meta.json          the settings; a re-run with other settings in the same --out is refused
A re-run resumes: a part whose lines parse and match its batch is kept, anything else rewritten.
Sampling is seeded per part (seed, part), so a resumed part regenerates the same text.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from toolkit.fsutil import atomic_write_text
from toolkit.metrics import format_eta
from train.common.config import ConfigError
from train.common.entrypoint import run_entrypoint
from train.common.fastpath import FastPathError
from train.common.hf_local import _one_line as one_line  # transformers errors in one line
from train.extract.data import DatasetError, load_tokenizer, numbered_lines
from train.regen.args import RegenConfig, parse_args  # noqa: F401 - the flags live there (no torch)

ENTRYPOINT = "train.regen"
META = "meta.json"


SETTINGS = ("init_from", "data", "batch_size", "max_new_tokens", "temperature", "top_p", "top_k", "seed")


def main(argv: list[str] | None = None, guard: bool = True) -> int:
    return run_entrypoint(ENTRYPOINT, argv, parse=parse_args, run=regen, guard=guard,
                          run_errors=(DatasetError, FastPathError, ValueError, OSError))


def read_conversations(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        raise DatasetError(f"{path}: no such dataset file")
    out = []
    for n, line in numbered_lines(path):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            turns = rec.get("conversations", rec.get("messages"))
            if not isinstance(turns, list) or not all(isinstance(t, dict) and t.get("role") in
                                                      ("system", "user", "assistant") for t in turns):
                raise ValueError('"conversations" must be a list of {"role", "content"} turns')
            if not any(t["role"] == "assistant" for t in turns):
                raise ValueError("no assistant turn to regenerate")
        except (json.JSONDecodeError, AttributeError, ValueError) as exc:
            raise DatasetError(f"{path}:{n}: malformed conversation ({exc})") from None
        except RecursionError:
            raise DatasetError(f"{path}:{n}: malformed conversation (JSON nested too deeply)") from None
        out.append({"id": rec.get("id", n - 1), "conversations": turns})
    if not out:
        raise DatasetError(f"{path}: no conversations")
    return out


def part_name(k: int) -> str:
    return f"part_{k:05d}.jsonl"


def part_done(path: Path, batch: list[dict[str, Any]]) -> bool:
    """A part written whole for this batch (same ids, in order, every line parsing)."""
    if not path.is_file():
        return False
    try:
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    except json.JSONDecodeError:
        return False
    return [r.get("id") for r in lines] == [r["id"] for r in batch]


def check_target_dir(cfg: RegenConfig) -> None:
    path = Path(cfg.init_from)
    if not (path / "config.json").is_file():
        raise ConfigError(f"--init-from {path}: no config.json there; give the target's local checkpoint dir")


def load_target(cfg: RegenConfig, device: torch.device):
    """The target checkpoint as it is, straight onto `device` in its own dtype (bf16 on CUDA when it
    says fp32), without a host copy of the model (train.extract.target.load_causal_lm)."""
    from train.extract.target import TargetError, load_causal_lm

    path = Path(cfg.init_from)
    check_target_dir(cfg)
    dtype = "auto" if device.type == "cuda" else "float32"
    try:
        model = load_causal_lm(path, device, dtype)
    except TargetError as exc:
        raise ConfigError(str(exc)) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:  # transformers' messages run to paragraphs
        first = one_line(exc).split(". ")[0]  # the reason, not transformers' upgrade advice
        raise ConfigError(f"--init-from {path}: the target does not load ({first})") from None
    if device.type == "cuda" and next(model.parameters()).dtype == torch.float32:
        model = model.to(torch.bfloat16)  # an fp32 checkpoint generates in bf16 on GPUs, as before
    return model


def generate_turns(model, tok, prompts: list[list[dict[str, str]]], cfg: RegenConfig, seed: int,
                   device: torch.device) -> list[str]:
    """One batched generate: the assistant's next turn for each prompt (left padding)."""
    texts = [tok.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    torch.manual_seed(seed)
    sample = cfg.temperature > 0
    kwargs: dict[str, Any] = {"do_sample": sample, "max_new_tokens": cfg.max_new_tokens,
                              "pad_token_id": tok.pad_token_id, "eos_token_id": tok.eos_token_id}
    if sample:
        kwargs.update(temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k)
    with torch.no_grad():
        out = model.generate(**enc, **kwargs)
    new = out[:, enc["input_ids"].shape[1]:]
    return [tok.decode(row, skip_special_tokens=True) for row in new]


def regenerate(model, tok, batch: list[dict[str, Any]], cfg: RegenConfig, seed: int, device: torch.device
               ) -> list[dict[str, Any]]:
    """Every assistant turn of every conversation in the batch, in order, batched across
    conversations turn by turn (round r regenerates each conversation's r-th assistant turn)."""
    convs = [[dict(t) for t in rec["conversations"]] for rec in batch]
    slots = [[i for i, t in enumerate(c) if t["role"] == "assistant"] for c in convs]
    for r in range(max(len(s) for s in slots)):
        todo = [(c, s[r]) for c, s in enumerate(slots) if r < len(s)]
        texts = generate_turns(model, tok, [convs[c][:i] for c, i in todo], cfg, seed * 1000 + r, device)
        for (c, i), text in zip(todo, texts, strict=True):
            convs[c][i]["content"] = text
    return [{"id": rec["id"], "conversations": c, "regenerated": len(s)}
            for rec, c, s in zip(batch, convs, slots, strict=True)]


def regen(cfg: RegenConfig) -> int:
    from train.common import fastpath

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    fastpath.select_kernels(device, allow_slow_path=cfg.allow_slow_path)  # refuse a slow GPU path early
    out = Path(cfg.out)
    if out.exists() and not out.is_dir():
        raise ConfigError(f"--out {out}: a file, not a directory; give the regeneration's directory")
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: getattr(cfg, k) for k in SETTINGS}
    settings["data"] = str(Path(cfg.data).resolve())
    if (out / META).exists():
        try:
            old = json.loads((out / META).read_text())
        except (UnicodeDecodeError, ValueError) as exc:
            raise ConfigError(f"{out / META}: not JSON ({exc}); use a new --out") from None
        changed = [k for k in SETTINGS if not isinstance(old, dict) or old.get(k) != settings[k]]
        if changed:
            raise ConfigError(f"{out}: holds a regeneration with different {', '.join(changed)}; "
                              "use a new --out or the same arguments as before")
    records = read_conversations(Path(cfg.data))
    batches = [records[i:i + cfg.batch_size] for i in range(0, len(records), cfg.batch_size)]
    check_target_dir(cfg)
    tok = load_tokenizer(cfg.tokenizer or cfg.init_from, "--tokenizer" if cfg.tokenizer else "--init-from")
    model = load_target(cfg, device)
    # Written once the inputs have loaded: a run refused for a bad input leaves no settings behind.
    if not (out / META).exists():
        atomic_write_text(out / META, json.dumps(settings, indent=1) + "\n")
    print(f"# regen: {len(records)} conversations, {len(batches)} parts, temperature={cfg.temperature} "
          f"top_p={cfg.top_p} top_k={cfg.top_k} max_new_tokens={cfg.max_new_tokens} device={device.type}", flush=True)
    t0, written, skipped = time.perf_counter(), 0, 0
    for k, batch in enumerate(batches):
        path = out / part_name(k)
        if part_done(path, batch):
            skipped += 1
            continue
        if cfg.stop_after is not None and written >= cfg.stop_after:
            break
        rows = regenerate(model, tok, batch, cfg, cfg.seed * 1_000_003 + k, device)
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
        written += 1
        took = time.perf_counter() - t0
        left = sum(1 for j in range(k + 1, len(batches)) if not (out / part_name(j)).exists())
        if cfg.stop_after is not None:
            left = min(left, cfg.stop_after - written)
        print(f"part {k + 1}/{len(batches)} | {len(batch)} conversations | {written * cfg.batch_size / took:.2f} conv/s"
              f" | eta {format_eta(left * took / written)}", flush=True)
    complete = all(part_done(out / part_name(k), b) for k, b in enumerate(batches))
    if complete:
        atomic_write_text(out / "data.jsonl", "".join((out / part_name(k)).read_text() for k in range(len(batches))))
    summary = {"parts": len(batches), "written": written, "skipped": skipped, "complete": complete,
               "data": str((out / "data.jsonl").resolve()) if complete else None}
    if complete:
        atomic_write_text(out / "summary.json", json.dumps(summary, indent=1) + "\n")
    print(f"# done: {json.dumps(summary)}", flush=True)
    return 0


__all__ = ["RegenConfig", "main", "regen"]
